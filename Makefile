# `make demo` and `make test` are the two entry points (see README.md).
.PHONY: setup demo test test-fast test-lowest lint bench

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadscope
	$(MAKE) test-lowest

# In-process tests only: no process, server, image or PostgreSQL (tests/conftest.py).
# Sets up .venv only where there is none: the quick loop pays no reinstall.
test-fast: .venv/bin/python
	THAW_TESTS_IN_PROCESS=1 .venv/bin/python -m pytest -q -n 2 --dist loadscope \
		-m "not process and not image and not slow"

.venv/bin/python:
	./scripts/setup.sh

# The server-facing tests (the HTTP server and its connections, slow clients, shutdown,
# streaming, the emulator's Runtime API) on the lowest uvicorn, starlette and httpx that
# pyproject.toml admits. .venv-lowest holds those three alone and reads everything else
# from .venv (a .pth line), so it builds in seconds.
LOWEST = uvicorn==0.30.0 starlette==1.7.0 httpx==0.27.0
LOWEST_TESTS = tests/http/test_connections.py tests/http/test_writes.py \
	tests/http/test_first_route.py tests/http/test_contract.py tests/http/test_http.py \
	tests/http/test_errors.py tests/http/test_slow_clients.py tests/http/test_shutdown.py \
	tests/http/test_streaming.py tests/http/test_access_log.py tests/security/test_limits.py \
	tests/emulator/test_streaming.py tests/emulator/test_runtime_api.py

.venv-lowest/lowest.txt: Makefile
	test -x .venv/bin/python || ./scripts/setup.sh
	rm -rf .venv-lowest
	.venv/bin/python -m venv --without-pip .venv-lowest
	echo "import site; site.addsitedir('$$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$(.venv-lowest/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-thaw-venv.pth"
	.venv/bin/pip --python .venv-lowest/bin/python install -q --no-deps $(LOWEST)
	echo "$(LOWEST)" > $@

test-lowest: .venv-lowest/lowest.txt
	.venv-lowest/bin/python -m pytest -q -n 2 --dist loadscope -p no:cacheprovider $(LOWEST_TESTS)

lint: setup
	.venv/bin/ruff check runtime handlers tests bench scripts
	.venv/bin/mypy

bench: setup
	.venv/bin/python bench/run.py
