# Two set-up commands for users: `make run` (demo end to end) and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.installed
RAGSERVE_HOME ?= $(HOME)/.cache/ragserve
export RAGSERVE_HOME
MODEL_DIR := $(RAGSERVE_HOME)/models/SmolLM2-135M-Instruct
DATASTORE := $(RAGSERVE_HOME)/datastores/stdlib
PROTOS := $(wildcard proto/*.proto)
STUBS := $(PROTOS:.proto=_pb2.py)

.PHONY: run test test-slow lint install stubs model datastore system-packages clean-stubs bench-speculative up down loadtest kb kb-large \
	calibrate bench-datastores bench-serving bench-concurrency loadtest-8 compose-test docker-engine kernels bench-step \
	kb-large-prefixes bench-ralm-curve k8s-secrets loadtest-failover soak node-sdk loadtest-http

# Debian packages the project uses (redis-server for the CREST Redis backend, redis-tools' redis-cli to create the
# local Redis Clusters of the tests and the failover check, python3.11-doc for the docs corpus,
# g++ for the q4_1 block kernel).
# Installed only when running as root and missing; otherwise the features that need them say so.
system-packages:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  command -v redis-cli >/dev/null || missing="$$missing redis-tools"; \
	  command -v g++ >/dev/null || missing="$$missing g++"; \
	  [ -d /usr/share/doc/python3.11/html/_sources ] || missing="$$missing python3.11-doc"; \
	  if [ -n "$$missing" ]; then \
	    echo "apt-get install$$missing"; \
	    (apt-get install -y -q $$missing >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null)); \
	  fi; \
	fi

$(STAMP): pyproject.toml requirements/nodeps.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps -r requirements/nodeps.txt
	touch $(STAMP)

install: $(STAMP) system-packages stubs kernels

# The SIGBUS guard of memory-mapped stores (retrieval_service/datastore/map_guard.c, plain C, < 1 s). Then, at once:
# the numba drafting kernels into numba's disk cache (~40 s on one core, once; tools/warm_kernels.py: otherwise a
# user's first request, or every process of a fresh checkout's test run, compiles them), and the C++ builds: the
# block-quantized linear kernel of the q4_1 weight format (generation_service/model/kernels/q4_kernel.cpp), compiled
# for this CPU into $(RAGSERVE_HOME)/kernels (~40 s, once per CPU + torch version; without g++/ninja it reports
# "unavailable" and q4_1 serves the same weights dequantized to fp32, with a warning), and the retrieval service's
# float16 exact-search kernel (retrieval_service/knowledge/fp16_scan.cpp, ~2 s; without g++ exact search uses
# faiss). Side by side they take about the longer of the two: the warm-up keeps one core, ninja's jobs the rest.
kernels: $(STAMP)
	$(PYTHON) -m retrieval_service.datastore.map_guard
	@$(PYTHON) -m tools.warm_kernels & warm=$$!; \
	$(PYTHON) -m generation_service.model.kernels.build && $(PYTHON) -m retrieval_service.knowledge.fp16_scan; \
	rc=$$?; wait $$warm || rc=1; exit $$rc

# gRPC stubs are generated, never committed (pinned grpcio-tools = grpcio version).
proto/%_pb2.py: proto/%.proto $(STAMP)
	$(PYTHON) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $<

stubs: $(STUBS)

clean-stubs:
	rm -f proto/*_pb2.py proto/*_pb2.pyi proto/*_pb2_grpc.py

model: install
	$(PYTHON) -m ragcore.model_files --out $(MODEL_DIR)

datastore: model
	$(PYTHON) -m retrieval_service.datastore.build --stdlib --tokenizer $(MODEL_DIR) --out $(DATASTORE)

run: datastore
	$(PYTHON) -m tools.demo --model $(MODEL_DIR) --datastore $(DATASTORE)

# The stdlib datastore (~15 s) lets the tests of the real store's verification and draft latency run, not skip.
# make test is the fast tier; make test-slow the tests marked slow (CI runs both). The model tests run in one
# process (they keep both cores busy; a second process only slows them), the service tests on three (they wait on
# servers and sockets; a third process fills more of those waits, ~12 GB at most). Two groups, so no process holds
# every session fixture at once (one held ~17 GB of 24).
# Every group runs; the target fails if any group failed.
PYTEST := $(PYTHON) -m pytest -q -p no:cacheprovider --durations=12
test: model datastore lint node-sdk
	@rc=0; \
	$(PYTEST) -m "not slow" tests/generation || rc=1; \
	$(PYTEST) -m "not slow" -n 3 tests --ignore=tests/generation || rc=1; \
	exit $$rc

test-slow: model datastore
	$(PYTEST) -m slow tests

# The npm `openai` SDK pinned by tests/gateway_api/node/package-lock.json (tests/gateway_api/test_node_sdk.py
# drives it against the gateway). Without npm: one line, and that test skips saying so.
NODE_SDK := tests/gateway_api/node
node-sdk: $(NODE_SDK)/node_modules/.package-lock.json
$(NODE_SDK)/node_modules/.package-lock.json: $(NODE_SDK)/package.json $(NODE_SDK)/package-lock.json
	@if command -v npm >/dev/null; then \
	  cd $(NODE_SDK) && npm ci --no-audit --no-fund --loglevel=error; \
	else \
	  echo "node-sdk: npm not installed; the Node SDK test will skip"; \
	fi

# Unused or undefined names, import order (ruff, pinned in the dev extra); part of make test.
lint: install
	$(BIN)/ruff check --no-cache .

# What the worker will serve with on this machine: the measured cost curves and the choice (cached).
calibrate: model
	$(PYTHON) -m generation_service.engine.calibrate

# ms per forward pass (q = 1, 4, 16, 64) per weight format and forward, llama.cpp as the anchor when installed
# (pip install -e '.[anchor]'); bench/results/step-<cpuclass>.json. ~2 min.
bench-step: model kernels
	$(PYTHON) -m bench.step

# Datastores of the serving benchmark: code (stdlib + site-packages .py, ~95 M tokens, ~2 min) and docs
# (python3.11-doc reST + docstrings, ~19 M tokens, ~3 min). Resumable; a finished one is left alone.
CODE_DATASTORE := $(RAGSERVE_HOME)/datastores/code
DOCS_DATASTORE := $(RAGSERVE_HOME)/datastores/docs
bench-datastores: model system-packages
	$(PYTHON) -m retrieval_service.datastore.build --stdlib --site-packages --tokenizer $(MODEL_DIR) --out $(CODE_DATASTORE) \
		--keep-finished
	$(PYTHON) -m retrieval_service.datastore.build --docs --tokenizer $(MODEL_DIR) --out $(DOCS_DATASTORE) --keep-finished

# The serving benchmark of record (README): services with default flags, over gRPC, four workloads (code, chat
# across MT-Bench categories, docs chat, open chat); ~50 min on 2 cores.
bench-serving: bench-datastores
	$(PYTHON) -m bench.serving --inprocess

# Closed-loop concurrency benchmark (issue 17): ar and rest at 1, 2, 4, 8, 16 clients, HumanEval + MT-Bench mix,
# through the services with default flags; JSON + PNG in bench/results/. ~15 min on 2 cores (10 cells of 75 s);
# bounded by --max-minutes. A quick look: make bench-concurrency CONC_ARGS="--levels 1,2 --duration-s 20 --json /tmp/c.json";
# rest / ar from back-to-back pairs of cells: CONC_ARGS="--rounds 3 --duration-s 20"
CONC_ARGS ?=
bench-concurrency: bench-datastores
	$(PYTHON) -m bench.concurrency $(CONC_ARGS)

# The docker-compose topology as local processes (tools/launcher.py): retrieval, a worker and the OpenAI-compatible
# gateway on http://127.0.0.1:8000/v1, each started once the one before is healthy; redis is optional (--redis),
# more retrieval replicas with REPLICAS=N, launcher flags in UP_ARGS (e.g. --api-key K). `make down` stops them.
REPLICAS ?= 1
UP_ARGS ?=
up: datastore
	$(PYTHON) -m tools.launcher up --datastore $(DATASTORE) --replicas $(REPLICAS) $(UP_ARGS)

down:
	$(PYTHON) -m tools.launcher down

# Locust gRPC load test at CI scale (< 1 min of load): starts the services, fails on any failure or a p95 above
# loadtests/thresholds.toml. Reports in loadtests/reports/. Longer runs: see loadtests/run.py.
LOAD_ARGS ?= --users 6 --generation-users 1 --spawn-rate 3 --duration 30
loadtest: datastore
	$(PYTHON) -m loadtests.run --datastore $(DATASTORE) $(LOAD_ARGS)

# The same with 8 generation users (issue 17: the worker serves them concurrently); 4 retrieval users beside them.
# Same thresholds; reports named load-8 in loadtests/reports/.
LOAD8_ARGS ?= --users 12 --generation-users 8 --spawn-rate 6 --duration 60
loadtest-8: datastore
	$(PYTHON) -m loadtests.run --datastore $(DATASTORE) --name load-8 $(LOAD8_ARGS)

# CREST on a local 6-node Redis Cluster under Generate load, a primary SIGKILLed mid-run (docs/crest.md): fails on
# an error to a caller, a wrong draft, or drafts not back within 10 s. Record in bench/results/cluster-failover-*.
FAILOVER_ARGS ?= --duration 60 --kill-at 20 --clients 2
loadtest-failover: datastore
	$(PYTHON) -m loadtests.cluster_failover --datastore $(DATASTORE) $(FAILOVER_ARGS)

# Soak: 10 minutes of mixed load from 6 clients on loopback; prints errors by code, RSS drift, latency drift and
# whether greedy outputs stayed identical; fails on any of them (loadtests/soak.py). Shorter: SOAK_ARGS="--minutes 3".
SOAK_ARGS ?= --minutes 10
soak: datastore
	$(PYTHON) -m loadtests.soak --datastore $(DATASTORE) $(SOAK_ARGS)

# Locust HTTP load test of the OpenAI-compatible gateway (loadtests/run_http.py): starts retrieval, a worker and
# the gateway, 8 users for 60 s of streamed + plain chat; fails on any failure or a p95 above
# loadtests/thresholds_http.toml; prints TTFT and inter-token latency. Reports in loadtests/reports/.
LOAD_HTTP_ARGS ?= --users 8 --spawn-rate 4 --duration 60
loadtest-http: datastore
	$(PYTHON) -m loadtests.run_http --datastore $(DATASTORE) $(LOAD_HTTP_ARGS)

# Knowledge base for RaLMSpec / kNN-LM (>= 100 K passages from docstrings + python3.11-doc; ~1 h of encoding on
# 2 cores, resumable). Small test KBs are built by the tests themselves.
KB := $(RAGSERVE_HOME)/kb/docs
kb: install
	$(PYTHON) -m retrieval_service.knowledge.build --out $(KB) --encoder-dtype bfloat16

# The large KB (issue 19's benchmark asset, never committed): the docs corpus + the Python source by definition +
# the English manual pages + the C/C++ headers, 50-word passages (~1.04 M). Hours of encoding on 2 cores (one
# encoder process per core); every stage resumes where it stopped.
KB_LARGE := $(RAGSERVE_HOME)/kb/large
KB_LARGE_ARGS ?=
kb-large: install
	$(PYTHON) -m retrieval_service.knowledge.build --out $(KB_LARGE) --code --man --headers --words 50 \
		--encoder-dtype bfloat16 --float16 $(KB_LARGE_ARGS)

# Prefix KBs of the large one for RaLMSpec's curve over KB sizes ($(KB_LARGE)-N for N in KB_SIZES): the first N
# passages with their rows copied from the large KB (encoded, or the chunks of a build still running; rows not
# encoded yet are encoded here), each with its own exact and BM25 index (KB_PREFIX_RETRIEVERS; add adr for HNSW,
# ~25 min per 1 M passages on 2 cores). The largest point is the large KB, with all three.
KB_SIZES ?= 100000 300000 700000
KB_PREFIX_RETRIEVERS ?= edr,sr
kb-large-prefixes: install
	set -e; for n in $(KB_SIZES); do \
		$(PYTHON) -m retrieval_service.knowledge.build --out $(KB_LARGE)-$$n --limit-passages $$n --code --man \
			--headers --words 50 --encoder-dtype bfloat16 --float16 --embeddings-from $(KB_LARGE) \
			--retrievers $(KB_PREFIX_RETRIEVERS) $(KB_LARGE_ARGS); \
	done

# RaLMSpec over KB sizes (issue 19): bench.ralm on each prefix KB (its KB_PREFIX_RETRIEVERS) and on the large KB
# (edr/adr/sr) x B/P/S/A/PS/SA/PA/PSA, the worker's calibrated format (bench/results/ralm-<kb>.json), the large
# KB's retrieval latency at batch 1/8/32 and build record (bench/results/kb-large.json), then the curve of speed-up
# vs B's retrieval share (bench/results/ralm-curve.json/png). 3-8 min per KB and retriever set.
# --serve: the product path (both services started with default flags, requests over gRPC).
RALM_CURVE_ARGS ?= --serve --limit 8 --max-new-tokens 64 --ranking-questions 0 --max-minutes 14
bench-ralm-curve: kb-large kb-large-prefixes
	set -e; for n in $(KB_SIZES); do \
		$(PYTHON) -m bench.ralm --kb $(KB_LARGE)-$$n --retrievers $(KB_PREFIX_RETRIEVERS) \
			--configs B,P,S,A,PS,SA,PA,PSA $(RALM_CURVE_ARGS) --json bench/results/ralm-large-$$n.json; \
	done
	$(PYTHON) -m bench.kb --kb $(KB_LARGE) --batch-sizes 1,8,32 --json bench/results/kb-large.json
	$(PYTHON) -m bench.ralm --kb $(KB_LARGE) --retrievers edr,adr,sr --configs B,P,S,A,PS,SA,PA,PSA \
		$(RALM_CURVE_ARGS) --json bench/results/ralm-large.json
	$(PYTHON) -m bench.ralm_curve $(foreach n,$(KB_SIZES),bench/results/ralm-large-$(n).json) \
		bench/results/ralm-large.json --json bench/results/ralm-curve.json --png bench/results/ralm-curve.png

# The docker-compose deployment for real (tests/deploy/compose_e2e.py): a Docker engine (docker/engine.sh: apt-get
# install + dockerd when missing; not root / no apt -> one loud SKIPPED line, exit 0), base images pulled or built
# as local stand-ins (docker/base_images.sh, cached in $(RAGSERVE_HOME)/docker-standin), both images built, the stack
# up, called, scaled, broken and taken down again. A dockerd started here is stopped at the end (one that was
# already running is left alone).
# The machine's CPU torch wheel (pip's find-links) is staged into the build context when there is one: the torch
# index may be unreachable, and PyPI's torch of the same version is the CUDA build.
BASE_IMAGES := python:3.11-slim-bookworm redis:7.0-bookworm
TORCH_WHEELS ?= $(firstword $(PIP_FIND_LINKS) /opt/wheels)
COMPOSE_TEST_ARGS ?= --report var/compose-test.json
compose-test: stubs
	@running=0; timeout 10 docker info >/dev/null 2>&1 && running=1; \
	rc=0; docker/engine.sh start || rc=$$?; \
	if [ $$rc = 3 ]; then exit 0; elif [ $$rc != 0 ]; then exit $$rc; fi; \
	[ $$running = 1 ] || trap 'docker/engine.sh stop' EXIT; \
	set -e; \
	$(BIN)/pip install -q -r requirements/compose.txt; \
	docker/base_images.sh $(BASE_IMAGES); \
	pin=$$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml); \
	wheel=$$(ls $(TORCH_WHEELS)/torch-$$pin+cpu-cp311-cp311-*.whl 2>/dev/null | head -n 1); \
	if [ -n "$$wheel" ]; then \
	  echo "compose-test: staging $$wheel into docker/wheels/"; \
	  ln -f "$$wheel" docker/wheels/ 2>/dev/null || cp "$$wheel" docker/wheels/; \
	  export RAGSERVE_BUILD_TORCH_INDEX_URL=$${RAGSERVE_BUILD_TORCH_INDEX_URL:-https://pypi.org/simple}; \
	fi; \
	mkdir -p var; \
	$(PYTHON) -m tests.deploy.compose_e2e $(COMPOSE_TEST_ARGS)

# The two files deploy/k8s/overlays/cpu turns into Secrets (never committed; an existing one is kept):
# the services' bearer token and one gateway API key. docs/kubernetes.md.
K8S_SECRETS := deploy/k8s/overlays/cpu/secrets
k8s-secrets:
	@umask 077; [ -s $(K8S_SECRETS)/auth-token ] || $(PY) -c "import secrets; print(secrets.token_hex(24), end='')" \
		> $(K8S_SECRETS)/auth-token
	@umask 077; [ -s $(K8S_SECRETS)/api-keys ] || $(PY) -c "import secrets; print('sk-' + secrets.token_hex(24))" \
		> $(K8S_SECRETS)/api-keys
	@echo "$(K8S_SECRETS)/auth-token and $(K8S_SECRETS)/api-keys ready (the API key: $$(head -n 1 $(K8S_SECRETS)/api-keys))"

# A running Docker engine for working with the compose file by hand (left running).
docker-engine:
	@docker/engine.sh start
