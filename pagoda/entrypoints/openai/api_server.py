"""`python -m pagoda.entrypoints.openai.api_server --model PATH ...`: vLLM's module path for
the server; the implementation is `pagoda.server.cli` (same flags as `pagoda serve`)."""

from pagoda.server.cli import main

if __name__ == "__main__":
    main()
