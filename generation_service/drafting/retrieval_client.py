"""Client side of the retrieval service, as seen from the generation worker.

Drafting must never fail a generation request: every error, a missed deadline or a replica that is down
becomes DraftUnavailable, and the verify loop decodes that step autoregressively. Replicas, failover and
deadlines are ragcore/replicated.py's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np

from generation_service import metrics
from generation_service.drafting.drafters import DraftUnavailable, PromptLookupDrafter
from proto import draft_pb2, draft_pb2_grpc
from ragcore.draft_tree import SOURCES, DraftTree
from ragcore.replicated import ReplicatedClient
from ragcore.wire import pack_tokens

# Drafts per DraftBatch call (the service's limit_batch defaults to 1024; a worker batches at most max_batch).
DRAFT_BATCH_MAX = 64


def _failure(kind: str, message: str) -> DraftUnavailable:
    return DraftUnavailable(message)  # drafting never fails a request, whatever went wrong


def _tree(reply: draft_pb2.DraftResponse) -> DraftTree | DraftUnavailable:
    try:
        return DraftTree.from_bytes(reply.tokens, reply.parents, reply.scores, reply.source_p,
                                    matched_suffix=reply.matched_suffix, num_matches=reply.num_matches,
                                    context_matched_suffix=reply.context_matched_suffix)
    except ValueError as e:  # a reply we cannot read is a failed draft, never a failed request
        return DraftUnavailable(f"malformed draft reply: {e}")


class RetrievalClient(ReplicatedClient):
    def __init__(self, target: str, *, timeout_ms: float = 50.0, retry_after_s: float = 1.0,
                 max_message_bytes: int = 64 << 20, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None):
        """token: bearer token sent with every call ("" = none); credentials: TLS (None = plaintext)."""
        super().__init__(target, draft_pb2_grpc.DraftServiceStub, failure=_failure, timeout_s=timeout_ms / 1e3,
                         retry_after_s=retry_after_s, max_message_bytes=max_message_bytes, token=token,
                         credentials=credentials, instrument=metrics.instrument_channel, what="retrieval service")
        self._background: ThreadPoolExecutor | None = None
        self._background_lock = threading.Lock()

    def background(self) -> ThreadPoolExecutor:
        """Threads for drafts nobody waits on (probes of a skipped source), made on first use."""
        with self._background_lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="draft-probe")
            return self._background

    def close(self) -> None:
        with self._background_lock:
            if self._background is not None:
                self._background.shutdown(wait=False, cancel_futures=True)
        super().close()

    def draft(self, context_ids: np.ndarray, params: draft_pb2.DraftParams, *, deadline: float | None = None) -> DraftTree:
        reply = self.call("Draft", draft_pb2.DraftRequest(context=pack_tokens(context_ids), params=params),
                          deadline=deadline)
        tree = _tree(reply)
        if isinstance(tree, DraftUnavailable):
            raise tree
        return tree

    def draft_batch(self, contexts: list[np.ndarray], params: list[draft_pb2.DraftParams], *,
                    deadline: float | None = None) -> list[DraftTree | DraftUnavailable]:
        """Several drafts in one DraftBatch call (one RPC's overhead instead of one per draft, a clear saving of
        wall time on a small machine). A failed call raises DraftUnavailable; an unreadable reply is its
        own item's DraftUnavailable."""
        out: list[DraftTree | DraftUnavailable] = []
        for a in range(0, len(contexts), DRAFT_BATCH_MAX):
            request = draft_pb2.DraftBatchRequest(requests=[
                draft_pb2.DraftRequest(context=pack_tokens(c), params=p)
                for c, p in zip(contexts[a:a + DRAFT_BATCH_MAX], params[a:a + DRAFT_BATCH_MAX])])
            reply = self.call("DraftBatch", request, deadline=deadline)
            if len(reply.responses) != len(request.requests):
                raise DraftUnavailable(f"malformed draft reply: {len(reply.responses)} trees for "
                                       f"{len(request.requests)} contexts")
            out += [_tree(r) for r in reply.responses]
        return out

    def learn(self, tokens: np.ndarray, timeout_s: float = 2.0) -> draft_pb2.LearnResponse:
        """Feed one finished output to the service's online-learning shard (raises DraftUnavailable)."""
        return self.call("Learn", draft_pb2.LearnRequest(tokens=pack_tokens(tokens)), timeout_s=timeout_s)

    def info(self, timeout_s: float = 5.0) -> draft_pb2.DatastoreInfo:
        return self.call("Info", draft_pb2.DatastoreInfoRequest(), timeout_s=timeout_s)


class RemoteDrafter:
    """Drafter over the Draft RPC. `source` is datastore (REST), merged (REST + own context) or crest.

    While the loop skips it (drafting/budget.py), `merged` keeps drafting from the request's own tokens in process.
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

    def _ask(self, context_ids: np.ndarray, max_nodes: int) -> tuple[np.ndarray, draft_pb2.DraftParams]:
        # The datastore only looks at the last max_suffix tokens; the merged source needs the whole context.
        ctx = context_ids if self.source == "merged" else context_ids[-self.max_suffix:]
        return ctx, draft_pb2.DraftParams(max_nodes=max_nodes, max_suffix=self.max_suffix, source=self.source)

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        ctx, params = self._ask(context_ids, max_nodes)
        return self.client.draft(ctx, params, deadline=self.deadline)

    def propose_async(self, context_ids: np.ndarray, max_nodes: int) -> Future:
        """propose() on a background thread (a probe the step does not wait for); the future holds the tree or
        the DraftUnavailable."""
        return self.client.background().submit(self.propose, np.array(context_ids), max_nodes)

    @property
    def batch_key(self) -> RetrievalClient:
        """Drafters with the same key can be asked together (propose_batch)."""
        return self.client

    @staticmethod
    def propose_batch(drafters: list["RemoteDrafter"], contexts: list[np.ndarray],
                      max_nodes: list[int]) -> list[DraftTree | DraftUnavailable]:
        """propose() of several drafters sharing one client, in one call; every item fails alike when the call
        does. The call's deadline is the earliest of theirs."""
        asks = [d._ask(c, n) for d, c, n in zip(drafters, contexts, max_nodes)]
        deadlines = [d.deadline for d in drafters if d.deadline is not None]
        try:
            return drafters[0].client.draft_batch([c for c, _ in asks], [p for _, p in asks],
                                                  deadline=min(deadlines) if deadlines else None)
        except DraftUnavailable as e:
            return [e] * len(drafters)
