"""Kernels: the fused AdamW update in Pallas (Triton on GPU, interpret mode on CPU) and the
native host AdamW (an XLA FFI handler in C++, compiled at first use: :mod:`zerojax.kernels._native`)."""
