"""Kernels: the fused AdamW update in Pallas (a GPU kernel in a program lowered for a GPU,
interpret mode in one lowered for CPU) and the native host AdamW (an XLA FFI handler in C++,
compiled at first use: :mod:`zerojax.kernels._native`)."""
