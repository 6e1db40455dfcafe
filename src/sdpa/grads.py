"""Gradients through the reads of AttentionWeights, tile by tile, in O(tile) memory.

Every read R of the weights is a function of P = softmax(s), s = mod(scale q k^T) +
bias (sdpa.tile). Its backward, given the upstream gradient g of R, recomputes each
tile of complete rows (every key: the LSE of a row depends on all of them) from q, k
and the LSE, asks the read's rule for dS on that tile, and sends dS back through the
scores:

    dS_ij = P_ij (G_ij - D_i),  D_i = sum_j P_ij G_ij     (the softmax backward; a rule
                                                           gives PG = P * G)
    d(q . k) = raw_grad(dS) (scale, the softcap's tanh)   dq = d(q.k) K, dk = d(q.k)^T Q
    dmask = dS (a float mask is added after the softcap)   dsink_i = -p_sink_i D_i

The LSE's own dependence on q and k is inside dS (the -P D term). Nothing L x S is
stored: each tile is rebuilt, used and dropped. `read` wraps a read's forward (its
value from the providers, without autograd) and this backward into one autograd
Function; the settings in force at the forward are the ones its backward uses.
First order only: a double backward is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sdpa import rows, settings, tile
from sdpa.budget import release_freed
from sdpa.errors import NotSupportedError
from sdpa.inputs import Inputs


class Rule(NamedTuple):
    """How a read sends its upstream gradient into one tile's scores: grad(tile, g) ->
    (dS (nb, h, r, S), dsink (nb, h, r) or None), the tile a rows.TileRows of complete
    rows (its p, logp, p_sink, where); logp: whether grad reads the tile's logp."""

    grad: Callable[[rows.TileRows, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    logp: bool = False


def softmax_rule(
    pg_of: Callable[[rows.TileRows, torch.Tensor], torch.Tensor],
    logp: bool = False,
    factor_of: Callable[[rows.TileRows, torch.Tensor], torch.Tensor] | None = None,
) -> Rule:
    """The rule of a read that is a function of P alone, from PG = P * dR/dP on a tile:
    dS = PG - P D, D = sum_j PG, and the sink's dS = -p_sink D (consumes the tile's
    p). factor_of: PG is pg_of's times this (nb, h, r, 1) row factor (the upstream
    gradient of a per-row read), applied once to dS (tile.softmax_grad). logp: whether
    pg_of reads the tile's logp."""

    def rule(t: rows.TileRows, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        factor = None if factor_of is None else factor_of(t, g)
        ds, d = tile.softmax_grad(t.p, pg_of(t, g), inplace=True, factor=factor)
        return ds, None if t.p_sink is None else -t.p_sink * d[..., 0]

    return Rule(rule, logp)


def _rows_of(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
    """g at the tile's rows, (nb, h, r, 1): the row factor of a per-row read's PG."""
    return _place(g, t)[..., None]


def _minus_rows(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
    """-g at the tile's rows, (nb, h, r, 1)."""
    return -_place(g, t)[..., None]


class Needs(NamedTuple):
    """Which inputs want a gradient."""

    q: bool
    k: bool
    mask: bool
    sinks: bool


def backward(
    sel: rows.Rows, rule: Rule, needs: Needs, g: object
) -> tuple[torch.Tensor | None, ...]:
    """(dq (B, Hq, L, E), dk (B, Hkv, S, E), dmask (the mask's shape), dsinks (the
    sinks' shape)) of a read over the rows of `sel` (its keys: every key), tile by tile;
    None where not needed."""
    inputs = sel.inputs
    q_all, k_all = inputs.query, inputs.key
    cd = inputs.compute_dtype
    dq = torch.zeros(q_all.shape, dtype=cd, device=q_all.device) if needs.q else None
    dk = torch.zeros(k_all.shape, dtype=cd, device=k_all.device) if needs.k else None
    mask = inputs.tensor_mask
    dmask = torch.zeros(mask.shape, dtype=cd, device=mask.device) if needs.mask else None
    sinks = inputs.sinks
    dsinks = torch.zeros(sinks.shape, dtype=cd, device=sinks.device) if needs.sinks else None
    scoring = tile.Scoring.of(inputs)
    L = q_all.shape[2]
    group = inputs.group
    for tr in rows.each(sel._replace(keys=rows.ALL), both=rule.logp):
        t = tr.where
        q, k, raw = tr.q, tr.k, tr.raw  # (raw: read only under a softcap, where p is apart)
        ds, dsink = rule.grad(tr, g)
        hs = slice(t.heads.start, t.heads.stop, t.heads.step)
        if dmask is not None:
            _add_mask_grad(dmask, ds, t, hs, L)
        if dsinks is not None and dsink is not None:
            _add_sink_grad(dsinks, dsink, t, hs)
        if dq is None and dk is None:
            continue
        draw = tile.raw_grad(ds, raw, scoring)  # d(q . k): (nb, h, r, S)
        nb, h, r = draw.shape[:3]
        kv = k.shape[1]
        folded = draw.reshape(nb, kv, (h // kv) * r, draw.shape[-1])  # query heads into rows
        if dq is not None:
            part = torch.matmul(folded, k.to(cd)).view(nb, h, r, -1)  # (nb, h, r, E)
            rows_of = dq[t.b, hs]
            if isinstance(t.q_rows, slice):
                rows_of[:, :, t.q_rows] += part
            else:
                rows_of.index_add_(2, t.q_rows, part)
        if dk is not None:
            qf = q.to(cd).reshape(nb, kv, (h // kv) * r, -1)
            kv0 = t.heads.start // group
            _add_product(dk[t.b, kv0 : kv0 + kv, t.keys], folded.mT, qf)  # (nb, kv, S, E)
    return dq, dk, dmask, dsinks


def _add_product(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """into += a @ b, batched (nb, n, r, c): in place where `into` is contiguous; else one
    batched product, then one add (a strided `baddbmm_` runs one small GEMM per batch
    entry, each a parallel region: 12 a tile, 40x slower each on a busy machine)."""
    if into.is_contiguous():
        into.view(-1, *into.shape[-2:]).baddbmm_(a.flatten(0, 1), b.flatten(0, 1))
    else:
        into.add_(torch.matmul(a, b))


def _add_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, t: rows.Tile, hs: slice, L: int):
    """dmask[b, heads, rows] += dS, summed over the mask's broadcast dims."""
    part = ds
    if dmask.shape[0] > 1:
        b = t.b
    else:
        b, part = slice(0, 1), part.sum(dim=0, keepdim=True)  # (a tile of several elements)
    if dmask.shape[1] == 1:
        part = part.sum(dim=1, keepdim=True)
        heads = slice(0, 1)
    else:
        heads = hs
    if dmask.shape[3] == 1:
        part = part.sum(dim=3, keepdim=True)
    target = dmask[b, heads]
    if dmask.shape[3] != 1 and t.keys != rows.ALL:
        target = target[..., t.keys]  # (the tile's key span)
    if dmask.shape[2] == 1:
        target.add_(part.sum(dim=2, keepdim=True))
    elif isinstance(t.q_rows, slice):
        target[:, :, t.q_rows].add_(part)
    else:
        target.index_add_(2, t.q_rows, part)


def _add_sink_grad(dsinks: torch.Tensor, dsink: torch.Tensor, t: rows.Tile, hs: slice):
    """dsinks (B, Hq, L|1) [b, heads, rows] += dsink (nb, h, r)."""
    target = dsinks[t.b, hs]
    if dsinks.shape[-1] == 1:
        target.add_(dsink.sum(dim=-1, keepdim=True))
    elif isinstance(t.q_rows, slice):
        target[:, :, t.q_rows].add_(dsink)
    else:
        target.index_add_(2, t.q_rows, dsink)


def needs(inputs: Inputs) -> Needs | None:
    """Which of q, k, a float mask and the sinks want gradients of a read now, or None
    (grad mode off, or none requires grad): decided in O(1)."""
    if not torch.is_grad_enabled():
        return None
    mask, sinks = inputs.tensor_mask, inputs.sinks
    if not (
        inputs.query.requires_grad
        or inputs.key.requires_grad
        or (mask is not None and mask.requires_grad)
        or (sinks is not None and sinks.requires_grad)
    ):
        return None
    n = Needs(
        inputs.query.requires_grad,
        inputs.key.requires_grad,
        mask is not None and mask.requires_grad,
        inputs.sinks is not None and inputs.sinks.requires_grad,
    )
    return n if any(n) else None


class Side(NamedTuple):
    """One attention whose weights a read depends on: the rows the read reads (its
    inputs and LSE; the backward reads every key of them), its rule and what needs
    grads."""

    selection: rows.Rows
    rule: Rule
    needs: Needs


# A tensor the read also depends on (rmatmul's u, a dense KL target): (tensor, its
# gradient from the upstream one), run after the sides' backward.
Extra = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


class Versions(NamedTuple):
    """The version counters of the tensors a backward recomputes from, taken at the read,
    and torch's check of them at the backward: a change made in place in between raises
    torch's own error ("modified by an inplace operation"), as the listing's autograd
    does, at no copy. Kept apart from save_for_backward: saved-tensor hooks
    (checkpointing counts them, offloading moves them) see only what the autograd graph
    itself saves, and a read made once inside a checkpointed forward (a capture's
    statistic) is not made again in its recomputation."""

    tensors: tuple[torch.Tensor, ...]
    numbers: tuple[int, ...]

    @classmethod
    def of(cls, tensors: list[torch.Tensor | None]) -> Versions:
        kept = tuple(t for t in tensors if isinstance(t, torch.Tensor) and not t.is_inference())
        return cls(kept, tuple(t._version for t in kept))

    def check(self) -> None:
        for t, n in zip(self.tensors, self.numbers, strict=True):
            if t._version != n:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                    f"{t._version}; expected version {n} instead. (sdpa: a read of "
                    f"AttentionWeights recomputes its gradient from q, k, the mask and the "
                    f"sinks: call backward() before changing them in place)"
                )


class _Read(torch.autograd.Function):
    """value() without autograd; backward: each side's tile-by-tile backward with its
    rule, then each extra tensor's gradient, after the check that every tensor it
    recomputes from (each side's q, k, mask and sinks, the watched ones) is as it was at
    the read (Versions)."""

    @staticmethod
    def forward(ctx, value, sides, extras, watched, *tensors):
        ctx.sides, ctx.extras, ctx.watched = sides, extras, watched
        ctx.versions = Versions.of(list(tensors))
        ctx.tuning = settings.get()  # autograd's threads do not see the caller's context
        return value()

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            raise NotSupportedError(
                "a double backward through a read of AttentionWeights (create_graph=True): "
                "the reads' gradients are first order only; differentiate the listing's "
                "math (sdpa.listing.attention) for higher orders"
            )
        ctx.versions.check()
        release_freed()  # (chunked reads' backwards: each one's pages given back first)
        out: list[torch.Tensor | None] = [None, None, None, None]
        with settings.using(ctx.tuning):
            for side in ctx.sides:
                dq, dk, dmask, dsinks = backward(side.selection, side.rule, side.needs, g)
                out += [dq, dk, dmask, dsinks]
            out += [grad_of(g) for _, grad_of in ctx.extras]
        return (*out, *(None,) * ctx.watched)


class _Watch(torch.autograd.Function):
    """x unchanged; its backward passes the gradient through after the check that the
    watched tensors were not changed in place since the forward (Versions)."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.versions, ctx.n = Versions.of(list(tensors)), len(tensors)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.versions.check()
        return (g, *(None,) * ctx.n)


class _Kept(torch.autograd.Function):
    """Weights p that a backend kept, as a graph of their own: the forward hands out p
    (no product again); the backward computes p afresh with autograd (`again()`, from
    q, k, the mask and the sinks as they were at the read: Versions) and differentiates
    it. Each read so has its own backward, as a read of weights computed afresh has, at
    one product in the backward instead of one in the forward (a checkpoint)."""

    @staticmethod
    def forward(ctx, p, again, copy, *tensors):
        ctx.again, ctx.tensors, ctx.versions = again, tensors, Versions.of(tensors)
        return p.clone() if copy else p.view_as(p)

    @staticmethod
    def backward(ctx, g):
        ctx.versions.check()
        higher = torch.is_grad_enabled()  # (create_graph=True: the recomputation's graph)
        # each tensor once: where q is k (a self-relation, attention(x, x, x)) the
        # gradient of p with respect to it is already the whole one; handed out for both
        # slots, autograd would add it twice
        wanted = list({id(t): t for t in ctx.tensors if t is not None and t.requires_grad}.values())
        with torch.enable_grad():
            p = ctx.again()
        found = dict(
            zip(
                map(id, wanted),
                torch.autograd.grad(p, wanted, g, allow_unused=True, create_graph=higher),
                strict=True,
            )
        )
        dts = [None if t is None else found.pop(id(t), None) for t in ctx.tensors]
        return (None, None, None, *dts)


def kept(
    p: torch.Tensor, again: Callable[[], torch.Tensor], inputs: Inputs, copy: bool = False
) -> torch.Tensor:
    """p (the weights a backend kept, values only) carrying the gradient of `again()`
    (the same weights computed with autograd) to q, k, a float mask and the sinks: a
    view of p, or with copy a tensor of its own (one node, where a clone after it would
    add a second)."""
    return _Kept.apply(p.detach(), again, copy, *watched(inputs))


def watch(x: torch.Tensor, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """x, whose backward raises torch's "modified by an inplace operation" if any of
    `tensors` changed in place after this call (those autograd does not save itself)."""
    return _Watch.apply(x, *tensors)


def watched(inputs: Inputs) -> list[torch.Tensor | None]:
    """The tensors a read's backward recomputes from: q, k, a tensor mask, the sinks."""
    return [inputs.query, inputs.key, inputs.tensor_mask, inputs.sinks]


def read_sides(
    value: Callable[[], torch.Tensor],
    sides: list[Side],
    extras: list[Extra] = (),
    watch: list[torch.Tensor | None] = (),
) -> torch.Tensor:
    """A read's value (computed without autograd), carrying its gradient to each side's
    q, k, float mask and sinks, and to the extra tensors. watch: tensors the backward
    reads without differentiating them (a KL teacher's q and k, a dense target),
    checked for in-place changes as the sides' are."""
    tensors = [t for side in sides for t in watched(side.selection.inputs)]
    tensors += [t for t, _ in extras]
    watch = list(watch)
    return _Read.apply(value, tuple(sides), tuple(extras), len(watch), *tensors, *watch)


class Spec(NamedTuple):
    """A read of one attention's weights (see Side) and how to compute its value."""

    selection: rows.Rows
    rule: Rule
    needs: Needs
    value: Callable[[], torch.Tensor]


def read(spec: Spec) -> torch.Tensor:
    """The read's value, carrying its gradient to q, k, a float mask and the sinks."""
    side = Side(spec.selection, spec.rule, spec.needs)
    return read_sides(spec.value, [side])


# -- rules ---------------------------------------------------------------------------


def _zero_nan(terms: torch.Tensor) -> torch.Tensor:
    """P x (terms in log P) with the 0 x -inf of keys where P = 0 set to 0, in place."""
    return terms.nan_to_num_(nan=0.0, posinf=torch.inf, neginf=-torch.inf)


def _place(g: torch.Tensor, t: rows.TileRows) -> torch.Tensor:
    """The tile's slice of an upstream gradient laid out (B', H', n, ...)."""
    w = t.where
    return g[w.at_b, w.at_h, w.at_r]


def _on_keys(pg: torch.Tensor, t: rows.TileRows) -> torch.Tensor:
    """The tile's key span (rows.Tile.keys) of a tensor laid out over every key (..., S)."""
    keys = t.where.keys
    return pg if keys == rows.ALL else pg[..., keys]


def rows_rule(keys: slice | torch.Tensor) -> Rule:
    """Dense rows (full(), indexing): R = P[rows][:, keys]; G = g at those keys."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        gt = _place(g, t)  # (nb, h, r, m)
        if isinstance(keys, slice) and keys == rows.ALL:
            return t.p * _on_keys(gt, t)
        out = t.p.new_zeros(*t.p.shape[:-1], t.S)  # (over every key, then the tile's)
        if isinstance(keys, slice):
            out[..., keys] = gt
        else:
            out.index_add_(-1, keys, gt)  # (repeated keys add up, as indexing's backward)
        return _on_keys(out, t).mul_(t.p)

    return softmax_rule(pg)


def key_sums_rule(scale: float = 1.0) -> Rule:
    """sum(dim=-2) (mean: scale 1 / L): R_j = sum_i P_ij; G_ij = g_j."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        w = t.where
        return t.p * (_on_keys(g[w.at_b, w.at_h], t)[:, :, None, :] * scale)

    return softmax_rule(pg)


def entropy_rule() -> Rule:
    """entropy(): R_i = -sum_j P log P; PG = -g_i (P log P + P), 0 where P = 0."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        plogp = _zero_nan(t.logp.mul_(t.p))  # 0 x -inf -> 0 where P = 0
        return plogp.add_(t.p)  # (times -g: the rule's row factor)

    return softmax_rule(pg, logp=True, factor_of=_minus_rows)


def amax_rule(_value: object = None) -> Rule:
    """amax(): R_i = max_j P_ij, the gradient split evenly between tied maxima (as
    torch.amax's backward splits it); the maxima found on the tile itself."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        at_top = t.p == t.p.amax(dim=-1, keepdim=True)
        share = _place(g, t)[..., None] / at_top.sum(dim=-1, keepdim=True)
        return torch.where(at_top & (t.p > 0), t.p * share, 0.0)

    return softmax_rule(pg)


def topk_rule(indices: torch.Tensor) -> Rule:
    """topk(k) values: R_ir = P[i, idx_ir]; G at those keys."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(t.p)
        keys, gt = _place(indices, t), _place(g, t)
        if t.where.keys != rows.ALL:  # into the span; keys outside it have weight 0
            keys = keys - t.where.keys.start
            outside = (keys < 0) | (keys >= out.shape[-1])
            keys, gt = keys.masked_fill(outside, 0), gt.masked_fill(outside, 0.0)
        out.scatter_add_(-1, keys, gt)
        return out.mul_(t.p)

    return softmax_rule(pg)


def lse_rule() -> Rule:
    """lse: dlse_i/ds_ij = P_ij, dlse_i/dz_i = p_sink_i (not a function of P alone)."""

    def rule(t: rows.TileRows, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gt = _place(g, t)  # (nb, h, r)
        return t.p * gt[..., None], None if t.p_sink is None else t.p_sink * gt

    return Rule(rule)


def pairs_rule(qi: torch.Tensor, kj: torch.Tensor, S: int) -> Rule:
    """pairs(qi, kj): R_p = P[qi_p, kj_p] (qi, kj (1|B, P)); G at those pairs (repeated
    pairs add up)."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        w = t.where
        r0, r1 = w.q_rows.start, w.q_rows.stop  # (every-row selections: a slice)
        k0, k1 = (0, S) if w.keys == rows.ALL else (w.keys.start, w.keys.stop)
        m = k1 - k0
        nb, h = t.p.shape[:2]
        out = torch.zeros(nb, h, t.p.shape[2] * m, dtype=t.p.dtype, device=t.p.device)
        for j, b in enumerate(w.elements):
            e = b if qi.shape[0] > 1 else 0
            inside = (qi[e] >= r0) & (qi[e] < r1) & (kj[e] >= k0) & (kj[e] < k1)  # (others: 0)
            flat = (qi[e][inside] - r0) * m + kj[e][inside] - k0
            gt = g[w.at_b.start + j, w.at_h][..., inside]  # (h, P')
            out[j].index_add_(-1, flat, gt.to(t.p.dtype))
        return out.view(t.p.shape).mul_(t.p)

    return softmax_rule(pg)


def kl_rule(other: Callable[[int, bool], rows.Source | rows.DenseSource], weighs: bool) -> Rule:
    """The gradient of a KL into one side's scores, the other side's tiles read from a
    source other(budget, both) (made once per backward, for its tiles). The side that
    weighs the sum (Q of KL(Q || P)): dKL/dQ = log Q - log P + 1, so PG = g Q (log Q -
    log P + 1) (0 where Q = 0). The side inside the log: dKL/dP = -Q / P, so PG = -g Q.
    The softmax backward (sinks included) does the rest."""
    opened: list[rows.Source | rows.DenseSource] = []

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        if not opened:
            opened.append(other(settings.get().chunk_bytes, False))  # (one read per tile)
        theirs = opened[0].tile(t.where)
        if weighs:  # (log P - log Q + 1) P, 0 where P = 0 (0 x -inf); times g
            return _zero_nan(t.logp.sub_(theirs.logp).add_(1.0).mul_(t.p))
        # Q, times -g; a dense tile is the caller's tensor: not in place
        return theirs.p.clone() if isinstance(theirs, rows.DenseTile) else theirs.p

    return softmax_rule(pg, logp=weighs, factor_of=_rows_of if weighs else _minus_rows)


def score_errors_rule(mine: rows.Rows, other: rows.Rows) -> Rule:
    """sum_j (s_ij - s'_ij)^2 per row (rows.score_errors) into this side's scores s: dS =
    2 g (s - s') where this side sees the key, 0 where its mask excludes it (its visible
    score is the constant 0 there). Not a function of P: no softmax backward, no sink."""

    def rule(t: rows.TileRows, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        s, excluded = rows.visible_scores(mine, t.where)
        ds = s.sub_(rows.visible_scores(other, t.where)[0].to(s.dtype)).masked_fill_(excluded, 0.0)
        return ds.mul_(_place(g, t)[..., None].to(ds.dtype)).mul_(2.0), None

    return Rule(rule)


def weighted_rows_rule(u: torch.Tensor) -> Rule:
    """u @ w: R_fj = sum_i u_fi P_ij (u (B, H, F, L)); G_ij = sum_f u_fi g_fj."""

    def pg(t: rows.TileRows, g: torch.Tensor) -> torch.Tensor:
        w = t.where
        ut = u[w.at_b, w.at_h][..., w.at_r].to(t.p.dtype)  # (nb, h, F, r)
        gt = _on_keys(g[w.at_b, w.at_h], t).to(t.p.dtype)  # (nb, h, F, S)
        return torch.matmul(ut.mT, gt).mul_(t.p)

    return softmax_rule(pg)
