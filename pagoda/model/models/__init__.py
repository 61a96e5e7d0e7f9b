"""Model definitions, one file per family; looked up by architecture name in `registry.py`."""
