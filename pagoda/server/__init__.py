"""The OpenAI-compatible HTTP server: protocol models, handlers, app and launcher."""
