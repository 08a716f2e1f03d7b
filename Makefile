# rtxops: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch lies on local disk on these machines; any newer range pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
DEMO_STEPS ?= 1500

.PHONY: install bytecode demo test bench clean chromium

install: $(STAMP) bytecode

# the C decoder, encoder, aggregation and call buffer are built by the install: a changed source
# installs again, and the old builds go first (a source that no longer compiles must not leave its
# last build in use). The C++ dispatch core compiles against the torch just installed (~40 s);
# where it does not build, the routing runs in Python
NATIVE_BUILDS = rtxops/telemetry/*.so rtxops/runtime/*.so
$(STAMP): pyproject.toml Makefile setup.py $(wildcard rtxops/telemetry/_native/*.c) \
		rtxops/runtime/_native/dispatch_core.cpp rtxops/runtime/_native/build.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	rm -f $(NATIVE_BUILDS)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) rtxops/runtime/_native/build.py || echo "rtxops: the C++ dispatch core did not build; routing runs in Python"
	touch $(STAMP)

# rtxops's own bytecode, as a wheel install compiles it: an editable install leaves the sources to
# be compiled at import, and where PYTHONDONTWRITEBYTECODE is set (CI images, these machines) every
# `rtxops run`, job and daemon compiled them again, ~0.15 s of each start-up. Stale files only.
bytecode: $(STAMP)
	$(PY) -m compileall -q rtxops

demo: install
	@bash examples/demo.sh "$(VENV)" "$(DEMO_STEPS)"

test: install chromium
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=15 -p no:cacheprovider

# The dashboard's browser tests drive Debian's Chromium (never `playwright install`).
chromium:
	@command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && $$SUDO apt-get install -y chromium; }

bench: install
	mkdir -p bench/results
	$(PY) bench/dispatch_overhead.py --out bench/results/dispatch_overhead.json
	$(PY) bench/step_overhead.py --pairs 3 --steps 300 --warmup 20 --run-args=--no-telemetry \
	  --out bench/results/step_overhead_runtime_only.json
	$(PY) bench/step_overhead.py --pairs 5 --steps 300 --warmup 20 --run-args=--direct \
	  --out bench/results/step_overhead_direct.json
	$(PY) bench/step_overhead.py --pairs 5 --steps 300 --warmup 20 --out bench/results/step_overhead.json
	$(PY) bench/step_overhead_inprocess.py --pairs 10 --out bench/results/step_overhead_inprocess.json
	$(PY) bench/step_overhead_interleaved.py --out bench/results/step_overhead_interleaved.json
	$(PY) bench/daemon_request_cost.py --out bench/results/daemon_request_cost.json
	$(PY) bench/startup.py --out bench/results/startup.json
	$(PY) bench/ingest.py --out bench/results/ingest.json
	$(PY) bench/store_query.py --out bench/results/store_query.json
	$(PY) bench/soak.py --minutes 8 --out bench/results/soak.json
	$(PY) bench/evolve_gpt.py --out bench/results/evolve_gpt.json
	$(PY) bench/explore_cost.py --out bench/results/explore_cost.json
	$(PY) bench/converged_inprocess.py --out bench/results/converged_inprocess.json
	$(PY) bench/converged_profile.py --out bench/results/converged_profile.json
	$(PY) bench/compile_options.py --out bench/results/compile_options.json
	$(PY) bench/replay.py --out bench/results/replay.json
	$(PY) bench/sign_verify.py --out bench/results/sign_verify.json
	$(PY) bench/dashboard_api.py --out bench/results/dashboard_api.json
	$(PY) bench/page_load.py --out bench/results/page_load.json

clean:
	rm -rf $(VENV) .rtxops .pytest_cache build $(NATIVE_BUILDS)
