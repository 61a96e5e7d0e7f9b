"""`python -m pagoda.entrypoints.openai.api_server`: the OpenAI-compatible server."""
