# `make demo` and `make test` are the two entry points (see README.md).
.PHONY: setup demo test test-fast lint bench

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadscope

# In-process tests only: no process, server, image or PostgreSQL (tests/conftest.py).
test-fast: setup
	THAW_TESTS_IN_PROCESS=1 .venv/bin/python -m pytest -q -n 2 --dist loadscope \
		-m "not process and not image and not slow"

lint: setup
	.venv/bin/ruff check runtime handlers tests bench scripts
	.venv/bin/mypy

bench: setup
	.venv/bin/python bench/run.py
