# Entry points for a new machine: every target sets up .venv from the lock first.
PY := .venv/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist): modules sharing the session's tiny pipeline run are one
# group on one worker (tests/conftest.py); TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
# The slow tests wait on subprocesses (CLI runs, TFF workers, killed jobs): a third
# worker keeps both cores busy (2 workers: 185% CPU, 44.2 min; 3: 196%, 38.2 min, with
# other savings; BENCHMARKS.md, "The test suite and CI").
SLOW_TEST_WORKERS ?= 3

.PHONY: setup setup-gpu test test-slow mutation-check bench bench-quick lint lock clean airflow-setup airflow-lock peer-env

setup:
	@bash scripts/setup_env.sh

# On a machine with an NVIDIA GPU: the CUDA 11.8 and cuDNN 8 libraries TensorFlow 2.14
# loads (its wheel's and-cuda extra) into .venv, for `--executor in_process` and the step
# loop (docs/scaling.md, "Accelerators"). Outside the lock: a CPU machine never needs them.
setup-gpu: setup
	$(PY) -m pip install "tensorflow[and-cuda]==2.14.1"

# The default suite leaves out the tests marked slow (end to end, multi-minute); CI runs
# them after it with test-slow (.ci/run). Together they are every test.
test: setup
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest tests -n $(SLOW_TEST_WORKERS) --dist loadgroup -m slow $(PYTEST_ARGS)

# Each privacy invariant's fault, applied to a copy of the code, must make a test fail
# (scripts/mutation_check.py; docs/development.md, "Mutation check").
mutation-check: setup
	$(PY) scripts/mutation_check.py

# Every bench/bench_*.py; JSON in bench/results/, figures in BENCHMARKS.md.
bench: setup
	$(PY) -m bench.run_all

# Small sizes, a smoke run of every benchmark.
bench-quick: setup
	$(PY) -m bench.run_all --quick

lint: setup
	$(PY) -m ruff check tff_algorithms beam_jobs pipeline tests bench scripts tools
	$(PY) -m ruff format --check tff_algorithms beam_jobs pipeline tests bench scripts tools

lock: setup
	bash scripts/lock.sh

# Optional: Apache Airflow 2.7 beside the locked stack, in its own .venv-airflow from
# requirements/airflow-lock.txt (.venv does not grow). tests/pipeline/test_airflow.py uses it.
airflow-setup: setup
	@SETUP_VENV=.venv-airflow SETUP_LOCK=requirements/airflow-lock.txt bash scripts/setup_env.sh

airflow-lock: setup
	bash scripts/lock_airflow.sh

# Optional: the peer benchmark's own environment (bench/peer_pfl_round.py; BENCHMARKS.md,
# "Against the best peer: pfl-research"): pfl 0.6 with PyTorch's CPU build in .venv-pfl,
# outside the product's lock. pfl wants Python 3.10-3.12; torch 2.13.0 is the CPU wheel.
PEER_PYTHON ?= python3.11
peer-env:
	@test -x .venv-pfl/bin/python || $(PEER_PYTHON) -m venv .venv-pfl
	.venv-pfl/bin/python -m pip install -q torch==2.13.0 "pfl[pytorch]==0.6.0"

clean:
	rm -rf .venv .venv-airflow .venv-pfl .cache .pytest_cache

.PHONY: run
RUN_ARGS ?=
# The whole TFX pipeline on the built-in synthetic data (docs/pipeline.md).
run: setup
	.venv/bin/dp-fedemb run $(RUN_ARGS)

# Bazel (docs/development.md, "Bazel"): Debian's Bazel 4.2.3 with the .venv interpreter, offline.
.PHONY: bazel-setup bazel-check bazel-smoke bazel-test
BAZEL_DEBS := bazel-bootstrap bazel-rules-java
BAZEL_TARGETS ?= //...
BAZEL_ARGS ?=
# The test targets CI runs through Bazel: small; the second loads TensorFlow and Beam.
BAZEL_SMOKE_TARGETS := //tests:repo/test_check_bazel_targets //tests:beam_jobs/test_schema

bazel-setup: setup
	@command -v bazel >/dev/null 2>&1 && [ -d /usr/share/bazel/rules/java ] || { \
	  echo "bazel-setup: installing $(BAZEL_DEBS)" >&2; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BAZEL_DEBS) >/dev/null; }

# BUILD files against tests/test_*.py and the imports; needs no Bazel.
bazel-check: setup
	$(PY) scripts/check_bazel_targets.py

# Every target builds (so every BUILD file loads offline) and the smoke tests run; the
# Bazel server is stopped after, so it holds no memory while other targets run.
bazel-smoke: bazel-setup bazel-check
	bazel build //... && bazel test $(BAZEL_SMOKE_TARGETS); status=$$?; bazel shutdown; exit $$status

bazel-test: bazel-setup bazel-check
	bazel test $(BAZEL_ARGS) $(BAZEL_TARGETS)
