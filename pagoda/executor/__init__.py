"""Executors: run the model runner in-process (one device) or across workers (tensor parallel)."""
