# The two commands a new user needs: `make demo` and `make test`. Both create .venv
# when it is missing and are quick when it is already there.
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-all demo bench clean

setup:
	@bash scripts/setup_env.sh

# Two pytest-xdist workers: a test file stays on one, vLLM's and Ray's tests share one
# (tests/conftest.py); TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --durations=15 tests

# Includes tests marked slow (beyond the CI budget).
test-all: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "" tests

demo: setup
	$(PY) scripts/demo.py $(DEMO_ARGS)

# Benchmarks; TRL and Liger-Kernel (benchmark extras) go to .venv-bench, layered on .venv.
bench: setup
	@bash scripts/setup_bench_env.sh
	PYTHONPATH=$(CURDIR) .venv-bench/bin/python -m opd.cli bench all --out runs/bench --trl-python .venv-bench/bin/python

clean:
	rm -rf runs .pytest_cache
