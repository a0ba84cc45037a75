# The two commands of the README. Each sets itself up on a fresh machine: a virtualenv made with
# --system-site-packages, so a pod's preinstalled torch (and its triton) is reused, never replaced.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nsa-installed
ARGS   ?=

.PHONY: oneshot test setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# when $(PYTHON) is itself a virtualenv (common on pods), --system-site-packages only reaches the
	@# base interpreter: a .pth makes the parent's packages (its torch, triton) visible as well
	@$(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
	  > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_nsa_parent_site.pth"
	@# offline pods (everything already installed): no build isolation; otherwise the normal install
	@$(PY) -m pip install -q --no-build-isolation -e ".[dev]" 2>/dev/null || $(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

oneshot: $(STAMP)
	@$(VENV)/bin/nsa-validate oneshot $(ARGS)

# pytest over tests/ and suites/, as one process per core on a CPU machine (tests/parallel.py)
test: $(STAMP)
	@$(PY) tests/parallel.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
