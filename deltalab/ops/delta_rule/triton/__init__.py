"""Triton kernels of the generalized delta rule (compiled on CUDA, interpreted on CPU)."""
