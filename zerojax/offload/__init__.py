"""Host-memory and NVMe offload, host optimizers and fused kernels."""
