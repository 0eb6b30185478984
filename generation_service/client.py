"""Minimal Python client for the generation worker (also a CLI).

    from generation_service.client import GenerationClient
    with GenerationClient("127.0.0.1:50052") as c:
        reply = c.generate(prompt="def fib(n):", max_new_tokens=64, decoding="rest")
        print(reply.text, reply.stats.mean_accepted_length)
        for delta in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(delta.text_delta, end="", flush=True)

    python -m generation_service.client --prompt 'def fib(n):' --decoding rest --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterator

import grpc

from proto import generation_pb2, generation_pb2_grpc


def build_request(prompt: str | None = None, messages: list[dict] | None = None,
                  prompt_tokens: list[int] | None = None, **params) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(**params)
    if prompt is not None:
        req.prompt = prompt
    for m in messages or []:
        req.messages.add(role=m["role"], content=m["content"])
    if prompt_tokens is not None:
        req.prompt_tokens.extend(prompt_tokens)
    return req


class GenerationClient:
    def __init__(self, target: str = "127.0.0.1:50052", *, metadata: list[tuple[str, str]] | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        options = [("grpc.max_receive_message_length", 16 << 20)]
        self.channel = (grpc.secure_channel(target, credentials, options=options) if credentials
                        else grpc.insecure_channel(target, options=options))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.metadata = metadata

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 prompt_tokens: list[int] | None = None, timeout: float | None = None,
                 **params) -> generation_pb2.GenerateResponse:
        req = build_request(prompt, messages, prompt_tokens, **params)
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               prompt_tokens: list[int] | None = None, timeout: float | None = None,
               **params) -> Iterator[generation_pb2.GenerateStreamResponse]:
        req = build_request(prompt, messages, prompt_tokens, **params)
        return self.stub.GenerateStream(req, timeout=timeout, metadata=self.metadata)

    def info(self, timeout: float = 10.0) -> generation_pb2.WorkerInfo:
        """What the worker serves with: model, dtype, threads, CPU, the calibrated cost curves."""
        return self.stub.GetInfo(generation_pb2.WorkerInfoRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_stats(s: generation_pb2.SpeculationStats, completion_tokens: int) -> str:
    ms_tok = s.total_ms / max(completion_tokens, 1)
    line = (f"{s.decoding}: {completion_tokens} tokens, {s.forward_steps} forward steps, "
            f"M={s.mean_accepted_length:.2f}, {ms_tok:.1f} ms/token "
            f"(prefill {s.prefill_ms:.0f} ms, draft {s.draft_ms:.0f} ms, verify {s.verify_ms:.0f} ms)")
    if s.degraded:
        line += f" DEGRADED {s.degraded_steps} steps: {s.degraded_reason}"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m generation_service.client", description="Call Generate / GenerateStream")
    ap.add_argument("--target", default="127.0.0.1:50052", help="worker address host:port (default %(default)s)")
    ap.add_argument("--prompt", help="send this text as a raw prompt (no chat template)")
    ap.add_argument("--chat", help="send this text as a user chat message (chat template applied)")
    ap.add_argument("--decoding", default="", help="ar | pld | rest-ds | rest (default: server's)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="most tokens to generate (0 = server's default; default %(default)s)")
    ap.add_argument("--temperature", type=float, help="sampling temperature (unset or 0 = greedy)")
    ap.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (unset = 1, off)")
    ap.add_argument("--top-k", type=int, help="sample from the k likeliest tokens (unset or 0 = off)")
    ap.add_argument("--seed", type=int, help="sampling seed: same seed, same output (unset = random)")
    ap.add_argument("--stop", action="append", default=[],
                    help="stop sequence, not included in the output (repeat for several)")
    ap.add_argument("--stream", action="store_true",
                    help="call GenerateStream and print tokens as they arrive (default: one Generate call)")
    args = ap.parse_args(argv)
    if (args.prompt is None) == (args.chat is None):
        ap.error("give exactly one of --prompt / --chat")
    params = dict(max_new_tokens=args.max_new_tokens, decoding=args.decoding, stop=args.stop)
    for k in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, k) is not None:
            params[k] = getattr(args, k)
    messages = [{"role": "user", "content": args.chat}] if args.chat else None
    with GenerationClient(args.target) as c:
        try:
            if args.stream:
                last = None
                for last in c.stream(args.prompt, messages=messages, **params):
                    sys.stdout.write(last.text_delta)
                    sys.stdout.flush()
                print()
                if last is not None:
                    print(format_stats(last.stats, last.usage.completion_tokens), file=sys.stderr)
            else:
                r = c.generate(args.prompt, messages=messages, **params)
                print(r.text)
                print(format_stats(r.stats, r.usage.completion_tokens), file=sys.stderr)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
