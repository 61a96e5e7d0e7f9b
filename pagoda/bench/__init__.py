"""Benchmarks: offline throughput and serving load generation."""
