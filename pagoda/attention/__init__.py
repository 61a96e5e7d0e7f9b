"""Attention over the paged KV cache: one interface, a torch reference and Triton kernels."""
