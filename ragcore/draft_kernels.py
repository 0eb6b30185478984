"""Every numba kernel of the drafting hot path, in one file (GIL-free, cached on disk).

One file on purpose: numba's on-disk cache only notices edits to the file that defines a cached function, so a
kernel calling into another file could keep running stale machine code after that file changed.

Sections: (1) continuation rows -> counted trie -> top-k draft tree; (2) prompt lookup inside the request's own
tokens; (3) suffix-array search and continuation gather over shards, and the fused draft kernels.

(1) Counted trie.
Every drafting source (suffix-array shards, the request's own tokens) produces *rows*: the continuation read
after each match, with a weight. A trie over those rows, where a node's weight is the summed weight of the rows
passing through it, is REST's draft trie; the draft is its `max_nodes` heaviest nodes.

Why no hashing and no sorting on the hot path: rows in (suffix-array) order put every shared prefix in one
contiguous block, so the trie is one linear pass that compares each row with the previous one (their common
prefix = nodes reused, the rest = new nodes). Matches of one suffix are a contiguous suffix-array range whose
continuations are already in that order; blocks from several shards / sources are merged as sorted runs.
(A variant that builds only shared nodes and expands row tails lazily in a best-first search was slower on
HumanEval contexts: the extra lcp pass and adjacency lists cost more than they save.)

Worked example, rows (weight 1 each) "a b", "a c", "d" (already sorted):
    nodes (creation order): 0:a w2 d1, 1:b w1 d2 (parent 0), 2:c w1 d2 (parent 0), 3:d w1 d1
    top-3 by (weight desc, depth asc, path asc) = {0, 1, 3}; BFS order (depth, path) = [a, d, b]
    tokens [a, d, b], parents [-1, -1, 0], scores [2, 1, 1]

A child's weight never exceeds its parent's (its rows are a subset; all weights are positive and float
addition is monotone), and ties go to the shallower node, so the selection is always a connected subtree.

(2) Prompt lookup.
The context's longest suffix (max_suffix down to min_suffix) that also occurs earlier in the context; every
earlier occurrence (most recent first, up to max_matches) contributes the tokens that followed it as a row
for the draft trie (section 1). Occurrences may overlap the suffix itself, as prompt lookup does.

Worked example, ctx = [7, 1, 2, 9, 1, 2, 5, 1, 2], max_suffix 3, min_suffix 1, continuation 2:
    suffix [1, 2] occurs ending at 5 and 2 ([5, 1, 2] and [9, 1, 2] do not) -> L = 2
    rows (most recent first): [5, 1], [9, 1]
"""

from __future__ import annotations

import numba as nb
import numpy as np

_JIT = dict(nogil=True, cache=True)

# Source columns of a draft's per-node estimates (draft_tree.SOURCES names them): the datastore's own shards,
# the request's own tokens (prompt lookup), and shards learned online from finished outputs.
SRC_DATASTORE, SRC_CONTEXT, SRC_LEARNED = 0, 1, 2
N_SOURCES = 3

# ----------------------------------------------------------------------------------------------------------------
# (1) Counted trie


@nb.njit(**_JIT)
def row_less(rows, lens, a, b) -> bool:
    """rows: int32 [m, C], lens: int32 [m]. rows[a] < rows[b] in suffix-array order.

    A row that ends early (at a document separator) sorts *after* its extensions, because the separator is
    larger than every token; that is the order of continuations read from a suffix-array range. Any order
    that keeps equal prefixes contiguous builds the same trie; runs only need to agree on one.
    """
    n = min(lens[a], lens[b])
    for j in range(n):
        x = rows[a, j]
        y = rows[b, j]
        if x != y:
            return x < y
    return lens[a] > lens[b]


@nb.njit(**_JIT)
def merge_runs(rows, lens, run_starts):
    """Order that sorts rows, given they are a concatenation of sorted runs.

    rows: int32 [m, C]; lens: int32 [m]; run_starts: int64 [r + 1] (run i = rows[run_starts[i]:run_starts[i+1]]).
    Returns order: int64 [m]. Bottom-up pairwise merging of runs: O(m log r) row comparisons, O(m) when r == 1.
    A run of length 1 is trivially sorted, so unsorted rows can be passed as one run each.
    """
    m = run_starts[-1]
    order = np.arange(m)
    r = run_starts.shape[0] - 1
    if r <= 1:
        return order
    buf = np.empty(m, np.int64)
    bounds = run_starts.copy()
    while r > 1:
        new_r = 0
        i = 0
        while i < r:
            lo = bounds[i]
            if i + 1 >= r:  # odd run out: copy through
                hi = bounds[i + 1]
                buf[lo:hi] = order[lo:hi]
            else:
                mid = bounds[i + 1]
                hi = bounds[i + 2]
                p, q, k = lo, mid, lo
                while p < mid and q < hi:
                    # `<=` keeps equal rows in run order (stable), so results never depend on tie order.
                    if not row_less(rows, lens, order[q], order[p]):
                        buf[k] = order[p]
                        p += 1
                    else:
                        buf[k] = order[q]
                        q += 1
                    k += 1
                while p < mid:
                    buf[k] = order[p]
                    p += 1
                    k += 1
                while q < hi:
                    buf[k] = order[q]
                    q += 1
                    k += 1
            bounds[new_r] = lo
            new_r += 1
            i += 2
        bounds[new_r] = m
        r = new_r
        order, buf = buf, order
    return order


@nb.njit(**_JIT)
def build_trie(rows, lens, weights, order, row_src, n_src):
    """Counted trie of ordered rows (see row_less) in one linear pass.

    rows: int32 [m, C]; lens: int32 [m]; weights: float64 [m]; order: int64 [m] (rows[order] sorted by row_less);
    row_src: int64 [m], the source column of each row (< n_src).
    Returns (token int32 [n], parent int32 [n], depth int32 [n], weight float64 [n], src_weight float64 [n, n_src],
    n). Node ids follow the rows: a parent precedes its children and same-depth nodes are in lexicographic order of
    their paths (-1 parent = root child, depth 1 = root child). src_weight splits each node's weight by source.
    """
    m = order.shape[0]
    cap = 0
    for i in range(m):
        cap += lens[i]
    token = np.empty(cap, np.int32)
    parent = np.empty(cap, np.int32)
    depth = np.empty(cap, np.int32)
    weight = np.empty(cap, np.float64)
    src_weight = np.zeros((cap, n_src), np.float64)
    path = np.empty(max(rows.shape[1], 1), np.int32)  # node ids along the previous row
    n = 0
    prev = -1
    for ii in range(m):
        r = order[ii]
        length = lens[r]
        w = weights[r]
        src = row_src[r]
        lcp = 0
        if prev >= 0:
            lim = min(length, lens[prev])
            while lcp < lim and rows[r, lcp] == rows[prev, lcp]:
                lcp += 1
        for d in range(lcp):
            weight[path[d]] += w
            src_weight[path[d], src] += w
        for d in range(lcp, length):
            token[n] = rows[r, d]
            parent[n] = path[d - 1] if d > 0 else -1
            depth[n] = d + 1
            weight[n] = w
            src_weight[n, src] = w
            path[d] = n
            n += 1
        prev = r
    return token, parent, depth, weight, src_weight, n


@nb.njit(**_JIT)
def _better(weight, depth, a, b) -> bool:
    """Selection order: heavier first; ties -> shallower (parents precede children) -> lexicographic path.

    Same-depth node ids are in lexicographic order of their paths (build_trie creates them row by row).
    """
    if weight[a] != weight[b]:
        return weight[a] > weight[b]
    if depth[a] != depth[b]:
        return depth[a] < depth[b]
    return a < b


@nb.njit(**_JIT)
def _sift_down(heap, size, weight, depth, i):
    # Min-heap on `_better`: heap[0] is the worst node kept so far.
    while True:
        left = 2 * i + 1
        if left >= size:
            return
        worst = left
        right = left + 1
        if right < size and _better(weight, depth, heap[left], heap[right]):
            worst = right
        if _better(weight, depth, heap[i], heap[worst]):
            heap[i], heap[worst] = heap[worst], heap[i]
            i = worst
        else:
            return


@nb.njit(**_JIT)
def top_k_bfs(token, parent, depth, weight, n, k, src_weight, src_total):
    """The k best nodes (bounded min-heap, O(n log k)) re-indexed in BFS order (depth, lexicographic path).

    Returns (tokens int32 [s], parents int32 [s], scores float32 [s], source_p float32 [s, n_src]) with
    s = min(n, k); source_p[i, c] = the share of source c's row weight passing through node i (0 when source c
    has no rows), i.e. source c's own estimate that the continuation starts with node i's path.
    """
    k = min(k, n)
    heap = np.empty(max(k, 1), np.int64)
    size = 0
    for v in range(n):
        if size < k:
            # Sift up.
            i = size
            heap[i] = v
            size += 1
            while i > 0:
                p = (i - 1) // 2
                if _better(weight, depth, heap[p], heap[i]):
                    heap[i], heap[p] = heap[p], heap[i]
                    i = p
                else:
                    break
        elif k > 0 and _better(weight, depth, v, heap[0]):
            heap[0] = v
            _sift_down(heap, size, weight, depth, 0)
    chosen = heap[:size].copy()
    # BFS order: by depth, then node id = lexicographic path (siblings stay together, parents come first).
    keys = np.empty(size, np.int64)
    for i in range(size):
        keys[i] = np.int64(depth[chosen[i]]) * (n + 1) + chosen[i]
    chosen = chosen[np.argsort(keys)]
    new_index = np.full(n, -1, np.int32)
    out_tok = np.empty(size, np.int32)
    out_par = np.empty(size, np.int32)
    out_score = np.empty(size, np.float32)
    n_src = src_total.shape[0]
    out_p = np.zeros((size, n_src), np.float32)
    for i in range(size):
        v = chosen[i]
        new_index[v] = i
        out_tok[i] = token[v]
        out_par[i] = -1 if parent[v] < 0 else new_index[parent[v]]
        out_score[i] = weight[v]
        for c in range(n_src):
            if src_total[c] > 0:
                out_p[i, c] = min(src_weight[v, c] / src_total[c], 1.0)
    return out_tok, out_par, out_score, out_p


@nb.njit(**_JIT)
def tree_from_rows(rows, lens, weights, run_starts, max_nodes, row_src, n_src):
    """Rows (concatenated sorted runs) -> (tokens, parents, scores, source_p) of the top-`max_nodes` draft tree.

    row_src: int64 [m], each row's source column (see draft_tree.SOURCES); source_p is [s, n_src].
    """
    order = merge_runs(rows, lens, run_starts)
    token, parent, depth, weight, src_weight, n = build_trie(rows, lens, weights, order, row_src, n_src)
    src_total = np.zeros(n_src, np.float64)
    for r in range(row_src.shape[0]):
        if lens[r] > 0:  # an empty row (a match at a document's end) predicts nothing
            src_total[row_src[r]] += weights[r]
    return top_k_bfs(token, parent, depth, weight, n, max_nodes, src_weight, src_total)


# ----------------------------------------------------------------------------------------------------------------
# (2) Prompt lookup


@nb.njit(**_JIT)
def context_rows(ctx, max_suffix, min_suffix, max_matches, continuation):
    """ctx: int32 [T] -> (L, rows int32 [k, continuation], lens int32 [k]); L = 0 and k = 0 when nothing matches.

    One backward scan: for each earlier end position i, the length of the common suffix of ctx[:i+1] and ctx
    (capped at max_suffix). O(T) for typical text since most positions fail on the first token.
    """
    t = ctx.shape[0]
    match_len = np.zeros(max(t - 1, 0), np.int32)  # [T-1] common-suffix length ending at each earlier position
    best = 0
    if t >= 2:
        last = ctx[t - 1]
        for i in range(t - 2, -1, -1):
            if ctx[i] != last:
                continue
            cap = min(max_suffix, i + 1)
            k = 1
            while k < cap and ctx[i - k] == ctx[t - 1 - k]:
                k += 1
            match_len[i] = k
            if k > best:
                best = k
    if best < min_suffix:
        return 0, np.zeros((0, continuation), np.int32), np.zeros(0, np.int32)
    count = 0
    for i in range(t - 2, -1, -1):
        if match_len[i] >= best:
            count += 1
            if count >= max_matches:
                break
    rows = np.empty((count, continuation), np.int32)
    lens = np.empty(count, np.int32)
    j = 0
    for i in range(t - 2, -1, -1):
        if j >= count:
            break
        if match_len[i] >= best:
            n = min(continuation, t - 1 - i)
            rows[j, :n] = ctx[i + 1 : i + 1 + n]
            lens[j] = n
            j += 1
    return best, rows, lens


@nb.njit(**_JIT)
def context_tree(ctx, max_suffix, min_suffix, max_matches, continuation, max_nodes):
    """ctx: int32 [T] -> (tokens, parents, scores, matched_suffix, num_matches); scores are match counts."""
    best, rows, lens = context_rows(ctx, max_suffix, min_suffix, max_matches, continuation)
    k = lens.shape[0]
    tok, par, score, src_p = tree_from_rows(rows, lens, np.ones(k, np.float64), np.arange(k + 1), max_nodes,
                                            np.full(k, SRC_CONTEXT, np.int64), N_SOURCES)
    return tok, par, score, src_p, best, k


# ----------------------------------------------------------------------------------------------------------------
# (3) Suffix-array search and gather, see suffix_array.py
#     one shard: tokens [N], sa int32 [N], bucket int64 [vocab + 1]; pattern = ctx[T-L:T]
#
# Bounds: numba does not check indexes, so every index that comes from the file (bucket entries, suffix-array
# entries, reads past a match) is checked here before it is used, and a bad one raises IndexError (the datastore
# turns it into DatastoreCorrupted naming the file): a corrupted store is an error, never a wild read. Valid data
# never trips them (open() verifies the content; these guard a store changed or crafted behind our back). The
# checks are per comparison / per row, not per token, and cost nothing measurable (bench/draft_retrieval.py).


@nb.njit(**_JIT)
def _cmp(tokens, pos, ctx, start, end, skip) -> int:
    """Compare tokens[pos:pos+(end-start)] with ctx[start:end] from offset `skip`: -1 less, 0 prefix-equal, 1 greater.

    Never reads past the array: in a valid shard the last token is a separator, which differs from every context
    token, so running into the end (or an entry outside it) means the shard is corrupted.
    """
    n = tokens.shape[0]
    if pos < 0 or pos >= n:
        raise IndexError("suffix-array entry outside the tokens", pos, n)
    stop = min(end - start, n - pos)
    for j in range(skip, stop):
        x = np.int64(tokens[pos + j])
        y = np.int64(ctx[start + j])
        if x != y:
            return -1 if x < y else 1
    if stop < end - start:
        raise IndexError("suffix runs past the end of the tokens without a separator", pos, n)
    return 0


@nb.njit(**_JIT)
def _bucket_range(bucket, first, n_sa):
    """(lo, hi) = bucket[first], bucket[first + 1], checked to lie within the suffix array."""
    lo = bucket[first]
    hi = bucket[first + 1]
    if lo < 0 or lo > hi or hi > n_sa:
        raise IndexError("bucket table entry outside the suffix array", first, hi)
    return lo, hi


@nb.njit(**_JIT)
def _lower_bound(tokens, sa, bucket, ctx, length) -> tuple:
    """-> (first sa index whose suffix starts with ctx[-length:], found) within the first token's bucket."""
    t = ctx.shape[0]
    start = t - length
    first = np.int64(ctx[start])
    if first >= bucket.shape[0] - 1:
        return 0, False
    lo, hi = _bucket_range(bucket, first, sa.shape[0])
    end_ = hi
    while lo < hi:
        mid = (lo + hi) >> 1
        if _cmp(tokens, sa[mid], ctx, start, t, 1) < 0:
            lo = mid + 1
        else:
            hi = mid
    found = lo < end_ and _cmp(tokens, sa[lo], ctx, start, t, 1) == 0
    return lo, found


@nb.njit(**_JIT)
def _upper_bound(tokens, sa, bucket, ctx, length, lo) -> int:
    """First sa index after `lo` whose suffix does not start with ctx[-length:]."""
    t = ctx.shape[0]
    start = t - length
    _, hi = _bucket_range(bucket, np.int64(ctx[start]), sa.shape[0])
    while lo < hi:
        mid = (lo + hi) >> 1
        if _cmp(tokens, sa[mid], ctx, start, t, 1) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@nb.njit(**_JIT)
def search(toks, sas, buckets, n_shards, ctx, max_suffix, min_suffix):
    """Longest suffix of ctx (max_suffix..min_suffix) occurring in any shard.

    toks/sas/buckets: tuples, entry s < n_shards is shard s (the rest is padding). Returns
    (L, lo int64 [S], hi int64 [S]): the occurrences in shard s are sa_s[lo[s]:hi[s]]; L = 0 (and empty ranges)
    when nothing matches.
    """
    lows = np.zeros(n_shards, np.int64)
    highs = np.zeros(n_shards, np.int64)
    found_lows = np.zeros(n_shards, np.int64)
    found_any = np.zeros(n_shards, np.bool_)
    best_found = np.zeros(n_shards, np.bool_)
    top = min(max_suffix, ctx.shape[0])
    if top < min_suffix:
        return 0, lows, highs
    good = min_suffix - 1  # longest length known to occur (sentinel below the range)
    bad = top + 1  # shortest length known not to occur
    probe = top
    while bad - good > 1:
        hit = False
        for s in range(n_shards):
            lo, found = _lower_bound(toks[s], sas[s], buckets[s], ctx, probe)
            found_lows[s] = lo
            found_any[s] = found
            hit = hit or found
        if hit:
            good = probe
            lows[:] = found_lows
            best_found[:] = found_any
        else:
            bad = probe
        probe = (good + bad) >> 1
    if good < min_suffix:
        return 0, lows, highs
    for s in range(n_shards):
        if best_found[s]:
            highs[s] = _upper_bound(toks[s], sas[s], buckets[s], ctx, good, lows[s])
        else:
            highs[s] = lows[s]
    return good, lows, highs


@nb.njit(**_JIT)
def _allocate(counts, budget):
    """Split `budget` rows over shards proportionally to counts (largest remainder; ties -> lower shard)."""
    total = counts.sum()
    take = np.zeros(counts.shape[0], np.int64)
    if total <= budget:
        return counts.copy()
    rem = np.zeros(counts.shape[0], np.int64)
    given = 0
    for s in range(counts.shape[0]):
        take[s] = counts[s] * budget // total
        rem[s] = counts[s] * budget - take[s] * total
        given += take[s]
    while given < budget:
        best = -1
        for s in range(counts.shape[0]):
            if take[s] < counts[s] and (best < 0 or rem[s] > rem[best]):
                best = s
        take[best] += 1
        rem[best] = -1
        given += 1
    return take


@nb.njit(**_JIT)
def gather(toks, sas, n_shards, sep, length, lows, highs, max_matches, continuation, width, sample_first, extra_rows,
           vocab_size):
    """Continuations after the sampled occurrences, stopping at a document separator.

    Returns (rows int32 [m + extra_rows, width], lens int32 [...], run_starts int64 [S + 1], m); shard s's rows
    are rows[run_starts[s]:run_starts[s+1]], sorted (suffix-array order), each at most `continuation` tokens;
    `extra_rows` rows are left for the caller. A token >= vocab_size that is not the separator, or a row running
    past the end of the tokens, raises IndexError (a corrupted shard; valid shards end with a separator).
    """
    counts = highs - lows
    take = _allocate(counts, max_matches)
    m = take.sum()
    run_starts = np.zeros(n_shards + 1, np.int64)
    # Two passes: all suffix-array reads first, then all token reads. Independent loads let the CPU keep many
    # cache misses in flight (faster than reading each row right after its position).
    pos = np.empty(m, np.int64)
    r = 0
    for s in range(n_shards):
        run_starts[s] = r
        sa = sas[s]
        n = counts[s]
        k = take[s]
        n_tok = toks[s].shape[0]
        for i in range(k):
            v = np.int64(sa[lows[s] + (i if sample_first else (i * n) // k)])
            if v < 0 or v + length > n_tok:  # an occurrence of the matched suffix lies inside the tokens
                raise IndexError("suffix-array entry outside the tokens", v, n_tok)
            pos[r] = v + length
            r += 1
    rows = np.empty((m + extra_rows, max(width, continuation)), np.int32)
    lens = np.zeros(m + extra_rows, np.int32)
    for s in range(n_shards):
        tokens = toks[s]
        n_tok = tokens.shape[0]
        for r in range(run_starts[s], run_starts[s] + take[s]):
            p = pos[r]
            stop = min(continuation, n_tok - p)  # >= 0: checked when the position was read
            c = 0
            while c < stop:
                v = np.int64(tokens[p + c])
                if v == sep:
                    break
                if v >= vocab_size:
                    raise IndexError("token outside the vocabulary", v, vocab_size)
                rows[r, c] = v
                c += 1
            if c == stop and c < continuation and p + c >= n_tok:
                raise IndexError("continuation runs past the end of the tokens without a separator", p, n_tok)
            lens[r] = c
    run_starts[n_shards] = m
    return rows, lens, run_starts, m


@nb.njit(**_JIT)
def draft_kernel(toks, sas, buckets, n_shards, n_base, sep, ctx, max_suffix, min_suffix, max_matches, continuation,
                 max_nodes, use_context, ds_weight, ctx_weight, ctx_min_suffix, ctx_max_matches, ctx_continuation,
                 sample_first):
    """One draft. Returns (tokens int32, parents int32, scores float32, source_p float32 [n, N_SOURCES], ds_suffix,
    ds_matches, ctx_suffix).

    use_context False: REST (every datastore row weighs 1, scores are match counts). True: datastore rows weigh
    ds_weight / m_ds and context rows (up to ctx_continuation tokens) ctx_weight / m_ctx in one trie. Rows of
    shards from n_base on (learned online) count as the learned source in source_p.
    """
    length, lows, highs = search(toks, sas, buckets, n_shards, ctx, max_suffix, min_suffix)
    ctx_len = 0
    crows = np.zeros((0, ctx_continuation), np.int32)
    clens = np.zeros(0, np.int32)
    if use_context:
        ctx_len, crows, clens = context_rows(ctx, max_suffix, ctx_min_suffix, ctx_max_matches, ctx_continuation)
    n_ctx = clens.shape[0]
    width = ctx_continuation if n_ctx > 0 else continuation
    rows, lens, ds_runs, m = gather(toks, sas, n_shards, sep, length, lows, highs, max_matches, continuation, width,
                                    sample_first, n_ctx, buckets[0].shape[0] - 1)
    weights = np.empty(m + n_ctx, np.float64)
    weights[:m] = ds_weight / m if use_context and m > 0 else 1.0
    row_src = np.full(m + n_ctx, SRC_CONTEXT, np.int64)
    for s in range(n_shards):
        row_src[ds_runs[s]:ds_runs[s + 1]] = SRC_DATASTORE if s < n_base else SRC_LEARNED
    if n_ctx > 0:
        rows[m:, :ctx_continuation] = crows
        lens[m:] = clens
        weights[m:] = ctx_weight / n_ctx
    # Context rows are unsorted: each is a run of one, merged with the shards' sorted runs.
    run_starts = np.empty(ds_runs.shape[0] + n_ctx, np.int64)
    run_starts[: ds_runs.shape[0]] = ds_runs
    for i in range(n_ctx):
        run_starts[ds_runs.shape[0] + i] = m + i + 1
    tok, par, score, src_p = tree_from_rows(rows, lens, weights, run_starts, max_nodes, row_src, N_SOURCES)
    return tok, par, score, src_p, length, m, ctx_len


@nb.njit(**_JIT)
def draft_packed(toks, sas, buckets, n_shards, n_base, sep, ctx_flat, ctx_starts, lo, hi, max_suffix, min_suffix,
                 max_matches, continuation, max_nodes, use_context, ds_weight, ctx_weight, ctx_min_suffix,
                 ctx_max_matches, ctx_continuation, sample_first, out_tok, out_par, out_score, out_p, out_meta):
    """Drafts for contexts lo..hi-1 of a packed batch (ctx i = ctx_flat[ctx_starts[i]:ctx_starts[i+1]]).

    out_tok/out_par: int32 [B, max_nodes]; out_score: float32 [B, max_nodes]; out_p: float32 [B, max_nodes,
    N_SOURCES]; out_meta: int64 [B, 4] = (nodes, ds_suffix, ds_matches, ctx_suffix). One call per thread, no GIL
    inside.
    """
    for i in range(lo, hi):
        ctx = ctx_flat[ctx_starts[i] : ctx_starts[i + 1]]
        tok, par, score, src_p, length, m, ctx_len = draft_kernel(
            toks, sas, buckets, n_shards, n_base, sep, ctx, max_suffix, min_suffix, max_matches, continuation,
            max_nodes, use_context, ds_weight, ctx_weight, ctx_min_suffix, ctx_max_matches, ctx_continuation,
            sample_first)
        k = tok.shape[0]
        out_tok[i, :k] = tok
        out_par[i, :k] = par
        out_score[i, :k] = score
        out_p[i, :k] = src_p
        out_meta[i, 0] = k
        out_meta[i, 1] = length
        out_meta[i, 2] = m
        out_meta[i, 3] = ctx_len
