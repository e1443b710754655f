"""Benchmarks against physical limits; run all with `.venv/bin/python bench/run.py`."""
