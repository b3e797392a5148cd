# flowpacer: `make demo` shows the daemon at work, `make test` runs every test, `make check` the
# fast subset that needs neither root nor the VM (README).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: deps deps-test deps-build deps-demo deps-install venv demo test check test-vm bench bench-quick \
	soak install kmod sim clean deb

# What each target installs on this host (tools/setup.sh says it before doing it):
#   deps-build    make deb's: dpkg-buildpackage, debian/control's Build-Depends, lintian
#   deps-install  make install's: python3 with venv and pip, bcc, DKMS and a compiler
#   deps-demo     make demo's: install's, the release's kernel headers, clang ..., the venv
#   deps (= deps-test)  everything make test needs besides: nginx, prometheus, qemu, tshark,
#                 mmdebstrap ..., the test VM's kernels (on Debian 12 bookworm-backports' 6.12
#                 becomes the default boot kernel), the venv. Never a prerequisite of deb/install.
deps deps-test: .deps-stamp
.deps-stamp: tools/setup.sh pyproject.toml
	bash tools/setup.sh test
	touch $@

deps-build: .deps-build-stamp
.deps-build-stamp: tools/setup.sh
	bash tools/setup.sh build
	touch $@

deps-demo: .deps-demo-stamp
.deps-demo-stamp: tools/setup.sh pyproject.toml
	bash tools/setup.sh demo
	touch $@

deps-install: .deps-install-stamp
.deps-install-stamp: tools/setup.sh
	bash tools/setup.sh install
	touch $@

demo: deps-demo
	$(PY) -m harness.demo

# Without PYTEST_ARGS: two lanes at once, the wall-clock tests beside the untimed ones (harness/lanes.py;
# logs in build/test-logs/); with them, one plain pytest of what they select.
test: deps
	$(PY) -m harness.lanes $(PYTEST_ARGS)

# The tests that need no root, no VM and no Debian root, in a few minutes: what carries none of
# the markers of pyproject.toml. FLOWPACER_CHECK=1 turns on the guard of harness/checkmode.py: a
# test here that makes a namespace, boots the VM, starts the daemon or compiles bcc fails and
# names the marker it lacks. Needs only the venv (and a C compiler), not `make deps`' packages.
CHECK_MARKERS := not kernel and not vm and not heavy and not deb and not slow
check: venv
	FLOWPACER_CHECK=1 $(PY) -m pytest -ra -m "$(CHECK_MARKERS)" $(PYTEST_ARGS)

# the venv alone (tools/setup.sh makes the same one with Debian's packages around it)
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	[ -x $(PY) ] || python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]' prometheus-client matplotlib numpy
	touch $@

test-vm: deps
	$(PY) -m pytest -ra tests/test_vm.py

bench: deps
	$(PY) -m bench.run

bench-quick: deps
	$(PY) -m bench.run --quick

kmod: deps
	$(MAKE) -C flowpacer/kernel/kmod

sim: deps
	$(PY) -c 'from harness.pspsim import pspsim; print(pspsim.build(force=True))'

install: deps-install
	bash tools/install.sh

# Debian packages flowpacer_*.deb and sch-psp-dkms_*.deb (debian/, docs/packaging.md), built with
# dpkg-buildpackage from a copy of the checkout's files in $(DEB_OUT)/flowpacer (the .debs land in
# $(DEB_OUT)), then checked by lintian: any error fails the target.
DEB_OUT ?= build/deb
# Debian's own python3 and tools, not whatever python3 comes first in PATH (pyenv, a venv)
DEB_PATH := /usr/sbin:/usr/bin:/sbin:/bin
deb: deps-build
	rm -rf $(DEB_OUT) && mkdir -p $(DEB_OUT)/flowpacer
	git ls-files -z --cached --others --exclude-standard | \
	  (while IFS= read -r -d '' f; do [ -f "$$f" ] && printf '%s\0' "$$f"; done) | \
	  tar --null -T - -cf - | tar -C $(DEB_OUT)/flowpacer -xf -
	cd $(DEB_OUT)/flowpacer && PATH=$(DEB_PATH) dpkg-buildpackage -b -us -uc
	PATH=$(DEB_PATH) lintian --fail-on error --display-info $(DEB_OUT)/*.changes
	@ls -1 $(DEB_OUT)/*.deb

soak: deps
	$(PY) -m bench.reliability --cycles $${SOAK_CYCLES:-1000000}

clean:
	rm -rf build *.egg-info .pytest_cache
	$(MAKE) -C flowpacer/kernel/kmod clean 2>/dev/null || true
