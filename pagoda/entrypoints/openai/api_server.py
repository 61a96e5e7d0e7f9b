"""`python -m pagoda.entrypoints.openai.api_server --model PATH ...`: vLLM's module path for
the server; the implementation is `pagoda.server.api_server` (same flags as `pagoda serve`)."""

from pagoda.server.api_server import main

if __name__ == "__main__":
    main()
