# flowpacer: `make demo` shows the daemon at work, `make test` runs every test (README).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: deps demo test test-vm bench bench-quick soak install kmod sim clean

deps: .deps-stamp
.deps-stamp: tools/setup.sh pyproject.toml
	bash tools/setup.sh
	touch $@

demo: deps
	$(PY) -m flowpacer.demo

test: deps
	$(PY) -m pytest -ra $(PYTEST_ARGS)

test-vm: deps
	$(PY) -m pytest -ra tests/test_vm.py

bench: deps
	$(PY) -m bench.run

bench-quick: deps
	$(PY) -m bench.run --quick

kmod: deps
	$(MAKE) -C flowpacer/kmod

sim: deps
	$(MAKE) -C flowpacer/kmod sim

install: deps
	bash tools/install.sh

soak: deps
	$(PY) -m bench.reliability --cycles $${SOAK_CYCLES:-1000000}

clean:
	rm -rf build *.egg-info .pytest_cache
	$(MAKE) -C flowpacer/kmod clean 2>/dev/null || true
