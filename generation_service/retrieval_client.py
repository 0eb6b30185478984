"""Client side of the retrieval service, as seen from the generation worker.

Drafting must never fail a generation request: every error, a missed deadline or a replica that is down
becomes DraftUnavailable, and the verify loop decodes that step autoregressively. Several replicas are
used round-robin; a replica that failed is skipped for `retry_after_s` so a dead service costs one fast
failure per interval instead of one timeout per token.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from generation_service.drafters import DraftUnavailable, PromptLookupDrafter
from proto import draft_pb2, draft_pb2_grpc
from retrieval_service.datastore.draft_tree import SOURCES, DraftTree
from serving import metrics
from serving.wire import pack_tokens


def split_targets(target: str) -> list[str]:
    """'a:1,b:2' -> ['a:1', 'b:2']; a dns:/// target stays one (gRPC balances it with round_robin)."""
    return [t.strip() for t in target.split(",") if t.strip()]


@dataclass
class _Replica:
    target: str
    channel: grpc.Channel
    stub: draft_pb2_grpc.DraftServiceStub
    down_until: float = 0.0


class RetrievalClient:
    def __init__(self, target: str, *, timeout_ms: float = 50.0, retry_after_s: float = 1.0,
                 max_message_bytes: int = 64 << 20, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None):
        """token: bearer token sent with every call ("" = none); credentials: TLS (None = plaintext)."""
        targets = split_targets(target)
        if not targets:
            raise ValueError("retrieval: no target given")
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}'),
            ("grpc.enable_retries", 0),
            # Reconnect quickly once a restarted replica is back (gRPC's default backoff grows to minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._replicas = []
        for t in targets:
            ch = metrics.instrument_channel(grpc.secure_channel(t, credentials, options=options) if credentials
                                            else grpc.insecure_channel(t, options=options))
            self._replicas.append(_Replica(t, ch, draft_pb2_grpc.DraftServiceStub(ch)))
        self._next = itertools.cycle(range(len(self._replicas)))
        self._lock = threading.Lock()
        self.timeout_s = timeout_ms / 1e3
        self.retry_after_s = retry_after_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._last_error = ""  # why a replica was last marked down (kept in later DraftUnavailable messages)

    @property
    def targets(self) -> list[str]:
        return [r.target for r in self._replicas]

    def close(self) -> None:
        for r in self._replicas:
            r.channel.close()

    def _pick(self) -> list[_Replica]:
        """Replicas to try, in round-robin order, skipping those that failed recently."""
        now = time.monotonic()
        with self._lock:
            start = next(self._next)
        order = [self._replicas[(start + i) % len(self._replicas)] for i in range(len(self._replicas))]
        return [r for r in order if r.down_until <= now]

    def call(self, method: str, request, *, deadline: float | None = None, timeout_s: float | None = None):
        """Call `method` on the first healthy replica; on failure try the next one within the deadline."""
        replicas = self._pick()
        if not replicas:
            raise DraftUnavailable(f"retrieval service unavailable (all replicas failed recently; last error: "
                                   f"{self._last_error})")
        last = "no replica tried"
        for r in replicas:
            budget = self.timeout_s if timeout_s is None else timeout_s
            if deadline is not None:
                budget = min(budget, deadline - time.monotonic())
            if budget <= 0:
                raise DraftUnavailable("request deadline leaves no time for drafting")
            try:
                return getattr(r.stub, method)(request, timeout=budget, metadata=self._metadata)
            except grpc.RpcError as e:
                code = e.code()
                last = f"{r.target}: {code.name} {e.details() or ''}".strip()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    # Our request is wrong for this server; another replica would say the same.
                    raise DraftUnavailable(last) from None
                if code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    r.down_until = time.monotonic() + self.retry_after_s
                    self._last_error = last
        raise DraftUnavailable(last)

    def draft(self, context_ids: np.ndarray, params: draft_pb2.DraftParams, *, deadline: float | None = None) -> DraftTree:
        reply = self.call("Draft", draft_pb2.DraftRequest(context=pack_tokens(context_ids), params=params),
                          deadline=deadline)
        try:
            return DraftTree.from_bytes(reply.tokens, reply.parents, reply.scores, reply.source_p,
                                        matched_suffix=reply.matched_suffix, num_matches=reply.num_matches,
                                        context_matched_suffix=reply.context_matched_suffix)
        except ValueError as e:  # a reply we cannot read is a failed draft, never a failed request
            raise DraftUnavailable(f"malformed draft reply: {e}") from None

    def learn(self, tokens: np.ndarray, timeout_s: float = 2.0) -> draft_pb2.LearnResponse:
        """Feed one finished output to the service's online-learning shard (raises DraftUnavailable)."""
        return self.call("Learn", draft_pb2.LearnRequest(tokens=pack_tokens(tokens)), timeout_s=timeout_s)

    def info(self, timeout_s: float = 5.0) -> draft_pb2.DatastoreInfo:
        return self.call("Info", draft_pb2.DatastoreInfoRequest(), timeout_s=timeout_s)


class RemoteDrafter:
    """Drafter over the Draft RPC. `source` is datastore (REST), merged (REST + own context) or crest.

    While the loop skips it (draft_budget.py), `merged` keeps drafting from the request's own tokens in process.
    """

    remote = True
    default_source = SOURCES.index("datastore")

    def __init__(self, client: RetrievalClient, source: str, *, max_suffix: int = 16, deadline: float | None = None):
        self.client = client
        self.source = source
        self.name = {"datastore": "rest-ds", "merged": "rest"}.get(source, source)
        self.max_suffix = max_suffix
        self.deadline = deadline  # monotonic time the whole request must finish by (propagated)
        self.local = PromptLookupDrafter() if source == "merged" else None

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        # The datastore only looks at the last max_suffix tokens; the merged source needs the whole context.
        ctx = context_ids if self.source == "merged" else context_ids[-self.max_suffix:]
        params = draft_pb2.DraftParams(max_nodes=max_nodes, max_suffix=self.max_suffix, source=self.source)
        return self.client.draft(ctx, params, deadline=self.deadline)
