"""Building blocks shared by every model: linear layers, norms, rotary embeddings, attention."""
