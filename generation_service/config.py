"""Generation worker configuration: one dataclass, built at the edge from CLI flags or environment
(RAGSERVE_GENERATION_<FIELD>), passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from ragcore import config_util

_ENV_PREFIX = "RAGSERVE_GENERATION_"
DECODING_MODES = ("ar", "pld", "rest-ds", "rest", "knnlm", "crest")
PREFILL_PRECISIONS = ("auto", "fp32", "bf16")


# --dtype values (model.DTYPES and model.WEIGHT_FORMATS, named here without importing torch).
DTYPE_CHOICES = ("auto", "bf16", "fp32", "q4_1", "q4_1_bf16", "q4_1_i8")
KV_CACHE_DTYPES = ("auto", "fp16", "fp32")  # lean_llama.KV_DTYPES

# One line per flag for `--help` (ragcore/config_util.py adds the default and the environment variable). Kept
# out of the class so adding a field and describing it are separate one-line edits.
FLAG_HELP = {
    "host": "address the gRPC port binds to (0.0.0.0 = every interface)",
    "port": "gRPC port (0 = a free port)",
    "model": "local Hugging Face model directory (\"\" = SmolLM2-135M-Instruct, prepared on first use)",
    "dtype": "auto (the fastest measured here) | bf16 | fp32 | q4_1 (the GGUF's Q4_1 weights) | q4_1_bf16 (bf16 "
             "activations) | q4_1_i8 (int8 activations); docs/guide.md",
    "forward": "auto (lean for Llama-family models, else transformers) | lean | hf",
    "prefill_precision": "linears of prompt chunks: auto (bf16 where calibration measures it faster) | fp32 | bf16; "
                         "decode rows keep the serving dtype, so speculation stays lossless",
    "calibration": "start-up cost measurement: auto (cached per machine) | force (measure again) | off",
    "device": "auto | cpu | cuda",
    "threads": "torch intra-op threads (0 = the fastest measured count)",
    "adaptive_threads": "with --threads 0: fewer threads per pass while other processes keep the cores busy "
                        "(measured pass times)",
    "live_pass_costs": "size draft trees on the calibrated pass-cost curve corrected by the measured decode passes "
                       "(off: the start-up curve alone)",
    "retrieval": "retrieval service target(s): host:port, a comma list, or dns:///name:port (\"\" = no drafts)",
    "draft_timeout_ms": "deadline of one Draft call; a slower draft is skipped and that step decodes AR",
    "retry_after_s": "a retrieval or knowledge replica that answered a server fault is skipped this long (one "
                     "that is down or NOT_SERVING is skipped until gRPC sees it READY again)",
    "default_decoding": "decoding mode when a request leaves it empty: ar | pld | rest-ds | rest | knnlm | crest",
    "draft_budget": "draft-tree nodes asked for per step (each step verifies only the part that pays)",
    "max_draft_budget": "largest draft_budget a request may ask for",
    "learn_from_outputs": "send finished outputs to the retrieval service's online learning (per-request override)",
    "default_max_new_tokens": "max_new_tokens when a request leaves it 0",
    "limit_max_new_tokens": "largest max_new_tokens a request may ask for",
    "limit_prompt_tokens": "most prompt tokens (after the chat template)",
    "limit_stop_sequences": "most stop sequences per request",
    "max_batch": "requests decoded together in every forward pass (continuous batching)",
    "prefill_chunk": "prompt tokens a new request prefills per pass beside the running ones",
    "prefill_slowdown": "while others decode, a step with prompt rows may take this many times their own step or "
                        "inter-token p95 (q4_1_i8, q4_1_bf16: rows pass-invariant); 0 = off",
    "kv_cache_mb": "memory for the running requests' KV caches, MB; a request that does not fit waits",
    "kv_cache_dtype": "how KV caches store keys/values: auto (fp16 where the fused forward runs, else the dtype's) | "
                      "fp16 | fp32",
    "prefix_cache_mb": "memory for finished prompts' KV rows, MB: a later request with the same prompt (or its first "
                       "prefill_chunk-aligned part) skips that prefill; 0 = off",
    "stream_interval_ms": "a stream sends its tokens at most this often, ms (first token and end at once, tokens in "
                          "between together); 0 = a message per step",
    "follow_wait_ms": "ms the pass after a finished request waits for the client's next one while clients run "
                      "closed loops; 0 = never",
    "queue_size": "requests that may wait for a batch slot; more get RESOURCE_EXHAUSTED",
    "max_concurrent_rpcs": "RPCs in flight (health checks aside) before the server answers RESOURCE_EXHAUSTED "
                           "(0 = unlimited)",
    "workers": "gRPC handler threads (at least max_concurrent_rpcs, plus 4 kept for health checks)",
    "grace_s": "seconds in-flight requests get to finish after SIGTERM (health answers NOT_SERVING meanwhile)",
    "max_message_bytes": "largest request and reply message, bytes",
    **config_util.SHELL_FLAG_HELP,
    "retrieval_auth_token": "bearer token sent to the retrieval service",
    "retrieval_auth_token_file": "file holding the retrieval service's token (wins over --retrieval-auth-token)",
    "retrieval_tls_ca": "PEM CA to trust for the retrieval service's TLS (\"\" = plaintext unless a cert is set)",
    "retrieval_tls_cert": "PEM client certificate for mutual TLS with the retrieval service",
    "retrieval_tls_key": "PEM private key of --retrieval-tls-cert",
    "limit_prompt_chars": "most prompt + message characters, checked before tokenizing (0 = 16 x limit_prompt_tokens)",
    "limit_messages": "most chat messages per request, checked before the chat template is rendered",
    "knnlm_datastore": "kNN-LM datastore directory (\"\" = no kNN-LM)",
    "knnlm_index": "kNN-LM index name on the retrieval service (\"\" = the datastore's own name)",
    "knnlm_timeout_ms": "deadline of one kNN-LM Search call, ms",
    "kb_target": "knowledge service target(s) for RAG requests (\"\" = no RAG)",
    "kb_timeout_ms": "deadline of a sequential RAG retrieval, ms",
    "kb_spec_timeout_ms": "deadline of a speculative RAG call (stretched to 2x its queries at the measured rate); "
                          "a slower one falls back to sequential, ms",
    "acceptance_state": "draft-acceptance evidence kept across restarts: auto (per model, in RAGSERVE_HOME/"
                        "calibration) | off | a file path",
}


@dataclass
class GenerationConfig(config_util.ShellConfig):
    ENV_PREFIX: ClassVar[str] = _ENV_PREFIX
    PROG: ClassVar[str] = "python -m generation_service.server"
    DESCRIPTION: ClassVar[str] = "Generation gRPC worker: speculative decoding with retrieval drafts"
    FLAG_HELP: ClassVar[Mapping[str, str]] = FLAG_HELP

    host: str = "127.0.0.1"
    port: int = 50052
    # Local Hugging Face model directory; "" = the default SmolLM2-135M-Instruct (prepared on first use).
    model: str = ""
    # auto = the fastest on this machine, measured at start (engine/calibrate.py; cached in RAGSERVE_HOME) | bf16 | fp32 |
    # q4_1 (the GGUF's 4-bit weights, exactly; fp32 activations; a candidate of auto only for a model whose directory
    # has its Q4_1 GGUF, the default model's included: calibrate.auto_formats) | q4_1_bf16 (the same weights, bf16
    # activations: on AMX tiles a pass over 16-96 rows costs what one row does, with AVX512-BF16 about half of q4_1's
    # arithmetic; a candidate of auto where the CPU has either) | q4_1_i8 (the same weights, int8 activations
    # quantized per row and block of 32: exact integer dot products, rows bit-identical in any pass; a candidate of
    # auto wherever q4_1 is)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch intra-op threads; 0 = the fastest measured count
    adaptive_threads: bool = True  # with threads 0: fewer threads per pass while the cores are contended
    # The start-up curve's shape varies between start-ups (engine/pass_costs.py): the engine corrects it
    # with the passes it runs (engine/pass_costs.py).
    live_pass_costs: bool = True
    # Forward implementation: auto = the lean forward for supported architectures (Llama-family), else
    # transformers' | lean = require the lean one | hf = always transformers' (generation_service/model/lean_llama.py).
    forward: str = "auto"
    # Start-up cost measurement: auto = reuse the cached one or measure | force = measure again | off = none
    # (dtype auto then means fp32, threads 0 all cores; draft trees are sized with a generic cost model).
    calibration: str = "auto"
    # Linears of prompt chunks (>= 32 rows) on bf16 copies of the weights where that is faster: auto = where the
    # calibration measured it faster (never with calibration off) | fp32 = never | bf16 = wherever it can run
    # (fp32 activations on a CPU with oneDNN). Decode rows keep fp32 (model/lean_llama.py).
    prefill_precision: str = "auto"
    # Retrieval service target(s): "host:port", or several comma-separated (client-side round-robin),
    # or a DNS name (dns:///retrieval:50051) that resolves to several replicas. "" = no retrieval.
    retrieval: str = "127.0.0.1:50051"
    draft_timeout_ms: float = 50.0  # a draft that takes longer is skipped (that step decodes AR)
    retry_after_s: float = 1.0  # a replica that answered a server fault is skipped this long
    default_decoding: str = "rest"
    # Draft-tree nodes asked for per step; each step verifies only the part its measured cost says pays.
    draft_budget: int = 64
    max_draft_budget: int = 256
    # Feed finished outputs back to the retrieval service's online-learning shard (per-request override).
    learn_from_outputs: bool = False
    default_max_new_tokens: int = 128
    limit_max_new_tokens: int = 4096
    limit_prompt_tokens: int = 8192
    limit_stop_sequences: int = 16
    # Continuous batching (engine/scheduler.py): up to max_batch requests share every forward pass; a new prompt is
    # prefilled prefill_chunk tokens per pass beside them; their KV caches stay within kv_cache_mb (a request whose
    # cache does not fit waits; one that could never fit is refused). queue_size more may wait; beyond that,
    # RESOURCE_EXHAUSTED. A pass of 8 one-row sequences costs far less than 8 passes of one (the weights are read
    # once per pass), so throughput grows with the batch while each request slows down less than it would queue.
    # prefix_cache_mb keeps finished prompts' KV rows (~23 KB per token in fp16 for the default model) for later
    # requests with the same prompt (engine/prefix_cache.py). stream_interval_ms bounds how often a stream's tokens
    # wake its gRPC thread (engine/scheduler.py Engine._send).
    max_batch: int = 16
    prefill_chunk: int = 256
    # While others decode, a step carrying prompt rows may take up to prefill_slowdown x their own step, or x their
    # recent inter-token p95 when that is longer (engine/prefill_share.py): their tokens keep coming during a long
    # prefill, the prompt keeps most of each step.
    # Only where the served format's rows are pass-invariant (q4_1_i8, q4_1_bf16 on the fused forward): there a
    # prompt cut into pieces by load gets the same bits as one prefilled alone. Elsewhere a piece's size would change
    # the prompt linears' rounding, so the same request could answer differently under load: whole chunks there.
    # 2.4: the streams' measured p95 comes out a little above the bound (a prompt row's cost varies), and the
    # target is 3x their solo p95.
    prefill_slowdown: float = 2.4
    kv_cache_mb: int = 2048
    # fp16 halves what every decode row's attention reads (lean_llama.LeanLlama.set_kv_dtype); fp32 = exact fp32.
    kv_cache_dtype: str = "auto"
    prefix_cache_mb: int = 512
    stream_interval_ms: float = 25.0
    # A closed-loop client's next request lands just after the next pass started and would wait all of it for its
    # first token; follow_wait_ms holds that pass for it (engine/admission.py).
    follow_wait_ms: float = 8.0
    # Running + waiting requests stay below max_concurrent_rpcs, so a full queue is refused as such (with the
    # queue's size in the message), not by the RPC limit.
    queue_size: int = 32
    max_concurrent_rpcs: int = 64
    workers: int = 32
    grace_s: float = 30.0
    max_message_bytes: int = 16 << 20
    # How the worker calls the retrieval service: token (file wins), CA to trust, client cert/key for mutual TLS.
    retrieval_auth_token: str = ""
    retrieval_auth_token_file: str = ""
    retrieval_tls_ca: str = ""
    retrieval_tls_cert: str = ""
    retrieval_tls_key: str = ""
    # Characters of prompt / messages checked before tokenizing (bounds the CPU a bad request can take; tokenizing
    # costs time per character). 0 = 16 per prompt token (code averages ~3.5 characters per token).
    limit_prompt_chars: int = 0
    # Chat messages per request, checked before the chat template is rendered.
    limit_messages: int = 1024
    # kNN-LM (generation_service/knnlm/loop.py): the datastore directory built by tools.knn_build
    # (the worker memory-maps its values/keys; the retrieval service serves its indexes, --kb-knn-datastores);
    # "" = no kNN-LM. Index name on the retrieval service ("" = the datastore's own name); Search deadline.
    knnlm_datastore: str = ""
    knnlm_index: str = ""
    knnlm_timeout_ms: float = 10_000.0
    # RaLM (generation_service/ralm/loop.py, GenerateRequest.rag): the knowledge service target(s) ("" = no RAG; by
    # default the retrieval service, which serves the KB next to the drafts); deadline of a sequential retrieval
    # and of a speculative call (ScoreCandidates / verification: a slow one falls back to sequential retrieval).
    kb_target: str = "127.0.0.1:50051"
    kb_timeout_ms: float = 10_000.0
    kb_spec_timeout_ms: float = 2_000.0
    # The pooled draft-acceptance evidence (draft_budget.SharedCalibration) is written every 2000 passes and at
    # stop, and read at start, so a restarted worker sizes its first trees from what drafts were worth before
    # (engine/scheduler.py): auto = acceptance-<model identity>.json in the calibration cache | off | a file.
    acceptance_state: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        if self.prefill_precision not in PREFILL_PRECISIONS:
            raise ValueError(f"prefill_precision: {self.prefill_precision!r} is not auto, fp32 or bf16")
        if self.forward not in ("auto", "lean", "hf"):
            raise ValueError(f"forward: {self.forward!r} is not auto, lean or hf")
        if not self.acceptance_state.strip():
            raise ValueError("acceptance_state: empty; auto, off or a file path")
        if self.calibration not in ("auto", "force", "off"):
            raise ValueError(f"calibration: {self.calibration!r} is not auto, force or off")
        if self.threads < 0:
            raise ValueError(f"threads: {self.threads} must be >= 0 (0 = choose)")
        if self.default_decoding not in DECODING_MODES:
            raise ValueError(f"default_decoding: {self.default_decoding!r} is not one of {DECODING_MODES}")
        if not 1 <= self.draft_budget <= self.max_draft_budget:
            raise ValueError(f"draft_budget: {self.draft_budget} is outside [1, {self.max_draft_budget}]")
        for name in ("max_batch", "prefill_chunk", "kv_cache_mb", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.stream_interval_ms < 0:
            raise ValueError(f"stream_interval_ms: {self.stream_interval_ms} must be >= 0 (0 = every step)")
        if self.follow_wait_ms < 0:
            raise ValueError(f"follow_wait_ms: {self.follow_wait_ms} must be >= 0 (0 = never)")
        if self.prefill_slowdown != 0 and not 1.0 <= self.prefill_slowdown <= 100.0:
            raise ValueError(f"prefill_slowdown: {self.prefill_slowdown} is outside [1, 100] (0 = off)")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb: {self.prefix_cache_mb} must be >= 0 (0 = off)")
