"""The torch-free core: request state, block pool, KV cache manager and scheduler."""
