# `make demo` and `make test` are the two entry points (see README.md).
.PHONY: setup demo test lint bench

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadscope

lint: setup
	.venv/bin/ruff check runtime handlers tests bench scripts
	.venv/bin/mypy

bench: setup
	.venv/bin/python bench/run.py
