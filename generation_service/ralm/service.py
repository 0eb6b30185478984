"""The worker side of RAG requests (GenerateRequest.rag): wire options -> RagParams, the KB connection shared
by requests, a KBRetriever per request, RagStats -> proto.

    backend = RagBackend.open(cfg)                         # None when cfg.kb_target is ""
    rag = request_params(request, prompt_len, params, tm)  # None without `rag`; ValueError names the field
    for chunk in backend.stream(tm, prompt_ids, params, rag, deadline=..., is_cancelled=...): ...

A KB that is down or too slow for a sequential retrieval ends the request with KBUnavailable, which the
servicer turns into UNAVAILABLE; a KB failure during speculation only makes the request fall back to
sequential retrieval (ralm/loop.py).
"""

from __future__ import annotations

from typing import Callable, Iterator

from generation_service.augment.kb_client import KBClient
from generation_service.augment.round_gate import SharedRoundCosts
from generation_service.config import GenerationConfig
from generation_service.engine.passage_rows import passage_budget
from generation_service.model.sampling import SamplingParams
from generation_service.ralm.loop import MAX_PREFETCH, RagChunk, RagParams, RagRequest, RagStats, ralm_stream
from generation_service.ralm.retrieval import KBRetriever, LocalEncoder
from proto import generation_pb2
from ragcore import security
from ragcore.errors import InvalidArgument
from ragcore.wire import clip

_DEFAULTS = RagParams()


def params_from_proto(msg: generation_pb2.RagOptions) -> RagParams:
    """Wire options -> RagParams; zero / unset fields take the defaults. ValueError("rag.<field>: ...")."""
    if msg.HasField("prefetch") and msg.prefetch > MAX_PREFETCH:  # uint32 -> check before RagParams sees it
        raise InvalidArgument("rag.prefetch", f"must be an integer in [0, {MAX_PREFETCH}], got {msg.prefetch}")
    return RagParams(
        retriever=msg.retriever or _DEFAULTS.retriever,
        stride=msg.stride or _DEFAULTS.stride,
        query_tokens=msg.query_tokens or _DEFAULTS.query_tokens,
        max_passage_tokens=msg.max_passage_tokens or _DEFAULTS.max_passage_tokens,
        max_prompt_tokens=msg.max_prompt_tokens or _DEFAULTS.max_prompt_tokens,
        speculate=msg.speculate if msg.HasField("speculate") else _DEFAULTS.speculate,
        prefetch=msg.prefetch if msg.HasField("prefetch") else _DEFAULTS.prefetch,
        os3=msg.os3 if msg.HasField("os3") else _DEFAULTS.os3,
        spec_stride=msg.spec_stride or _DEFAULTS.spec_stride,
        async_verify=msg.async_verify if msg.HasField("async_verify") else _DEFAULTS.async_verify,
        encoder=msg.encoder or _DEFAULTS.encoder,
    )


def request_params(request: generation_pb2.GenerateRequest, prompt_len: int, params: SamplingParams,
                   max_positions: int) -> RagParams | None:
    """The RAG settings of a Generate request (None when `rag` is unset); ValueError names the bad field."""
    if not request.HasField("rag"):
        return None
    if request.decoding:
        raise InvalidArgument("decoding", f"{clip(request.decoding)} cannot be combined with rag options (leave it empty)")
    if request.HasField("knnlm"):
        raise InvalidArgument("rag", "cannot be combined with knnlm options")
    rag = params_from_proto(request.rag)
    if prompt_len > rag.max_prompt_tokens:
        raise InvalidArgument("rag.max_prompt_tokens", f"the prompt has {prompt_len} tokens, more than "
                         f"{rag.max_prompt_tokens}")
    total = prompt_len + passage_budget(prompt_len, rag) + params.max_new_tokens
    if total > max_positions:
        raise InvalidArgument("max_new_tokens", f"passage + prompt + max_new_tokens ({total}) exceeds the model's "
                         f"{max_positions} positions")
    return rag


def stats_proto(s: RagStats) -> generation_pb2.RagStats:
    return generation_pb2.RagStats(**s.as_dict())


class RagBackend:
    """One KBClient (channels to the KB replicas) shared by all RAG requests; the local query encoder is loaded
    on the first request that asks for it."""

    def __init__(self, kb: KBClient, cfg: GenerationConfig):
        self.kb, self.cfg = kb, cfg
        self._encoder: LocalEncoder | None = None
        self.round_costs = SharedRoundCosts()  # RaLMSpec's measured round costs, pooled over this worker's requests

    @classmethod
    def open(cls, cfg: GenerationConfig) -> "RagBackend | None":
        if not cfg.kb_target:
            return None
        kb = KBClient(cfg.kb_target, timeout_ms=cfg.kb_timeout_ms, retry_after_s=cfg.retry_after_s,
                      token=security.read_token(cfg.retrieval_auth_token, cfg.retrieval_auth_token_file),
                      credentials=security.channel_credentials(cfg.retrieval_tls_ca, cfg.retrieval_tls_cert,
                                                               cfg.retrieval_tls_key))
        return cls(kb, cfg)

    def close(self) -> None:
        self.kb.close()

    def encoder(self) -> LocalEncoder:
        if self._encoder is None:
            self._encoder = LocalEncoder(LocalEncoder.dtype_of(self.kb))  # raises KBUnavailable if the KB is down
        return self._encoder

    def retriever(self, tokenizer, prompt_len: int, rag: RagParams, deadline: float | None) -> KBRetriever:
        local = self.encoder() if rag.encoder == "local" and rag.retriever != "sr" else None
        return KBRetriever(self.kb, rag.retriever, tokenizer, passage_budget(prompt_len, rag), encoder=local,
                           ef_search=rag.ef_search, deadline=deadline, kb_timeout_s=self.cfg.kb_timeout_ms / 1e3,
                           spec_timeout_s=self.cfg.kb_spec_timeout_ms / 1e3)

    def stream(self, tm, prompt_ids, params: SamplingParams, rag: RagParams, *, deadline: float | None,
               is_cancelled: Callable[[], bool] | None = None) -> Iterator[RagChunk]:
        """One request alone, as text chunks."""
        retr = self.retriever(tm.tokenizer, len(prompt_ids), rag, deadline)
        return ralm_stream(tm, prompt_ids, params, rag, retr, is_cancelled=is_cancelled, round_costs=self.round_costs)

    def request(self, tm, prompt_ids, params: SamplingParams, rag: RagParams, *, deadline: float | None,
                is_cancelled: Callable[[], bool] | None = None) -> RagRequest:
        """One request as the engine steps it (InvalidArgument for a bad one, KBUnavailable if the local encoder
        cannot be set up)."""
        retr = self.retriever(tm.tokenizer, len(prompt_ids), rag, deadline)
        return RagRequest(tm, prompt_ids, params, rag, retr, is_cancelled=is_cancelled, round_costs=self.round_costs)
