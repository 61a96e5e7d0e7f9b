"""The worker side of a step: model runner, input preparation, KV cache allocation."""
