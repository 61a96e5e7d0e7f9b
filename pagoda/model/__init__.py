"""Models: Llama-family decoders built from shared layers, their registry, and the weight loaders."""
