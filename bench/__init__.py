"""Benchmarks: the registered ones in bench/run.py (`bench/run.py --list`), their
shared code, the peers they measure against; experiments under bench/experiments/."""
