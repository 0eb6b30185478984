"""The kernels' claimed loops (claim_pool.cpp): a loop's pieces go to whichever thread claims them first, so which
thread computed an output must never show in its bits. Each case computes the same linear with claimed pieces on two
threads, with torch's fixed ranges (at::parallel_for) on two threads and on one thread: all three must be equal bit
for bit and equal the brute-force matmul's values within its rounding bound; a pass with one row changed must not be
(the loop reads its own input, not a stale piece). Plus the callers the pool must survive: two threads in the fused
forward at once (one runs its loops alone) and a forked child (it starts its own helpers)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from generation_service.model.kernels.build import kernel
from generation_service.model.q4_weights import dequantize
from tests.generation.test_q4 import random_blocks

needs_kernel = pytest.mark.skipif(kernel() is None, reason="block kernel not buildable here (no compiler)")

K, N = 32 * 3, 1000  # N: 32 chunks of weight rows, so two threads cut it into 8 pieces of 4 chunks (the last short)

# (weight path, rows of x): one tile, a tile and a bit, several tiles; argmax over the same rows below
CASES = [("fp32 blocks", 1), ("fp32 blocks", 11), ("fp32 blocks", 40),
         ("bf16 blocks", 1), ("bf16 blocks", 17), ("bf16 decoded copy", 24), ("fp32 dense", 9)]


def with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def claimed(on: bool, fn):
    kernel().set_claimed_loops(on)
    try:
        return fn()
    finally:
        kernel().set_claimed_loops(True)


def linear_case(path: str, m: int, seed: int = 3):
    if path.startswith("bf16") and not kernel().bf16():
        pytest.skip("no AMX tiles or AVX512-BF16 here")
    if path == "bf16 decoded copy" and not kernel().wide_bf16():
        pytest.skip("the bf16 path here does not take decoded weights")
    rng = np.random.default_rng(seed)
    packed = random_blocks(rng, "q4_1", N, K)
    x = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32))
    dense = torch.from_numpy(dequantize("q4_1", packed, K))
    w = dense if path == "fp32 dense" else torch.from_numpy(packed)
    wide = kernel().decode_bf16(w, K) if path == "bf16 decoded copy" else None
    return (lambda xx: kernel().block_linear(xx, w, path.startswith("bf16"), wide)), x, dense.double()


def exit_code_within(pid: int, seconds: float, what: str) -> int:
    """The exit code of child `pid`; killed and the test failed if it is still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"{what}: the child was still running after {seconds:.0f} s")


@needs_kernel
@pytest.mark.parametrize("path,m", CASES)
def test_claimed_pieces_give_the_bits_of_fixed_ranges_and_of_one_thread(path, m):
    lin, x, dense = linear_case(path, m)
    two_claimed = with_threads(2, lambda: claimed(True, lambda: lin(x)))
    two_fixed = with_threads(2, lambda: claimed(False, lambda: lin(x)))
    one = with_threads(1, lambda: lin(x))
    assert torch.equal(two_claimed, two_fixed) and torch.equal(two_claimed, one)
    xd = x.double() if not path.startswith("bf16") else x.bfloat16().double()
    wd = dense if not path.startswith("bf16") else dense.float().bfloat16().double()
    ref = xd @ wd.T
    bound = 1e-5 * (xd.abs() @ wd.abs().T) + 1e-30
    assert bool(((two_claimed.double() - ref).abs() <= bound).all())  # every piece written, none skipped
    changed = x.clone()
    changed[-1] += 1.0
    got = with_threads(2, lambda: lin(changed))
    assert torch.equal(got[:-1], two_claimed[:-1]) and not torch.equal(got[-1], two_claimed[-1])
    picks = with_threads(2, lambda: kernel().argmax_rows(two_claimed))
    assert torch.equal(picks, two_claimed.argmax(dim=1))


@needs_kernel
@pytest.mark.model
def test_two_threads_in_the_fused_forward_at_once_get_their_solo_bits(tmq4):
    """LeanForward.forward releases the GIL, so two callers can be in the kernels together: the second finds the
    pool busy and runs its loops on its own thread; each caller's logits equal its solo run's."""
    from generation_service.engine.speculative import prefill
    from generation_service.engine.steps import tree_segment
    from generation_service.model.target import forward_batch, new_cache

    rng = np.random.default_rng(5)
    prompts = [torch.from_numpy(rng.integers(0, 30000, 40)) for _ in range(2)]
    caches = [new_cache(tmq4, 200) for _ in prompts]
    for c, p in zip(caches, prompts):
        prefill(tmq4, c, p)
    empty = np.zeros(0, np.int32)

    def step(c, last: int) -> torch.Tensor:
        out = forward_batch(tmq4, [tree_segment(tmq4, c, last, empty, empty)])[0].clone()
        c.crop(-1)
        return out

    solo = [step(c, 100 + i) for i, c in enumerate(caches)]
    got: list[list[torch.Tensor]] = [[], []]

    def run(i: int) -> None:
        for _ in range(30):
            got[i].append(step(caches[i], 100 + i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i in range(2):
        assert len(got[i]) == 30 and all(torch.equal(g, solo[i]) for g in got[i])
    assert not torch.equal(solo[0], solo[1])


@needs_kernel
def test_a_forked_child_runs_its_loops_on_helpers_of_its_own():
    lin, x, _ = linear_case("fp32 blocks", 11)
    parent = with_threads(2, lambda: lin(x))  # the parent's helpers exist now; the child has none of them
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = False
        try:
            torch.set_num_threads(2)
            ok = all(torch.equal(lin(x), parent) for _ in range(20))
        finally:
            os._exit(0 if ok else 1)
    assert exit_code_within(pid, 60, "the forked child's loops did not finish") == 0


def _spin(seconds: float) -> None:  # pragma: no cover (a child process)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    os._exit(0)


@needs_kernel
def test_back_to_back_loops_beside_a_busy_core_all_end():
    """Loops started right after each other while a third process keeps a core busy, so the caller and its helper
    are descheduled at any point of a loop's set-up: every loop must end (before the fix a helper still
    scanning the previous loop could claim a piece of the next one and have its count reset, and the caller then
    waited for it forever) and give the same bits. Bounded: 20,000 loops or 8 s in a child, which must exit within
    60 s."""
    lin, x, _ = linear_case("fp32 blocks", 1)
    expected = with_threads(2, lambda: lin(x))
    spinner = os.fork()
    if spinner == 0:  # pragma: no cover
        _spin(10.0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        ok = False
        try:
            torch.set_num_threads(2)
            end = time.monotonic() + 8.0
            ok = True
            for i in range(20_000):
                out = lin(x)
                if i % 500 == 0:
                    ok = ok and torch.equal(out, expected)
                if time.monotonic() > end:
                    break
        finally:
            os._exit(0 if ok else 1)
    try:
        assert exit_code_within(pid, 60, "a claimed loop did not end") == 0  # Not: a loop's bits changed
    finally:
        os.kill(spinner, 9)
        os.waitpid(spinner, 0)
