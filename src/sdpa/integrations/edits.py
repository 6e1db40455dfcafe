"""Edits of attention patterns as fused calls.

Each edit is defined on the dense pattern P (B, H, L, S) (`dense`: what a
TransformerLens hook that rewrites the pattern computes, and the reference the tests
hold the fused form to, 1e-5) and runs as sdpa.attention calls without it (`fused`):

    ZeroAblate(heads)             head h's output is 0 (its pattern set to 0)
    MeanAblate(heads, reference)  head h's pattern is its mean over a reference batch
    KnockOut(queries, keys)       the queries never attend to the keys: -inf on those
                                  scores, so each row renormalises over the keys left
    ZeroPattern(queries, keys)    those entries of P set to 0, rows not renormalised
    ScaleHeads(scales)            P -> a_h P for head h (its output scales by a_h)
    PatchPattern(source)          the pattern of run A (source) with the values of run B
    FreezePattern(heads)          the pattern held constant in the backward (detached)

Three ways to use one:
- as a TransformerLens hook on a bridge on sdpa (`edit.hooks(layer)` gives the
  fwd_hooks entries; KnockOut goes on hook_attn_scores, the others on hook_pattern):
  the bridge's attention stays one fused call (on any other bridge, or on eager, the
  same hook edits the dense tensor);
- `edit.fused(q, k, v, mask, scale)` on a call's inputs (q (B, Hq, L, D), k / v
  (B, Hkv, S, D|Dv), mask in sdpa.attention's form) -> output (B, Hq, L, Dv): what an
  `edit(model, fn)` function returns (`edit.on_layers(...)` builds such a fn) and the
  route for nnsight (write it to the attention-interface call's output);
- `edit.dense(p)`: the edit on a materialised pattern.

Shapes: B batch, H (Hq) query heads, Hkv key/value heads (dividing Hq), L queries,
S keys. heads / queries / keys: an int, a list, a slice, a 1-D int tensor, or None for
all. Rows a knock-out leaves with no key get weights 0 here (on eager they go NaN, or
uniform over the masked keys in TransformerLens' default mode): leave each query a key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sdpa import masks
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.functional import AttentionResult, attention
from sdpa.integrations.deferred import Deferred, Where, with_edit
from sdpa.weights import AttentionWeights

Index = int | Sequence[int] | slice | torch.Tensor | None

__all__ = [
    "Edit",
    "KnockOut",
    "MeanAblate",
    "PatchPattern",
    "ScaleHeads",
    "Where",
    "ZeroAblate",
    "ZeroPattern",
]


def _select(index: Index, n: int, device: torch.device, name: str) -> torch.Tensor:
    """index as a (n,) bool tensor on device: which of n positions it chooses (worked
    out on the CPU: no device sync in a call)."""
    return _chosen(index, n, name).to(device)


def _positions(index: Index, n: int, device: torch.device, name: str) -> torch.Tensor:
    """The positions index chooses among n, (m,) int64 on device."""
    return _chosen(index, n, name).nonzero()[:, 0].to(device)


def _chosen(index: Index, n: int, name: str) -> torch.Tensor:
    chosen = torch.zeros(n, dtype=torch.bool)
    if index is None:
        return chosen.fill_(True)
    if isinstance(index, bool):
        raise SdpaTypeError(f"{name} must be an int, a list, a slice or an int tensor, got a bool")
    if isinstance(index, int | slice):
        chosen[index] = True
        return chosen
    t = torch.as_tensor(index, device="cpu")
    if t.dtype == torch.bool or t.is_floating_point() or t.ndim != 1:
        raise SdpaTypeError(
            f"{name} must be an int, a list, a slice or a 1-D int tensor, got "
            f"{tuple(t.shape)} {t.dtype}"
        )
    if t.numel() and not bool(((t >= -n) & (t < n)).all()):
        raise SdpaValueError(f"{name} {index!r} is out of range for {n} positions")
    chosen[t.long()] = True
    return chosen


def _kv_heads(t: torch.Tensor, Hq: int) -> torch.Tensor:
    """k or v (B, Hkv, S, D) with its heads repeated to Hq (query head h uses key head
    h // (Hq // Hkv))."""
    Hkv = t.shape[-3]
    return t if Hkv == Hq else t.repeat_interleave(Hq // Hkv, dim=-3)


def _by_head(chosen: torch.Tensor) -> torch.Tensor:
    return chosen[:, None, None]  # (H, 1, 1): broadcasts over (B, H, L, X)


class Edit:
    """A pattern edit; subclasses define dense and fused (see the module docstring).

    point: the TransformerLens hook it goes on ("hook_pattern" or "hook_attn_scores").
    Called as a hook, edit(tensor, hook=...): a dense tensor is edited densely; sdpa's
    LazyPattern / LazyScores gets the edit recorded and stays one fused call.
    """

    point = "hook_pattern"

    def dense(self, p: torch.Tensor, where: Where | None = None) -> torch.Tensor:
        """The edit on materialised values (B, H, L, S) (the pattern, or the scores for
        point "hook_attn_scores"). where: the positions of the values p holds when it
        holds a part (B', H', n, S) (a Where); None: p is the whole."""
        raise NotImplementedError

    def fused(self, q, k, v, mask=None, scale: float | None = None) -> torch.Tensor:
        """The edited attention output (B, Hq, L, Dv) of the call sdpa.attention(q, k, v,
        mask, scale=scale) would make, without its L x S pattern."""
        raise NotImplementedError

    def hooks(self, *layers: int) -> list[tuple[str, Edit]]:
        """TransformerLens fwd_hooks entries putting this edit on these layers."""
        return [(f"blocks.{layer}.attn.{self.point}", self) for layer in layers]

    def on_layers(self, *layers: int) -> Callable:
        """A function fn(info, q, k, v, mask) for an `edit(model, fn)` block: this edit's
        fused output for calls whose info.layer is in layers (all calls if none given),
        None (the call's own attention) elsewhere."""

        def fn(info, q, k, v, mask):
            layer = getattr(info, "layer", None)
            if layers and layer not in layers:
                return None
            return self.fused(q, k, v, mask, getattr(info, "scale", None))

        return fn

    def __call__(self, tensor: torch.Tensor, hook=None) -> torch.Tensor:
        if isinstance(tensor, Deferred):
            got = with_edit(tensor, self)
            if got is not None:
                return got
            tensor = tensor.full(None)
        squeeze = tensor.ndim == 3  # run_with_hooks(remove_batch_dim=True)
        out = self.dense(tensor[None] if squeeze else tensor)
        return out[0] if squeeze else out

    @staticmethod
    def _where(p: torch.Tensor, where: Where | None) -> Where:
        """The positions of p's values, on p's device."""
        if where is None:
            B, H, L = p.shape[:3]
            where = Where(torch.arange(B), torch.arange(H), torch.arange(L), B, H, L)
        d = p.device
        return where._replace(b=where.b.to(d), h=where.h.to(d), r=where.r.to(d))


class ZeroAblate(Edit):
    """Chosen heads output 0 (their pattern is all 0)."""

    def __init__(self, heads: Index) -> None:
        self.heads = heads

    def __repr__(self) -> str:
        return f"ZeroAblate(heads={self.heads!r})"

    def _chosen(self, H: int, device) -> torch.Tensor:
        return _select(self.heads, H, device, "heads")

    def dense(self, p, where=None):
        at = self._where(p, where)
        return p.masked_fill(_by_head(self._chosen(at.H, p.device)[at.h]), 0.0)

    def fused(self, q, k, v, mask=None, scale=None):
        out = attention(q, k, v, mask, scale=scale).output
        return out.masked_fill(_by_head(self._chosen(q.shape[-3], q.device)), 0.0)


class ScaleHeads(Edit):
    """P -> a_h P for each head h: scales (H,) (a tensor or a list), or {head: a}."""

    def __init__(self, scales: dict[int, float] | Sequence[float] | torch.Tensor) -> None:
        self.scales = scales

    def __repr__(self) -> str:
        return f"ScaleHeads({self.scales!r})"

    def _factors(self, H: int, device, dtype) -> torch.Tensor:
        if isinstance(self.scales, dict):
            a = torch.ones(H, device=device, dtype=dtype)
            for h, value in self.scales.items():
                a[h] = value
            return a
        a = torch.as_tensor(self.scales, device=device, dtype=dtype)
        if a.shape != (H,):
            raise SdpaValueError(f"scales must hold one factor per head, (H,) = ({H},), got "
                                 f"{tuple(a.shape)}")  # fmt: skip
        return a

    def dense(self, p, where=None):
        at = self._where(p, where)
        return p * self._factors(at.H, p.device, p.dtype)[at.h][:, None, None]

    def fused(self, q, k, v, mask=None, scale=None):
        out = attention(q, k, v, mask, scale=scale).output
        return out * self._factors(q.shape[-3], out.device, out.dtype)[:, None, None]


class KnockOut(Edit):
    """Chosen queries never attend to chosen keys (in chosen heads): -inf on those
    scores, so each such row renormalises over the keys it has left. Goes on
    hook_attn_scores (it edits the scores)."""

    point = "hook_attn_scores"

    def __init__(self, queries: Index, keys: Index, heads: Index = None) -> None:
        self.queries, self.keys, self.heads = queries, keys, heads

    def __repr__(self) -> str:
        return f"KnockOut(queries={self.queries!r}, keys={self.keys!r}, heads={self.heads!r})"

    def knocked(self, H: int, L: int, S: int, device, rows=None) -> torch.Tensor:
        """(H, n, S) bool: True where the edit drops a score, for rows (positions, or
        all L)."""
        qs = _select(self.queries, L, device, "queries")
        if rows is not None:
            qs = qs[rows.to(device)]
        ks = _select(self.keys, S, device, "keys")
        hs = _select(self.heads, H, device, "heads")
        return hs[:, None, None] & qs[None, :, None] & ks[None, None, :]

    def dense(self, scores, where=None):
        at = self._where(scores, where)
        knocked = self.knocked(at.H, at.L, scores.shape[-1], scores.device, at.r)
        return scores.masked_fill(knocked[at.h], -torch.inf)

    def fused(self, q, k, v, mask=None, scale=None):
        H, L, S = q.shape[-3], q.shape[-2], k.shape[-2]
        knocked = self.knocked(H, L, S, q.device)  # (H, L, S)
        return attention(q, k, v, _without(mask, knocked, L, S, q.device), scale=scale).output


class ZeroPattern(Edit):
    """Those entries of P (chosen queries x chosen keys, in chosen heads) set to 0,
    rows not renormalised: out_i -= sum over chosen keys j of P_ij v_j. O(L x |keys|)."""

    def __init__(self, queries: Index, keys: Index, heads: Index = None) -> None:
        self.queries, self.keys, self.heads = queries, keys, heads

    def __repr__(self) -> str:
        return f"ZeroPattern(queries={self.queries!r}, keys={self.keys!r}, heads={self.heads!r})"

    def dense(self, p, where=None):
        at = self._where(p, where)
        knocked = KnockOut(self.queries, self.keys, self.heads).knocked(
            at.H, at.L, p.shape[-1], p.device, at.r
        )
        return p.masked_fill(knocked[at.h], 0.0)

    def fused(self, q, k, v, mask=None, scale=None):
        H, L, S = q.shape[-3], q.shape[-2], k.shape[-2]
        keys = _positions(self.keys, S, q.device, "keys")  # (m,)
        rows = _select(self.queries, L, q.device, "queries")
        heads = _select(self.heads, H, q.device, "heads")
        out, w = attention(q, k, v, mask, scale=scale)
        if keys.numel() == 0:
            return out
        cols = w[..., keys]  # (B, H, L, m): the key columns, carrying their gradient
        cols = cols * (heads[:, None, None] & rows[None, :, None]).to(cols.dtype)
        v_keys = _kv_heads(v, H).index_select(-2, keys)  # (B, H, m, Dv)
        return out - (cols.to(v.dtype) @ v_keys)


class MeanAblate(Edit):
    """Chosen heads' pattern replaced by its mean over a reference batch.

    reference: the reference run's pattern of this layer, (Br, H, L, S): a LazyPattern
    from run_with_cache on a bridge on sdpa (fused: one sdpa call over the reference's
    q and k), or a dense tensor (then fused multiplies its mean by v densely).
    """

    def __init__(self, heads: Index, reference: torch.Tensor) -> None:
        self.heads, self.reference = heads, reference

    def __repr__(self) -> str:
        return f"MeanAblate(heads={self.heads!r}, reference={tuple(self.reference.shape)})"

    def _mean(self, where_h=None, where_r=None) -> torch.Tensor:
        ref = self.reference
        dense = ref.full(None) if hasattr(ref, "full") else ref
        mean = dense.mean(dim=0)  # (H, L, S)
        if where_h is not None:
            mean = mean[where_h.to(mean.device)]
        if where_r is not None:
            mean = mean[:, where_r.to(mean.device)]
        return mean

    def dense(self, p, where=None):
        at = self._where(p, where)
        chosen = _select(self.heads, at.H, p.device, "heads")[at.h]
        mean = self._mean(at.h, at.r).to(p.device, p.dtype)  # (H', n, S)
        return torch.where(_by_head(chosen), mean.expand_as(p), p)

    def fused(self, q, k, v, mask=None, scale=None):
        H = q.shape[-3]
        out = attention(q, k, v, mask, scale=scale).output
        heads = _positions(self.heads, H, q.device, "heads")
        if heads.numel() == 0:
            return out
        vh = _kv_heads(v, H).index_select(1, heads)  # (B, h, S, Dv)
        call = _call_of(self.reference)
        if call is None:  # a dense reference: its mean times v
            mean = self._mean(heads).to(vh.dtype)  # (h, L, S)
            ablated = mean[None] @ vh  # (B, h, L, Dv)
        else:
            ablated = _mean_pattern_times(call, heads, vh)
        return out.index_copy(1, heads, ablated.to(out.dtype))


class FreezePattern(Edit):
    """Chosen heads' pattern held constant in the backward (pattern.detach(), as
    attribution methods freeze attention): the forward is unchanged, gradients reach the
    values and nothing reaches q and k through those heads' patterns. Fused as
    attention(q.detach(), k.detach(), v), as sdpa.frozen() runs every call."""

    def __init__(self, heads: Index = None) -> None:
        self.heads = heads

    def __repr__(self) -> str:
        return f"FreezePattern(heads={self.heads!r})"

    def dense(self, p, where=None):
        at = self._where(p, where)
        chosen = _select(self.heads, at.H, p.device, "heads")[at.h]
        return torch.where(_by_head(chosen), p.detach(), p)

    def fused(self, q, k, v, mask=None, scale=None):
        H = q.shape[-3]
        chosen = _chosen(self.heads, H, "heads")  # (H,) on the CPU
        frozen = attention(q.detach(), k.detach(), v, _detached(mask), scale=scale).output
        if bool(chosen.all()):
            return frozen
        live = attention(q, k, v, mask, scale=scale).output
        return torch.where(_by_head(chosen.to(q.device)), frozen, live)


class PatchPattern(Edit):
    """The pattern of another run (source: that run's pattern of this layer, (B|1, H, L,
    S), a LazyPattern from a cache on sdpa or a dense tensor) with this run's values,
    for chosen heads."""

    def __init__(self, source: torch.Tensor, heads: Index = None) -> None:
        self.source, self.heads = source, heads

    def __repr__(self) -> str:
        return f"PatchPattern(source={tuple(self.source.shape)}, heads={self.heads!r})"

    def dense(self, p, where=None):
        at = self._where(p, where)
        src = self.source.full(None) if hasattr(self.source, "full") else self.source
        chosen = _select(self.heads, at.H, p.device, "heads")[at.h]
        src = src.to(p.device, p.dtype)
        b = at.b if src.shape[0] != 1 else torch.zeros_like(at.b)
        src = src[b][:, at.h][:, :, at.r]
        return torch.where(_by_head(chosen), src, p)

    def fused(self, q, k, v, mask=None, scale=None):
        H = q.shape[-3]
        out = attention(q, k, v, mask, scale=scale).output
        heads = _positions(self.heads, H, q.device, "heads")
        vh = _kv_heads(v, H).index_select(1, heads)
        call = _call_of(self.source)
        if call is None:
            src = self.source.to(vh.dtype).index_select(1, heads)  # (B|1, h, L, S)
            patched = src @ vh
        else:
            qs, ks = call.q.detach(), _kv_heads(call.k.detach(), call.q.shape[1])
            qs, ks = qs.index_select(1, heads), ks.index_select(1, heads)
            qs, ks = qs.to(vh.dtype), ks.to(vh.dtype)
            if qs.shape[0] != vh.shape[0]:
                qs = qs.expand(vh.shape[0], *qs.shape[1:])
                ks = ks.expand(vh.shape[0], *ks.shape[1:])
            patched = attention(
                qs, ks, vh, _heads_of_mask(call.mask, heads, H), scale=call.scale
            ).output
        return out.index_copy(1, heads, patched.to(out.dtype))


# ---- what an edit function may answer ----


def answer_of(got, query: torch.Tensor, value: torch.Tensor, where: str):
    """An `edit(model, fn)` function's answer for one call, as (output, weights or None):
    a tensor (B, H, L, Dv) in q's dtype, or an sdpa.AttentionResult of that output;
    anything else refused, naming `where` (the call). The one check the transformers and
    diffusers edits share."""
    result = isinstance(got, AttentionResult)
    out, weights = (got.output, got.weights) if result else (got, None)
    if not isinstance(out, torch.Tensor) or (result and not isinstance(weights, AttentionWeights)):
        raise SdpaTypeError(
            f"the edit function must return a tensor (B, H, L, Dv), an sdpa.AttentionResult "
            f"or None, got {type(got).__name__} for {where}"
        )
    want = (*query.shape[:-1], value.shape[-1])
    if tuple(out.shape) != want or out.dtype != query.dtype:
        raise SdpaValueError(
            f"the edit function returned {tuple(out.shape)} {out.dtype} for {where}; "
            f"the call needs (B, H, L, Dv) = {want} {query.dtype}"
        )
    return out, weights


# ---- helpers ----


def _call_of(pattern: object):
    """The sdpa call (q, k, mask, scale) of a LazyPattern, else None."""
    if isinstance(pattern, Deferred):
        node = pattern._node
        call = getattr(node, "call", None)
        if call is not None and call.q is not None and pattern._lead is None:
            return call
    return None


def _mean_pattern_times(call, heads: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """mean over the reference batch of P_ref[b, h] @ vh[c, h] for every batch element c
    of this run: one sdpa call, this run's batch folded into the value width.
    vh (B, h, S, Dv) -> (B, h, L, Dv)."""
    qr = call.q.detach().index_select(1, heads).to(vh.dtype)  # (Br, h, L, D)
    kr = _kv_heads(call.k.detach(), call.q.shape[1]).index_select(1, heads).to(vh.dtype)
    B, h, S, Dv = vh.shape
    Br, L = qr.shape[0], qr.shape[2]
    folded = vh.permute(1, 2, 0, 3).reshape(1, h, S, B * Dv).expand(Br, h, S, B * Dv)
    mask = _heads_of_mask(call.mask, heads, call.q.shape[1])
    got = attention(qr, kr, folded, mask, scale=call.scale).output  # (Br, h, L, B * Dv)
    return got.mean(dim=0).reshape(h, L, B, Dv).permute(2, 0, 1, 3)  # (B, h, L, Dv)


def _detached(mask: object) -> object:
    """mask with a float tensor (and sinks) detached: the frozen pattern's inputs."""
    if isinstance(mask, masks.ScoreMod):
        inner = _detached(mask.mask)
        out = inner if mask.softcap is None else masks.softcap(mask.softcap, inner)
        return out if mask.sinks is None else masks.sinks(mask.sinks.detach(), out)
    return mask.detach() if isinstance(mask, torch.Tensor) else mask


def _heads_of_mask(mask: object, heads: torch.Tensor, H: int) -> object:
    """mask restricted to chosen heads where it has a head dim of size H."""
    if isinstance(mask, masks.ScoreMod):
        if mask.sinks is not None:
            raise NotSupportedError("this edit does not take sinks (per-head logits) yet")
        inner = _heads_of_mask(mask.mask, heads, H)
        return masks.softcap(mask.softcap, inner) if mask.softcap is not None else inner
    if isinstance(mask, torch.Tensor) and mask.ndim >= 3 and mask.shape[-3] == H and H > 1:
        return mask.index_select(-3, heads.to(mask.device))
    return mask


def _without(mask: object, knocked: torch.Tensor, L: int, S: int, device) -> object:
    """mask with the knocked (H, L, S) scores removed too: a bool mask (B|1, H, L, S),
    or the float mask with -inf there."""
    if isinstance(mask, masks.ScoreMod):
        inner = _without(mask.mask, knocked, L, S, device)
        out = inner if mask.softcap is None else masks.softcap(mask.softcap, inner)
        return out if mask.sinks is None else masks.sinks(mask.sinks, out)
    if mask is None:
        return ~knocked
    if isinstance(mask, masks.Mask):
        mask = masks.as_4d(mask.materialize(L, S, device, max_bytes=None))
    if mask.dtype == torch.bool:
        return mask & ~knocked
    if not mask.is_floating_point():
        return (mask != 0) & ~knocked
    return mask.masked_fill(knocked, -torch.inf)
