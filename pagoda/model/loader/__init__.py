"""Weight loaders: Hugging Face directories, GGUF files, and dummy weights."""
