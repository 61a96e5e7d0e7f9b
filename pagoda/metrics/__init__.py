"""Engine statistics and their Prometheus exposition."""
