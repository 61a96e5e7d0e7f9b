"""The engine: input processing, the step loop, output processing."""
