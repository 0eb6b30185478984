"""OpenAI request bodies -> worker GenerateRequests, worker replies -> OpenAI response objects. Pure functions.

Unknown top-level fields are ignored, as OpenAI's API does; known fields with a wrong type or value raise
errors.APIError 400 naming the field. Our own knobs live under one key, `ragserve` (sent by the SDKs as
`extra_body={"ragserve": {...}}`); its unknown keys are errors (it is our namespace: a typo must not pass silently).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from gateway.errors import APIError, invalid
from gateway.routing import chat_key, prompt_key
from proto import generation_pb2

EXTENSION = "ragserve"  # the request key of our knobs and the response field of our figures
MAX_TOP_LOGPROBS = 5
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
_EXT_KEYS = ("decoding", "draft_budget", "top_k", "ignore_eos", "learn_from_output", "rag", "knnlm")
# Fields OpenAI defines that change the output and that we do not implement: refused unless left at their
# no-op value, never silently ignored.
_UNSUPPORTED = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
                "tools": ([],), "functions": ([],), "echo": (False,), "suffix": ("",), "repetition_penalty": (1, 1.0)}


@dataclass
class Parsed:
    """One OpenAI request as the worker calls to make: requests[p][i] = prompt p's choice i."""
    chat: bool
    model: str
    requests: list[list[generation_pb2.GenerateRequest]]
    key: list[str]  # the affinity key of each prompt
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise invalid(name, f"must be {bound}, got {v!r}")
    return v


def _num(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v) or not lo <= v <= hi:
        raise invalid(name, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise invalid(name, f"must be a boolean, got {v!r}")
    return v


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) "
                              "are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content", f"must be a string or a list of text parts, got {type(c).__name__}")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in _ROLES:
            raise invalid(f"messages[{i}].role", f"{role!r} is not one of {', '.join(_ROLES)}")
        out.append({"role": _ROLES[role], "content": _content(m, i)})
    return out


def _prompts(body: dict) -> list[str | list[int]]:
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(_is_int(x) and x >= 0 for x in p):
            return [list(p)]
        if all(isinstance(x, list) and x and all(_is_int(t) and t >= 0 for t in x) for x in p):
            return [list(x) for x in p]
    raise invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _stop(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        return [s]
    if isinstance(s, list) and all(isinstance(x, str) for x in s):
        return list(s)
    raise invalid("stop", "must be a string or a list of strings")


def _extension(body: dict, req: generation_pb2.GenerateRequest) -> None:
    ext = body.get(EXTENSION)
    if ext is None:
        return
    if not isinstance(ext, dict):
        raise invalid(EXTENSION, f"must be an object with keys among {', '.join(_EXT_KEYS)}")
    for k in ext:
        if k not in _EXT_KEYS:
            raise invalid(f"{EXTENSION}.{k}", f"unknown key; expected one of {', '.join(_EXT_KEYS)}")
    if ext.get("decoding") is not None:
        if not isinstance(ext["decoding"], str):
            raise invalid(f"{EXTENSION}.decoding", "must be a string (ar | pld | rest-ds | rest | crest | knnlm)")
        req.decoding = ext["decoding"]
    for name in ("draft_budget", "top_k"):
        v = _int(ext, name, 0, 2**32 - 1) if name in ext else None
        if v is not None:
            setattr(req, name, v)
    for name in ("ignore_eos", "learn_from_output"):
        v = _bool(ext, name) if name in ext else None
        if v is not None:
            setattr(req, name, v)
    for name, target in (("rag", req.rag), ("knnlm", req.knnlm)):
        if ext.get(name) is not None:
            if not isinstance(ext[name], dict):
                raise invalid(f"{EXTENSION}.{name}", "must be an object")
            try:
                json_format.ParseDict(ext[name], target)
            except json_format.ParseError as e:
                raise invalid(f"{EXTENSION}.{name}", str(e)) from None
            if not ext[name]:
                target.SetInParent()  # {} = the mode with its defaults


def _copy(req: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    c = generation_pb2.GenerateRequest()
    c.CopyFrom(req)
    return c


def parse(body: Any, chat: bool, max_n: int, affinity_chars: int) -> Parsed:
    """A request body (decoded JSON) -> the worker requests; APIError 400 on a wrong field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the model id (GET /v1/models)")
    for name, neutral in _UNSUPPORTED.items():
        if name in body and body[name] is not None and body[name] not in neutral:
            raise invalid(name, "is not supported by this server")
    n = _int(body, "n", 1, max_n) or 1
    best_of = _int(body, "best_of", 1, max_n)
    if best_of is not None and best_of != n:
        raise invalid("best_of", "is not supported by this server (only best_of == n)")
    stream, include_usage = _streaming(body)
    logprobs, top = _logprobs(body, chat)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
        raise invalid("seed", f"must be an integer in [0, 2**64), got {seed!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "must be a string")
    base = _base_request(body, chat, logprobs, top)
    prompts, keys = _prompt_requests(body, chat, base, affinity_chars)
    requests = []
    for r in prompts:
        choices = [r] if n == 1 else [_copy(r) for _ in range(n)]
        if seed is not None:
            for i, c in enumerate(choices):
                c.seed = (seed + i) % 2**64  # n choices from one seed differ, and are reproducible
        requests.append(choices)
    return Parsed(chat=chat, model=model, requests=requests, key=keys, stream=stream, include_usage=include_usage,
                  logprobs=logprobs, top_logprobs=top,
                  id=("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12))


def _streaming(body: dict) -> tuple[bool, bool]:
    """-> (stream, include_usage)."""
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    if not isinstance(opts, dict):
        raise invalid("stream_options", "must be an object")
    return stream, bool(_bool(opts, "include_usage"))


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """-> (logprobs asked, top alternatives per token): chat asks with logprobs + top_logprobs, completions with
    logprobs = the number of alternatives."""
    if not chat:
        lp = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        return lp is not None, lp or 0
    logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid("top_logprobs", "requires logprobs to be true")
    return logprobs, top or 0


def _base_request(body: dict, chat: bool, logprobs: bool, top: int) -> generation_pb2.GenerateRequest:
    """What every worker request of this body carries: length, sampling, stop sequences, logprobs and ragserve's
    own extension."""
    max_tokens = _int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    temperature = _num(body, "temperature", 0.0, 2.0)
    top_p = _num(body, "top_p", 0.0, 1.0)
    base = generation_pb2.GenerateRequest(stop=_stop(body))
    if max_tokens is not None:
        base.max_new_tokens = min(max_tokens, 2**32 - 1)
    if temperature is not None:
        base.temperature = temperature
    if top_p is not None:
        base.top_p = top_p
    if logprobs:
        base.logprobs = True
        base.top_logprobs = top
    _extension(body, base)
    return base


def _prompt_requests(body: dict, chat: bool, base: generation_pb2.GenerateRequest,
                     affinity_chars: int) -> tuple[list[generation_pb2.GenerateRequest], list[str]]:
    """One request per prompt (a chat has one; a completion body may give several) and each one's routing key."""
    if chat:
        msgs = _messages(body)
        r = base  # one prompt: the template itself becomes its request (no copy on the common path)
        for m in msgs:
            r.messages.add(role=m["role"], content=m["content"])
        return [r], [chat_key(msgs, affinity_chars)]
    prompts: list[generation_pb2.GenerateRequest] = []
    keys: list[str] = []
    given = _prompts(body)
    for p in given:
        r = base if len(given) == 1 else _copy(base)
        if isinstance(p, str):
            if not p:
                raise invalid("prompt", "must not be empty")
            r.prompt = p
        else:
            r.prompt_tokens.extend(p)
        prompts.append(r)
        keys.append(prompt_key(p, affinity_chars))
    return prompts, keys


# ------------------------------------------------------------------------------------------------- replies

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculation(index: int, stats: generation_pb2.SpeculationStats) -> dict:
    """One choice's figures in the extension field."""
    return {"index": index, "decoding": stats.decoding, "forward_steps": stats.forward_steps,
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "draft_tokens_proposed": stats.draft_tokens_proposed,
            "accepted_tokens": stats.draft_tokens_accepted, "cached_prompt_tokens": stats.cached_prompt_tokens,
            "degraded": stats.degraded, "total_ms": round(stats.total_ms, 3)}


def finish_reason(worker: str) -> str:
    return _FINISH.get(worker, worker or "stop")


def _bytes(entry) -> list[int]:
    return list(entry.token_bytes)


def _text(entry) -> str:
    return entry.token


def chat_logprobs(entries) -> list[dict]:
    """Worker TokenLogprobs -> the chat `logprobs.content` list."""
    return [{"token": _text(e), "logprob": e.logprob, "bytes": _bytes(e),
             "top_logprobs": [{"token": _text(t), "logprob": t.logprob, "bytes": _bytes(t)} for t in e.top]}
            for e in entries]


def completion_logprobs(entries, offset: int = 0) -> dict:
    """Worker TokenLogprobs -> the legacy completions `logprobs` object (text_offset from `offset`)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(_text(e))
        lps.append(e.logprob)
        tops.append({_text(t): t.logprob for t in e.top})
        offsets.append(offset)
        offset += len(_text(e))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def reply(p: Parsed, model: str, results: list[list[generation_pb2.GenerateResponse]]) -> dict:
    """Unary replies (results[prompt][choice]) -> a chat.completion or text_completion object."""
    choices, ext = [], []
    prompt_tokens = completion_tokens = 0
    for pi, per_prompt in enumerate(results):
        prompt_tokens += per_prompt[0].usage.prompt_tokens
        for ci, r in enumerate(per_prompt):
            index = pi * len(per_prompt) + ci
            completion_tokens += r.usage.completion_tokens
            ext.append(speculation(index, r.stats))
            if p.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": r.text},
                          "logprobs": {"content": chat_logprobs(r.logprobs)} if p.logprobs else None,
                          "finish_reason": finish_reason(r.finish_reason)}
            else:
                choice = {"index": index, "text": r.text,
                          "logprobs": completion_logprobs(r.logprobs) if p.logprobs else None,
                          "finish_reason": finish_reason(r.finish_reason)}
            choices.append(choice)
    return {"id": p.id, "object": "chat.completion" if p.chat else "text_completion", "created": p.created,
            "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens),
            EXTENSION: {"choices": ext}}


def chunk(p: Parsed, model: str, choices: list[dict], usage_: dict | None = None, ext: dict | None = None) -> dict:
    out = {"id": p.id, "object": "chat.completion.chunk" if p.chat else "text_completion", "created": p.created,
           "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    if ext is not None:
        out[EXTENSION] = ext
    return out


def stream_choice(p: Parsed, index: int, msg: generation_pb2.GenerateStreamResponse | None, first: bool,
                  offset: int = 0) -> dict:
    """One stream message of one choice -> its entry in a chunk's `choices` (msg None: the role-only opener)."""
    finish = finish_reason(msg.finish_reason) if msg is not None and msg.finish_reason else None
    text = msg.text_delta if msg is not None else ""
    if p.chat:
        delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        lp = {"content": chat_logprobs(msg.logprobs)} if p.logprobs and msg is not None and msg.logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    lp = completion_logprobs(msg.logprobs, offset) if p.logprobs and msg is not None and msg.logprobs else None
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
