# The developer interface. `make demo` runs the main job, `make test` runs every test.
# Both bootstrap what they need (.venv with torch, the release build of the extension).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
STAMP := $(VENV)/.deps-stamp
PY_DEPS := torch numpy pytest pytest-timeout pytest-xdist pytest-benchmark maturin ruff pyyaml selenium prometheus-client hypothesis mypy kubernetes-validate torchdata opentelemetry-sdk opentelemetry-exporter-otlp-proto-http nvidia-ml-py
# Only `make test-integrations` needs these (large): installed there, not by the bootstrap.
INTEGRATION_DEPS := ray[train]
# Upstream torchft's published wheel, kept apart from the venv's own packages (it is put first
# on PYTHONPATH only by the tests and benchmarks that run a replica group or a lighthouse of
# upstream's against ours): the drop-in checks and the first-quorum benchmark compare with it.
UPSTREAM_TORCHFT := torchft==0.2.0
# What upstream imports besides torch (its package imports OpenTelemetry at start).
UPSTREAM_DEPS := opentelemetry-api>=1.39.0 opentelemetry-sdk>=1.39.0 opentelemetry-exporter-otlp-proto-http>=1.39.0
UPSTREAM_DIR := $(VENV)/upstream
UPSTREAM_STAMP := $(UPSTREAM_DIR)/.stamp
# The extension is rebuilt whenever Rust sources, the proto or the manifests change.
EXT_SOURCES := $(shell find src proto -type f) Cargo.toml Cargo.lock build.rs pyproject.toml
EXT_STAMP := $(VENV)/.ext-stamp

.PHONY: all venv upstream develop browser demo chaos test test-rust test-python test-integrations lint fmt bench fuzz clean

all: develop

$(STAMP): Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PY_DEPS)
	@touch $(STAMP)

venv: $(STAMP)

# Laid out in a temporary folder and moved into place whole. Where it cannot be installed
# (no registry), the tests that compare with upstream skip and say so; nothing else needs it.
$(UPSTREAM_STAMP): $(STAMP)
	@rm -rf $(UPSTREAM_DIR) $(UPSTREAM_DIR).tmp
	@if $(PY) -m pip install -q --target $(UPSTREAM_DIR).tmp $(foreach d,$(UPSTREAM_DEPS),"$(d)") \
		&& $(PY) -m pip install -q --no-deps --upgrade --target $(UPSTREAM_DIR).tmp "$(UPSTREAM_TORCHFT)"; \
	then mv $(UPSTREAM_DIR).tmp $(UPSTREAM_DIR) && touch $(UPSTREAM_STAMP); \
	else rm -rf $(UPSTREAM_DIR).tmp; \
		echo "warning: could not install $(UPSTREAM_TORCHFT); the comparisons with upstream will skip"; fi

upstream: $(UPSTREAM_STAMP)

$(EXT_STAMP): $(STAMP) $(EXT_SOURCES)
	maturin develop --release -q
	@touch $(EXT_STAMP)

develop: $(EXT_STAMP)

# DEMO_SECURE=1 runs the same job with a token and mutual TLS everywhere.
demo: develop
	$(PY) examples/demo.py $(if $(filter-out 0,$(DEMO_SECURE)),--secure)

# Random compound faults against real processes, checked offline (docs/chaos.md).
# SEED=N reruns a seed; FAULTS, GROUPS and MTBF change the run.
SEED ?=
FAULTS ?= 200
GROUPS ?= 3
MTBF ?= 1.5
chaos: develop
	cargo build --release -q --bin torchft_lighthouse
	$(PY) -m torchft.chaos --faults $(FAULTS) --groups $(GROUPS) --mtbf $(MTBF) \
		--lighthouse-bin target/release/torchft_lighthouse $(if $(SEED),--seed $(SEED)) \
		$(if $(JITTER),--jitter $(JITTER)) $(if $(STANDBY),--standby $(STANDBY))

test: test-rust test-python test-integrations

test-rust:
	cargo test --all-targets -q

# The dashboard tests drive Debian's chromium through its chromedriver. Installed here when
# missing and the machine allows it (root with apt-get); otherwise those tests skip and say why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver for the dashboard tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q chromium chromium-driver >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; } \
		|| echo "warning: could not install chromium; the dashboard tests will skip"; \
	else echo "note: chromium/chromedriver missing; the dashboard tests will skip"; fi

# Each run gets its own temporary root: pytest prunes old numbered directories under the shared
# default one, which breaks a second test run on the same machine mid-way. The slowest tests
# are listed at the end (the whole run should stay well under half an hour). Most tests wait
# on real processes, heartbeats and timeouts more than they compute, so they run in
# PYTEST_WORKERS processes (pytest-xdist; 0 runs them one after another in this process):
# three keep two cores busy (about 95% over the run, against far less with two).
PYTEST_WORKERS ?= 3
test-python: develop browser upstream
	@t=$$(mktemp -d "$${TMPDIR:-/tmp}/torchft-pytest.XXXXXX"); \
	$(PY) -m pytest tests -q -p no:cacheprovider --ignore=tests/integrations -n $(PYTEST_WORKERS) --durations=25 --basetemp="$$t"; rc=$$?; rm -rf "$$t"; exit $$rc

# Runs torchft under the engines users launch it with (Ray Train), installing them first
# (part of `make test`; a Ray cluster starts, so it is the slowest part).
test-integrations: develop
	$(PY) -m pip install -q "$(INTEGRATION_DEPS)"
	@t=$$(mktemp -d "$${TMPDIR:-/tmp}/torchft-pytest.XXXXXX"); \
	$(PY) -m pytest tests/integrations -q -p no:cacheprovider --basetemp="$$t"; rc=$$?; rm -rf "$$t"; exit $$rc

# Type stubs are checked against the built extension (stubtest), and the whole package with
# strict mypy (settings in pyproject.toml's [tool.mypy]), which also holds the native classes
# to the protocols the Manager is written to (torchft.coordination).
lint: develop
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	ruff check python tests benches examples
	ruff format --check python tests benches examples
	$(PY) -m mypy.stubtest torchft._torchft
	$(PY) -m mypy

fmt: venv
	cargo fmt
	ruff format python tests benches examples
	ruff check --fix python tests benches examples

bench: develop upstream
	cargo bench --bench quorum
	$(PY) benches/run_all.py
	cargo bench --bench lighthouse_load

# The property/fuzz targets run briefly inside `make test`; this runs them for much longer:
# the lighthouse and manager request handlers (proptest) and the checkpoint header parser and
# state serializer (hypothesis). FUZZ_CASES scales the Rust targets.
FUZZ_CASES ?= 20000
fuzz: develop
	PROPTEST_CASES=$(FUZZ_CASES) cargo test --release -q --lib fuzz
	PROPTEST_CASES=$$(( $(FUZZ_CASES) / 20 )) cargo test --release -q --test fuzz_manager
	TORCHFT_HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest tests/test_serialization_props.py -q -p no:cacheprovider

clean:
	cargo clean
	rm -rf $(VENV)
