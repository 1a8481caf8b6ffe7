"""Pallas kernels: the fused AdamW update (Triton on GPU, interpret mode on CPU)."""
