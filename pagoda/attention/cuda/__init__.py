"""CUDA kernels (compiled at first use with NVRTC) for attention shapes Triton serves slowly."""
