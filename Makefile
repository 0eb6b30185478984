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

.PHONY: run test install stubs model datastore system-packages clean-stubs bench-speculative

# Debian packages the project uses (redis-server for the CREST Redis backend, python3.11-doc for the docs corpus).
# Installed only when running as root and missing; otherwise the features that need them say so.
system-packages:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
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

install: $(STAMP) system-packages stubs

# gRPC stubs are generated, never committed (pinned grpcio-tools = grpcio version).
proto/%_pb2.py: proto/%.proto $(STAMP)
	$(PYTHON) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $<

stubs: $(STUBS)

clean-stubs:
	rm -f proto/*_pb2.py proto/*_pb2.pyi proto/*_pb2_grpc.py

model: install
	$(PYTHON) -m generation_service.model_files --out $(MODEL_DIR)

datastore: model
	$(PYTHON) -m retrieval_service.datastore.build --stdlib --tokenizer $(MODEL_DIR) --out $(DATASTORE)

run: datastore
	$(PYTHON) -m generation_service.demo --model $(MODEL_DIR) --datastore $(DATASTORE)

test: model
	$(PYTHON) -m pytest -q
