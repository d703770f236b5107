# Entry points for a new machine: every target sets up .venv from the lock first.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test bench lint lock clean

setup:
	@bash scripts/setup_env.sh

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.run_all

lint: setup
	$(PY) -m ruff check tff_algorithms beam_jobs pipeline tests bench
	$(PY) -m ruff format --check tff_algorithms beam_jobs pipeline tests bench

lock: setup
	bash scripts/lock.sh

clean:
	rm -rf .venv .cache .pytest_cache

.PHONY: run
RUN_ARGS ?=
# The whole TFX pipeline on the built-in synthetic data (README "The pipeline").
run: setup
	.venv/bin/dp-fedemb run $(RUN_ARGS)
