"""The one tile rule: how the scores of a tile of queries x keys become weights.

Every engine is a driver that chooses tiles and calls these: the reference and small
backends, the chunked backend, the fused backend's empty pieces and sinks, the weights'
rows engine and the backward of the reads, and ring attention's block math.

    Scoring.of(inputs)            the score modifiers (scale, softcap), in one record
    window(mask, ...)             the mask of a rows x keys window (tensor slice,
                                  structured keep: causal=True is masks.TOP_LEFT), or
                                  of pairs
    scores(q, k, scoring)         s = mod(scale * q k^T), grouped-query heads folded in
    pair_scores(q, k, scoring)    the same for chosen (query, key) pairs
    exclude(s, window)            -inf where a key is excluded, a float mask added
    values(p, v)                  p v, grouped-query heads folded in
    finish(s, sinks)              probabilities and the LSE: the edge convention below
    shift, marked, exponentiate,  probabilities from an LSE computed elsewhere (or the
    log_weights, sink_weight,     row max), normalised by each row's own sum, their
    weighted_scores, entropy_of,  logs, the sink's share, the entropy and KL of rows,
    kl_of, rebuild                a selection of keys (rebuild)
    top_keys(s, k)                torch.topk over the keys, in two stages
    merge(a, b), add_sinks(...)   partial (out, lse) over disjoint keys, exactly
    sink_grad(dout, out, lse, z)  the sinks' gradient from the output's
    no_keys(...)                  the result of rows that see no key

The edge convention, defined here and nowhere else (tests/test_rules.py holds every
engine to it):
- a row sees no key when every one of its scores is -inf (excluded by the mask or by
  causality, or -inf in a float mask): its weights and output are 0, its LSE 0 (torch's
  fused convention); sinks merge on top of that (LSE logaddexp(0, z));
- a NaN or +inf score (from q, k, or NaN / +inf in a float mask) makes its row NaN, as
  the listing's softmax does; a kernel marks such a row's LSE NaN or +inf (torch's CPU
  kernel, every release: +inf where the +inf key falls in one of AVX2's 8-wide vectors,
  NaN in the scalar tail or without AVX2), and an LSE read here reads both as NaN
  (`marked`);
- scale = 0 gives every visible key the same score: uniform weights.
Rows are normalised by their own sum of exponentials (the row max subtracted first, as
torch's softmax does), so a weight's error is that of its score, not eps x |lse|.

Shapes: q (B, H, n, E), k (B, Hkv, m, E), Hkv dividing H (query head h uses key head
h // (H // Hkv)); scores and weights (B, H, n, m); lse (B, H, n); masks broadcast to
(B, H, n, m); sinks (B, H, n) or (B, H, 1).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from sdpa import masks, settings
from sdpa.inputs import compute_dtype, empty, known

LOG2E = 1.0 / math.log(2.0)
_ZERO = {d: torch.zeros((), dtype=d) for d in (torch.float32, torch.float64)}  # baddbmm's C


class Scoring(NamedTuple):
    """What turns q . k into a score: s = softcap * tanh(scale * q.k / softcap), or
    scale * q.k without a softcap. A new score modifier is one more field here, applied
    in `scores` and differentiated in `raw_grad`."""

    scale: float
    softcap: float | None = None

    @classmethod
    def of(cls, inputs) -> Scoring:
        """The scoring of an `Inputs` record (or anything with .scale and .softcap)."""
        return cls(inputs.scale, inputs.softcap)


def _grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records work on these tensors (then nothing is done in place)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110 (a loop: cheaper than any() over a generator)
        if t is not None and t.requires_grad:
            return True
    return False


# -- the mask of a window ------------------------------------------------------------


def positions(index: slice | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """The positions (r,) that a slice (or a tensor of positions) picks among n."""
    if isinstance(index, torch.Tensor):
        return index
    if index == slice(None):  # every position: no slice.indices(n), which needs an int n
        return torch.arange(n, device=device)  # (a symbolic n stays symbolic under export)
    return torch.arange(*index.indices(n), device=device)


def cut(
    t: torch.Tensor, dim: int, index: slice | torch.Tensor, broadcast: bool = False
) -> torch.Tensor:
    """t's entries `index` along dim (a view for slices); with broadcast, a dim of size 1
    (a mask's broadcast dim) stays as it is."""
    if broadcast and t.shape[dim] == 1:
        return t
    if isinstance(index, slice):
        return t if index == slice(None) else t[(slice(None),) * dim + (index,)]
    return t.index_select(dim, index)


def window(
    mask: torch.Tensor | masks.Mask | masks.TensorAnd | None,
    L: int,
    S: int,
    rows: slice | torch.Tensor = slice(None),
    keys: slice | torch.Tensor = slice(None),
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """The mask of query rows `rows` over keys `keys` (slices, or tensors of positions
    among the L queries and S keys): (B|1, H|1, r, c) bool (True = takes part) or float
    (added), or None where nothing masks.

    mask: a tensor (B|1, H|1, L, S) (cut, a view where it can be), a structured mask
    (its keep for these positions, (Bm, 1, r, c)), both (masks.TensorAnd: causal=True
    is masks.TOP_LEFT), or None."""
    tensor, structured = masks.split(mask)
    out = None if tensor is None else cut(cut(tensor, 2, rows, True), 3, keys, True)
    if structured is not None:
        q_pos, k_pos = positions(rows, L, device), positions(keys, S, device)
        out = masks.combine(out, structured.keep(q_pos, k_pos, L, S)[:, None])  # (Bm, 1, r, c)
    return out


def window_pairs(
    mask: torch.Tensor | masks.Mask | masks.TensorAnd | None,
    L: int,
    S: int,
    qi: torch.Tensor,
    kj: torch.Tensor,
) -> torch.Tensor | None:
    """The mask at P (query, key) pairs, qi and kj (1|B, P) positions: (B'|1, H|1, P)
    bool or float (B' = the larger of the pairs' and the mask's batch), or None."""
    tensor, structured = masks.split(mask)
    out = None
    if tensor is not None:
        Bm = max(tensor.shape[0], qi.shape[0])
        b = torch.arange(Bm, device=qi.device)[:, None]
        out = tensor.expand(Bm, *tensor.shape[1:])[b, :, qi, kj].permute(0, 2, 1)  # (Bm, Hm, P)
    if structured is not None:
        if qi.shape[0] == 1:  # pairs shared by every batch element
            keep = structured.keep_pairs(qi[0], kj[0], L, S)  # (Bm, P)
        else:
            keep = torch.stack(
                [
                    structured.keep_pairs(qi[b], kj[b], L, S)[b if structured.batch else 0]
                    for b in range(qi.shape[0])
                ]
            )  # (B, P)
        out = masks.combine(out, keep[:, None])  # (B'|1, 1, P)
    return out


# The additive forms of the last few bool masks seen (a model's layers share one mask
# per forward): (data_ptr, on CPU, shape, strides, dtype) -> (the mask view, its version,
# the bias). The entry holds the mask, so no other tensor can take its memory while
# cached; a changed version (an in-place write) misses. Only masks whose storage is at
# most ADDITIVE_CACHE_BYTES are kept, at most ADDITIVE_CACHE_ENTRIES of them.
ADDITIVE_CACHE_ENTRIES = 4
ADDITIVE_CACHE_BYTES = 2**20
_additive_cache: dict[tuple, tuple[torch.Tensor, int, torch.Tensor]] = {}


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Keep-mask (bool) -> additive 0/-inf in `dtype`; float masks pass through.

    Converts only the distinct entries: broadcast (stride-0) dims stay broadcast, so a
    (B, 1, 1, S) key-padding mask costs O(B*S), not O(B*L*S). The same small mask
    (unchanged in place) is converted once (see ADDITIVE_CACHE_ENTRIES).
    """
    if mask is None or mask.dtype != torch.bool:
        return mask
    if (
        torch.compiler.is_compiling()
        or mask.is_inference()
        or mask.untyped_storage().nbytes() > ADDITIVE_CACHE_BYTES
    ):
        return _additive(mask, dtype)
    key = (mask.data_ptr(), mask.is_cpu, mask.shape, mask.stride(), dtype)
    hit = _additive_cache.get(key)
    if hit is not None and hit[1] == mask._version:
        return hit[2]
    bias = _additive(mask, dtype)
    if len(_additive_cache) >= ADDITIVE_CACHE_ENTRIES:
        del _additive_cache[next(iter(_additive_cache))]  # the oldest
    _additive_cache[key] = (mask, mask._version, bias)
    return bias


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    base = distinct(mask)
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    bias = torch.where(base, zero, zero - torch.inf)  # one pass, no inverted copy
    return bias.expand(mask.shape)


def causal_bias(L: int, S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The top-left causal mask (L, S) in additive form: 0 where query i sees key j
    (masks.visible), -inf elsewhere. Small ones are built once per (L, S, dtype, device)
    (a model's layers and steps share them); treat the result as read-only."""
    if L * S * 8 > ADDITIVE_CACHE_BYTES or torch.compiler.is_compiling():
        return _causal_bias(L, S, dtype, device)
    return _cached_causal_bias(L, S, dtype, device)


def _causal_bias(L, S, dtype, device) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(masks.top_left(L, S, device), zero, zero - torch.inf)  # (L, S)


@functools.lru_cache(maxsize=ADDITIVE_CACHE_ENTRIES)
def _cached_causal_bias(L, S, dtype, device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever the mode
        return _causal_bias(L, S, dtype, device)


def distinct(t: torch.Tensor) -> torch.Tensor:
    """The entries a broadcast view repeats: each stride-0 dim cut to size 1 (a view)."""
    sizes = [1 if known(st == 0) else n for n, st in zip(t.shape, t.stride(), strict=True)]
    return t.as_strided(sizes, t.stride())


def sees_no_key(window: torch.Tensor) -> torch.Tensor:
    """The rows (..., 1) of a window that see no key: a bool keep-mask with no True, or
    float scores / a float mask that is -inf everywhere. The one definition of a row
    that sees no key; read on the window's distinct entries (a broadcast key-padding
    mask costs O(B x S))."""
    base = distinct(window)
    if base.dtype == torch.bool:
        return base.any(dim=-1, keepdim=True).logical_not_()
    return torch.isneginf(base.amax(dim=-1, keepdim=True))


# -- scores --------------------------------------------------------------------------


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scoring: Scoring,
    out: torch.Tensor | None = None,
    minus: torch.Tensor | None = None,
) -> torch.Tensor:
    """s = softcap(scale * q k^T), (B, H, n, m) in the compute dtype (float32 for 16-bit
    inputs): q (B, H, n, E), k (B, Hkv, m, E), the query heads of a key head folded into
    rows (no copy of k). Differentiable; in place (and into `out`) without autograd.

    minus (B, H, n), without a softcap: s - minus per row, the shift added by the
    product itself (baddbmm's C: rounded once, after the product, as s - minus would
    be), saving a pass over the tile."""
    cd = compute_dtype(q.dtype)
    if q.dtype is not cd:
        q, k = q.to(cd), k.to(cd)
    B, H, n, E = q.shape
    Hkv, m = k.shape[1], k.shape[2]
    g = 1 if empty(Hkv) else H // Hkv
    cap = scoring.softcap
    alpha = scoring.scale if cap is None else scoring.scale / cap  # the cap's 1/c folded in
    folded = q.reshape(B * Hkv, g * n, E)  # (B*Hkv, g*n, E)
    kt = k.reshape(B * Hkv, m, E).mT  # (B*Hkv, E, m)
    grad = _grad(q, k)
    if alpha == 0:  # (BLAS may skip the product for alpha 0: keep inf * 0 = NaN)
        s = torch.bmm(folded, kt).mul_(0.0)
        if out is not None and not grad:
            s = out.view(B * Hkv, g * n, m).copy_(s)
    else:
        into = None if out is None or grad else out.view(B * Hkv, g * n, m)
        if minus is not None and cap is None:  # C = -minus, broadcast over the keys
            c = minus.to(cd).reshape(B * Hkv, g * n, 1).neg()
            s = torch.baddbmm(c, folded, kt, beta=1.0, alpha=alpha, out=into)
            return s.view(B, H, n, m)
        zero = _ZERO.get(cd) if q.is_cpu else None
        zero = q.new_zeros(()) if zero is None else zero
        s = torch.baddbmm(zero, folded, kt, beta=0.0, alpha=alpha, out=into)
    s = s.view(B, H, n, m)
    if cap is not None:
        s = torch.tanh(s) * cap if grad else s.tanh_().mul_(cap)
    if minus is not None:
        s = s - minus[..., None] if grad else s.sub_(minus[..., None])
    return s


def pair_scores(q: torch.Tensor, k: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    """The scores of P (query, key) pairs: q (B, H, P, E) against k (B, Hkv, P, E), pair
    p of query head h with its key head's pair p -> (B, H, P), as `scores` scores them."""
    cd = compute_dtype(q.dtype)
    B, H, P, E = q.shape
    Hkv = k.shape[1]
    raw = (q.to(cd).view(B, Hkv, H // Hkv, P, E) * k.to(cd)[:, :, None]).sum(-1)  # (B,Hkv,g,P)
    s = raw.view(B, H, P) * scoring.scale
    if scoring.softcap is not None:
        s = torch.tanh(s / scoring.softcap) * scoring.softcap
    return s


def values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p (B, H, n, m) @ v (B, Hkv, m, Ev) -> (B, H, n, Ev) in p's dtype, the query heads
    of a key head folded into rows (no copy of v)."""
    B, H, n, m = p.shape
    Hkv, Ev = v.shape[1], v.shape[3]
    if v.dtype is not p.dtype:
        v = v.to(p.dtype)
    if Hkv == H or empty(Hkv):
        return torch.matmul(p, v if v.shape[0] == B else v.expand(B, H, m, Ev))
    out = torch.matmul(p.reshape(B, Hkv, H // Hkv * n, m), v)  # (B, Hkv, g*n, Ev)
    return out.view(B, H, n, Ev)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    window: torch.Tensor | None,
    scoring: Scoring,
    sinks: torch.Tensor | None = None,
    *,
    lse: bool = True,
    every_row_sees_a_key: bool = False,
    from_key: int = 0,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One block of attention by the tile rule: scores, the window's mask, finish (the
    edge convention, sinks included), dropout on the weights, values. q (B, H, n, E), k
    (B, Hkv, m, E), v (B, Hkv, m, Ev) or None (the weights alone), window (B|1, H|1, n,
    m - from_key) or None: the mask of the keys from `from_key` on (the keys before it
    are all visible). Returns (out (B, H, n, Ev) in q's dtype or None, lse (B, H, n), or
    None with lse=False, p (B, H, n, m) in the compute dtype, before dropout).
    Differentiable; in place where nothing needs a gradient."""
    s = scores(q, k, scoring)  # (B, H, n, m)
    if from_key and window is not None and not _grad(s, window):
        exclude(s[..., from_key:], window)  # in place, on the view of the masked keys
    elif from_key and window is not None:
        s = torch.cat([s[..., :from_key], exclude(s[..., from_key:], window)], dim=-1)
    else:
        s = exclude(s, window)
    p, row_lse = finish(s, sinks, lse=lse, every_row_sees_a_key=every_row_sees_a_key)
    if v is None:
        return None, row_lse, p
    dropped = torch.nn.functional.dropout(p, dropout_p, training=True) if dropout_p > 0 else p
    out = values(dropped, v)
    return (out if out.dtype is q.dtype else out.to(q.dtype)), row_lse, p


def softmax_grad(
    p: torch.Tensor,
    pg: torch.Tensor,
    d: torch.Tensor | None = None,
    *,
    inplace: bool = False,
    factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax backward, the one place it is written: dS = PG - P D for weights p
    (..., n, m) and PG = P * G (G the gradient of the weights), D = sum_j PG (..., n, 1)
    unless given (an attention output's backward gives D = dO . O). factor (..., n, 1):
    PG is pg times this row factor (an upstream gradient), taken out of the sum: dS =
    factor (pg - P sum_j pg), one pass fewer. Returns (dS, D); inplace: into pg (then
    consumed). A sink in the row (value 0) gets -p_sink D."""
    if d is None:
        d = pg.sum(dim=-1, keepdim=True)  # (..., n, 1)
    ds = pg.addcmul_(p, d, value=-1.0) if inplace else torch.addcmul(pg, p, d, value=-1.0)
    if factor is None:
        return ds, d
    return ds.mul_(factor), d * factor


def chunk_rows(
    lead: int, S: int, dtype: torch.dtype, copies: int = 1, budget: int | None = None
) -> int:
    """Query rows per tile: `lead` (batch x heads) rows of S entries in `dtype`, `copies`
    such arrays live at once (scores, weights, a mask row), within the budget (the
    settings' chunk_bytes unless given). The one place a tile size is chosen."""
    budget = settings.get().chunk_bytes if budget is None else budget
    item = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    return max(1, budget // max(1, lead * S * item * copies))


def row_chunks(n: int, step: int) -> list[slice]:
    """The query rows 0..n in chunks of `step`: the row-chunk iterator every driver uses."""
    return [slice(r0, min(n, r0 + step)) for r0 in range(0, n, step)] or [slice(0, 0)]


def zero_dead(
    out: torch.Tensor, lse: torch.Tensor, dead: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's (out (..., n, Ev), lse (..., n)) with the edge convention applied to the
    rows `dead` (..., n, 1) marks as seeing no key: output 0 and LSE 0, whatever the
    kernel gave them (no host read)."""
    out = torch.where(dead, out.new_zeros(()), out)
    return out, torch.where(dead[..., 0], lse.new_zeros(()), lse)


def unsettled(lse: torch.Tensor, alive: torch.Tensor | None) -> torch.Tensor:
    """A part's LSE (B, H, n) as `merge` takes it: -inf for the rows that saw no key in
    it (alive (B|1, n) or (B|1, H|1, n|1) False: a kernel gives them 0, the convention's
    settled value)."""
    if alive is None:
        return lse
    return lse.masked_fill(~(alive[:, None] if alive.ndim < lse.ndim else alive), -torch.inf)


def raw_grad(ds: torch.Tensor, s: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    """dL/d(q.k) from dL/ds for scores s = scores(...): scale, through the softcap's
    tanh (ds/du = 1 - (s / c)^2). In place on ds."""
    if scoring.softcap is not None:
        ds.mul_(1.0 - (s / scoring.softcap).square_())
    return ds.mul_(scoring.scale)


def exclude(s: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """Scores with a window applied: -inf where a bool window excludes a key, a float
    window added. In place without autograd."""
    if window is None:
        return s
    grad = _grad(s, window)
    if window.dtype == torch.bool:
        return s.masked_fill(~window, -torch.inf) if grad else s.masked_fill_(~window, -torch.inf)
    return s + window if grad else s.add_(window)


# -- scores to probabilities ---------------------------------------------------------

# finish's CPU row-wise kernels by log: (with autograd, without autograd into out)
_ROW_KERNELS = {
    False: (torch.softmax, torch.ops.aten._softmax.out),
    True: (torch.log_softmax, torch.ops.aten._log_softmax.out),
}


def finish(
    s: torch.Tensor,
    sinks: torch.Tensor | None = None,
    *,
    lse: bool = True,
    log: bool = False,
    every_row_sees_a_key: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of scores s (B, H, n, m) and their LSE: (p, lse (B, H, n)), or
    (log p, lse) with log=True (-inf where a key is excluded). The edge convention of
    the module docstring. sinks (B, H, n|1): one more logit per row whose value is 0.

    lse=False (and no sinks), on CPU: torch's softmax (or log_softmax with log), then
    one host read of the sum of each row's first entry finds the rare rows to repair
    (it pays there: one reduction of one column, against a pass over the tile), skipped
    where the caller knows from the mask's type that every row sees a key
    (`every_row_sees_a_key`: no mask; then a NaN row is one the listing makes NaN too);
    elsewhere the path below, which reads nothing on the host. out: where that softmax
    writes (without autograd; s itself only where every row sees a key). A NaN row is
    NaN at every key.
    Otherwise the row max first, then exp, sum and log; in place without autograd.
    Differentiable in s and sinks; the LSE is returned detached."""
    grad = _grad(s, sinks)
    if empty(s.shape[-1]):  # no key at all: every row sees none
        row_lse = s.new_zeros(s.shape[:-1])
        if sinks is not None:
            row_lse = torch.logaddexp(row_lse, sinks.detach().expand_as(row_lse))
        return s, row_lse
    if not lse and sinks is None and s.is_cpu:
        eager, into = _ROW_KERNELS[log]
        # torch's row-wise kernel, into out: one pass where exp, sum, div take three
        p = eager(s, dim=-1) if out is None or grad else into(s, -1, False, out=out)
        if every_row_sees_a_key:
            return p, None
        # one host read (CPU only; cheaper than a pass to find them): the first column's
        # sum is NaN where a row sees no key or has a NaN score
        first = float((p.detach() if grad else p).select(-1, 0).sum())
        if first == first:
            return p, None
        odd = torch.isnan(p[..., :1])
        dead = odd & torch.isneginf(s.detach().amax(dim=-1, keepdim=True))
        fill = -torch.inf if log else 0.0
        if grad:  # softmax of a row of -inf has a NaN gradient: recompute it filled
            return eager(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, fill), None
        return p.masked_fill_(dead, fill), None
    top = s.detach().amax(dim=-1, keepdim=True)  # (B, H, n, 1): NaN / +inf rows stay so
    dead = torch.isneginf(top)
    top = top.masked_fill(dead, 0.0)
    shifted = s - top if grad else s.sub_(top)  # dead rows stay -inf
    e = torch.exp(shifted) if grad else shifted.exp_() if not log else torch.exp(shifted)
    total = e.sum(dim=-1, keepdim=True)  # (B, H, n, 1); 0 for a row that sees no key
    if sinks is not None:  # the sink's share of the denominator
        total = total + torch.exp(sinks[..., None] - top)
    with torch.no_grad():
        lse_keys = top + torch.log(total.detach())
        row_lse = lse_keys[..., 0].masked_fill(dead[..., 0], 0.0)  # (B, H, n)
        if sinks is not None:  # a row that sees no key: lse 0, then the sink on top
            z = sinks.detach().expand_as(row_lse)
            row_lse = torch.where(dead[..., 0], torch.logaddexp(torch.zeros_like(z), z), row_lse)
    total = total.masked_fill(dead & (total == 0), 1.0)  # 0 / 1 = 0 where no key is seen
    if log:
        return (shifted - torch.log(total) if grad else shifted.sub_(total.log_())), row_lse
    return (e / total if grad else e.div_(total)), row_lse


def shift(s: torch.Tensor, lse: torch.Tensor, *, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores shifted by a per-row constant c, in place: (t = s - c (B, H, n, m), c
    (B, H, n, 1)), so that p = exp(t) / sum_j exp(t) for any c. c is the LSE computed
    elsewhere (the fused kernel's: exp(t) is then p itself, up to the LSE's rounding),
    or with exact the row max (as torch's softmax subtracts it: where a float32 LSE has
    lost digits, |lse| past the settings' exact_lse_limit). A row that sees no key stays
    -inf; a NaN or +inf LSE (the kernel's marks of a NaN or +inf score) gives a NaN row.
    Not differentiable (the reads' backward is its own)."""
    if exact:
        c = s.amax(dim=-1, keepdim=True)  # (B, H, n, 1)
        c.masked_fill_(torch.isneginf(c), 0.0)
    else:
        c = marked(lse)[..., None]
    return s.sub_(c), c


def marked(lse: torch.Tensor) -> torch.Tensor:
    """An LSE (B, H, n) from elsewhere as the convention reads it: NaN for a row with a
    NaN or +inf score, which a kernel marks NaN or +inf (see the module docstring). No
    finite scores sum to +inf (the largest float32 score plus ln S stays finite), so +inf
    is only that mark; exp(s - inf) would read 0 at the row's finite scores, not NaN."""
    return lse.masked_fill(torch.isposinf(lse), torch.nan)


def normalizer(e: torch.Tensor, c: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Each row's sum of e = exp(s - c) (B, H, n, m), the sink's exp(z - c) included
    (sinks (B, H, n|1)): (B, H, n, 1); 1 where a row sees no key (its weights are then
    0 / 1 = 0)."""
    return settled(e.sum(dim=-1, keepdim=True), c, sinks)[0]


def settled(
    total: torch.Tensor, c: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows' normaliser, the sink's weight or None), each (B, H, n, 1), from the
    sum of e = exp(s - c) over every key of each row, total (B, H, n, 1) (added up over
    blocks of keys, say): the sink's exp(z - c) added (sinks (B, H, n|1)), 1 where the
    sum is 0 (a row that sees no key: its weights are then 0 / 1 = 0)."""
    z = None if sinks is None else torch.exp(sinks[..., None] - c)
    total = total if z is None else total + z
    total = total.masked_fill(total == 0, 1.0)
    return total, None if z is None else z / total


def exponentiate(
    shifted: torch.Tensor,
    c: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    keep: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e = exp(s - c) of shifted scores (B, H, n, m), in place unless keep (then into
    `out` when given: a buffer of their shape); the rows' normaliser (B, H, n, 1), see
    `normalizer`): p = e / total."""
    if keep:
        e = exp(shifted, out=torch.empty_like(shifted) if out is None else out)
    else:
        e = exp(shifted)
    return e, normalizer(e, c, sinks)


def exp(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """e^t of a tile, in place (into `out`, a buffer of t's shape, when given; t kept):
    the rows engine's one exponential. On CPU as 2^(t log2 e): torch.exp2 runs about
    3x faster than torch.exp there (torch 2.13, AVX-512: 0.17 s against 0.45-0.63 s over
    4 x 16384^2 floats), the product by log2 e a pass at memory speed. It adds an error
    of eps |t| e^t to each value (the rounding of t log2 e), at most 0.37 eps: below half
    an ulp of 1. Not differentiable."""
    if not t.is_cpu:
        return t.exp_() if out is None else torch.exp(t, out=out)
    return (t.mul_(LOG2E) if out is None else torch.mul(t, LOG2E, out=out)).exp2_()


def log_weights(shifted: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """log p = t - ln(total) of shifted scores t, in place: -inf where excluded."""
    return shifted.sub_(total.log())


def sink_weight(
    sinks: torch.Tensor | None, c: torch.Tensor, total: torch.Tensor
) -> torch.Tensor | None:
    """The sink's weight exp(z - c) / total of each row, (B, H, n), or None."""
    return None if sinks is None else (torch.exp(sinks[..., None] - c) / total)[..., 0]


def weighted_scores(e: torch.Tensor, shifted: torch.Tensor, excluded: bool) -> torch.Tensor:
    """sum_j e_j t_j per row, (B, H, n, 1), of shifted scores t (B, H, n, m) and e =
    exp(t): entropy_of's second sum. excluded: t may hold -inf (a mask, a row that sees
    no key; e = 0 there, 0 x -inf would be NaN): set to the lowest float first, in
    place. Consumes e. torch's sum, not a BLAS dot: a dot loses digits here."""
    if excluded:
        shifted.clamp_min_(torch.finfo(shifted.dtype).min)
    return e.mul_(shifted).sum(dim=-1, keepdim=True)


def entropy_of(
    total: torch.Tensor, weighted: torch.Tensor, p_sink: torch.Tensor | None = None
) -> torch.Tensor:
    """-sum_j p ln p per row over the keys, (...), from two sums of each row's shifted
    scores t = s - c and e = exp(t) (one pass over a tile, see `exponentiate` and
    `weighted_scores`): the normaliser T (...) and sum_j e_j t_j (...). With p = e / T
    and ln p = t - ln T,

        H = (sum_j e_j) ln T / T - (sum_j e_j t_j) / T,   sum_j e_j / T = 1 - p_sink

    (the keys' share of the row; 1 without sinks). 0 ln 0 = 0 (an excluded key, a row
    that sees no key: T = 1, e = 0); NaN rows stay NaN. Never negative but for
    rounding."""
    keys = total.log() if p_sink is None else total.log().mul_(1.0 - p_sink)
    return keys.sub_(weighted / total).add_(0.0)  # (+0, not -0)


def top_keys(s: torch.Tensor, k: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(s, k, dim=-1) of scores s (..., m): (values, indices), the largest
    first, in two stages where m is long against k: the maximum of each block of
    `block` keys, the k blocks with the largest maxima (every key of the top k lies in
    one of them: each block holding one has a maximum at least the k-th value, and at
    most k blocks do), then the top k of those blocks' keys and the tail's. About 3x
    faster than one topk over 16384 keys. Equal to torch.topk but where keys tie (a
    tie may take another index of the same value: the caller takes torch.topk where
    ties are expected, e.g. a mask's -inf keys)."""
    m = s.shape[-1]
    nb = m // block
    if nb <= 2 * k:
        return s.topk(k, dim=-1)
    lead = s.shape[:-1]
    blocks = s[..., : nb * block].unflatten(-1, (nb, block))  # (..., nb, block)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (..., k)
    cand = blocks.gather(-2, best[..., None].expand(*lead, k, block)).flatten(-2)  # (..., k*b)
    if nb * block < m:
        cand = torch.cat([cand, s[..., nb * block :]], dim=-1)  # the tail, always a candidate
    values, i = cand.topk(k, dim=-1)
    inside = i < k * block
    at = best.gather(-1, (i // block).clamp_max_(k - 1)) * block + i % block
    return values, torch.where(inside, at, i + (nb * block - k * block))


def rebuild(t: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Weights of a selection of keys from an LSE computed elsewhere: p = exp(s - lse),
    in place on the scores t (B, H, n, m) (a selection cannot be normalised by its own
    row sum); lse None: t already holds s - lse. A NaN or +inf LSE gives a NaN row
    (`marked`; with lse None the caller's, as rows.needs_every_key sends such rows whole)."""
    return exp(t if lse is None else t.sub_(marked(lse)[..., None]))


def kl_of(
    first: torch.Tensor, second: torch.Tensor, weights: torch.Tensor, whole_rows: bool = True
) -> torch.Tensor:
    """KL(Q || P) = sum_j q (log q - log p) per row, (B, H, n), from the log-weights
    first = log q and second = log p (B, H, n, m) and the weights q = exp(first); a key
    q gives 0 adds 0 (0 log 0 = 0), a key only p excludes +inf. Consumes `first`.
    A row with a NaN on either side is NaN. whole_rows: a NaN row of q or p is NaN at
    every key (as `finish` makes them): the 0 x -inf terms are then dropped by a
    NaN-skipping sum and NaN rows found from their first key; else (a dense target)
    each key where q = 0 is zeroed and NaN rows found from every key."""
    if whole_rows:
        nan = torch.isnan(weights[..., 0]) | torch.isnan(second[..., 0])
    else:
        nan = torch.isnan(weights).any(dim=-1) | torch.isnan(second).any(dim=-1)
    terms = first.sub_(second).mul_(weights)  # NaN where q = 0 and log q = -inf
    total = terms.nansum(dim=-1) if whole_rows else terms.masked_fill_(weights == 0, 0.0).sum(-1)
    return total.masked_fill_(nan, torch.nan)


def merge(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor | None,
    lse_b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint sets of keys, merged exactly: each is (out
    (..., n, Ev) normalised over its own keys, lse (..., n)); lse -inf marks a part with
    no key for that row (its out is ignored). out_b None is a part whose value is 0 (a
    sink). Returns (out, lse) over both: lse = logaddexp, out = sum of exp(lse_x - lse)
    out_x. The block plans' pieces, the sinks and the ring's shards all merge here;
    `settle` turns a row that saw no key anywhere (-inf) into the convention's 0."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * _share(lse_a, lse).to(out_a.dtype)
    if out_b is not None:
        out = out + out_b * _share(lse_b, lse).to(out_b.dtype)
    return out, lse


def _share(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse), (..., n, 1): 0 where the part saw no key (-inf, also when no
    part did: -inf - -inf), NaN where either is NaN."""
    share = torch.exp(lse_part - lse)
    return torch.where(torch.isneginf(lse_part), 0.0, share)[..., None]


def settle(lse: torch.Tensor) -> torch.Tensor:
    """An accumulated LSE with the convention's 0 where a row saw no key (-inf)."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sink logit z per row is a key with score z and value 0, merged on top of a
    kernel's (out, lse) (lse 0 for a row that sees no key: it stays 0 output with lse
    logaddexp(0, z), the convention)."""
    return merge(out, lse, None, sinks.expand_as(lse))


def sink_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """The gradient of sink logits z (B, H, n|1) from the upstream gradient dout
    (B, H, n, Ev) of an output out (B, H, n, Ev) whose lse (B, H, n) has the sinks
    merged in: a sink is a key of value 0, so d out_i / d z_i = -p_sink_i out_i and
    dz_i = -p_sink_i (dO_i . out_i), p_sink_i = exp(z_i - lse_i); summed over the rows
    for one logit per head. In out's dtype (0 from a row that sees no key: its out is 0)."""
    d = (dout.to(out.dtype) * out).sum(dim=-1)  # (B, H, n)
    g = -(torch.exp(sinks.to(out.dtype) - lse.to(out.dtype)) * d)
    return g.sum(dim=-1, keepdim=True) if sinks.shape[-1] == 1 else g


def no_keys(
    q: torch.Tensor, Ev: int, sinks: torch.Tensor | None, cd: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (..., n, Ev) zeros in q's dtype, lse (..., n)) of rows that see no key: lse
    0, then any sinks merged on top."""
    out = q.new_zeros(*q.shape[:-1], Ev)
    lse = q.new_zeros(q.shape[:-1], dtype=cd)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.detach().expand_as(lse))
    return out, lse
