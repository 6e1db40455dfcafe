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
    Compose(e1, e2, ...)          the edits one after another (e2 edits what e1 left)

Three ways to use one:
- as a TransformerLens hook on a bridge on sdpa (`edit.hooks(layer)` gives the
  fwd_hooks entries; KnockOut goes on hook_attn_scores, the others on hook_pattern):
  the bridge's attention stays one fused call (on any other bridge, or on eager, the
  same hook edits the dense tensor);
- `edit.fused(q, k, v, mask, scale)` on a call's inputs (q (B, Hq, L, D), k / v
  (B, Hkv, S, D|Dv), mask in sdpa.attention's form) -> output (B, Hq, L, Dv): what an
  `edit(model, fn)` function returns (`edit.on_layers(...)` and `edit.on_modules(...)`
  build such a fn) and the route for nnsight (write it to the attention-interface call's
  output);
- `edit.dense(p)`: the edit on a materialised pattern.

Shapes: B batch, H (Hq) query heads, Hkv key/value heads (dividing Hq), L queries,
S keys. heads / queries / keys: an int, a list, a slice, a 1-D int tensor, or None for
all. Rows a knock-out leaves with no key get weights 0 here (on eager they go NaN, or
uniform over the masked keys in TransformerLens' default mode): leave each query a key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

from sdpa import masks
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.functional import AttentionResult, attention
from sdpa.integrations.deferred import Deferred, Where, with_edit
from sdpa.weights import HANDLES

Index = int | Sequence[int] | slice | torch.Tensor | None

__all__ = [
    "Compose",
    "Edit",
    "FreezePattern",
    "KnockOut",
    "Layout",
    "MeanAblate",
    "PatchPattern",
    "ScaleHeads",
    "Site",
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

    def on_weights(self, w: torch.Tensor) -> torch.Tensor | None:
        """The edited pattern as a lazy tensor of the weights w (B, H, L, S) (a lazy
        expression: every read of it reads w's rows), or None where the edit has none
        (then a cached edited pattern reads replayed rows: entries zeroed per query and
        key, a dense source or mean)."""
        return None

    def hooks(self, *layers: int) -> list[tuple[str, Edit]]:
        """TransformerLens fwd_hooks entries putting this edit on these layers."""
        return [(f"blocks.{layer}.attn.{self.point}", self) for layer in layers]

    def on_layers(
        self, *layers: int, stack: str | None = None, kind: str | None = None
    ) -> Callable:
        """A function fn(info, q, k, v, mask) for an `edit(model, fn)` block: this edit's
        fused output for the calls chosen, None (the call's own attention) elsewhere.

        layers: info.layer values (module.layer_idx; all layers if none given). stack: a
        run of the stack's dotted name ("decoder" for "model.decoder.layers"); kind:
        "self" or "cross". A model with one attention stack needs neither. Where layer
        numbers repeat, in an encoder-decoder or with self- and cross-attention in one
        block, layers must come with a stack and kind that name one of them (else the
        first call raises, naming the calls the layers would match); without layers,
        every call of the stacks named (every call of the model if none)."""
        _check_layers(layers, stack, kind)
        return _Selected(self, f"{self!r}.on_layers({_args(layers, stack, kind)})",
                         layers=layers, stack=stack, kind=kind)  # fmt: skip

    def on_modules(self, *paths: str) -> Callable:
        """A function fn(info, q, k, v, mask) for an `edit(model, fn)` block: this edit's
        fused output for the calls of the attention modules at these paths (qualified
        names in the model given to edit, "model.decoder.layers.1.self_attn"; a path of a
        block chooses the attention modules inside it), None elsewhere. The first call
        raises where a path names no attention module of the model."""
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise SdpaTypeError(
                f"on_modules takes one or more module paths, such as "
                f"'model.decoder.layers.1.self_attn', got {paths!r}"
            )
        return _Selected(self, f"{self!r}.on_modules({', '.join(map(repr, paths))})",
                         paths=paths)  # fmt: skip

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

    def on_weights(self, w):
        return w.masked_fill(_by_head(self._chosen(w.shape[-3], w.device)), 0.0)


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

    def on_weights(self, w):
        return w * self._factors(w.shape[-3], w.device, w.dtype)[:, None, None]


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
        out = attention(q, k, v, mask, scale=scale).output
        heads = _positions(self.heads, q.shape[-3], q.device, "heads")
        if heads.numel() == 0:
            return out
        return out.index_copy(1, heads, self._replaced(q, k, v, heads).to(out.dtype))

    def _replaced(self, q, k, v, heads: torch.Tensor, detach: bool = False) -> torch.Tensor:
        """The chosen heads' output with the mean pattern, (B, h, L, Dv) for heads (h,)
        (detach: the mean held constant in the backward)."""
        vh = _kv_heads(v, q.shape[-3]).index_select(1, heads)  # (B, h, S, Dv)
        call = _call_of(self.reference)
        if call is not None:  # a LazyPattern: one sdpa call over the reference (detached)
            return _mean_pattern_times(call, heads, vh)
        mean = self._mean(heads).to(vh.dtype)  # (h, L, S): a dense reference's mean
        return (mean.detach() if detach else mean)[None] @ vh  # (B, h, L, Dv)


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
        out = attention(q, k, v, mask, scale=scale).output
        heads = _positions(self.heads, q.shape[-3], q.device, "heads")
        return out.index_copy(1, heads, self._replaced(q, k, v, heads).to(out.dtype))

    def _replaced(self, q, k, v, heads: torch.Tensor, detach: bool = False) -> torch.Tensor:
        """The chosen heads' output with the source pattern, (B, h, L, Dv) for heads (h,)
        (detach: the source held constant in the backward)."""
        H = q.shape[-3]
        vh = _kv_heads(v, H).index_select(1, heads)  # (B, h, S, Dv)
        call = _call_of(self.source)
        if call is None:
            src = self.source.to(vh.dtype).index_select(1, heads)  # (B|1, h, L, S)
            return (src.detach() if detach else src) @ vh
        qs, ks = call.q.detach(), _kv_heads(call.k.detach(), call.q.shape[1])
        qs, ks = qs.index_select(1, heads), ks.index_select(1, heads)
        qs, ks = qs.to(vh.dtype), ks.to(vh.dtype)
        if qs.shape[0] != vh.shape[0]:
            qs = qs.expand(vh.shape[0], *qs.shape[1:])
            ks = ks.expand(vh.shape[0], *ks.shape[1:])
        return attention(qs, ks, vh, _heads_of_mask(call.mask, heads, H), scale=call.scale).output


class Compose(Edit):
    """Edits one after another, each on the pattern the one before left (as hooks on one
    TransformerLens point run in order): dense(p) = e_n.dense(... e_1.dense(p)).

    KnockOuts edit the scores, before the softmax, so they come first (a knock-out after
    a pattern edit is refused). With both kinds it is two steps, `.scores` before the
    softmax and `.pattern` after it (`hooks` gives an entry for each). fused: one
    sdpa.attention call for the whole chain (a second where some heads are frozen and
    others not; those of MeanAblate / PatchPattern where their heads are replaced), the
    zeroed entries read as O(L x |keys|) columns, as each edit alone computes them. A
    chain the fused form does not cover (an Edit subclass of your own, entries zeroed
    in a replaced pattern) runs on the dense pattern within sdpa's memory budget.
    """

    def __init__(self, *edits: Edit) -> None:
        flat: list[Edit] = []
        for i, e in enumerate(edits):
            if not isinstance(e, Edit):
                what = repr(e) if isinstance(e, _Selected) else type(e).__name__
                raise SdpaTypeError(
                    f"Compose takes sdpa edits (sdpa.integrations.edits.Edit), got {what} as "
                    f"edit {i}; an edit(model, fn) function such as on_layers(...) is built "
                    f"from the composed edit: Compose(a, b).on_layers(1)"
                )
            flat.extend(e.edits if isinstance(e, Compose) else (e,))
        seen_pattern = None
        for e in flat:
            if e.point == "hook_attn_scores":
                if type(e) is not KnockOut:
                    raise NotSupportedError(
                        f"Compose takes KnockOut as its edit of the scores, got {e!r}; "
                        f"compose the pattern edits and put this one on its own call"
                    )
                if seen_pattern is not None:
                    raise SdpaValueError(
                        f"Compose: {e!r} edits the scores, before the softmax, but comes "
                        f"after {seen_pattern!r}, which edits the pattern after it; put "
                        f"the knock-outs first"
                    )
            else:
                seen_pattern = seen_pattern or e
        self.edits: tuple[Edit, ...] = tuple(flat)
        self.knockouts = tuple(e for e in flat if e.point == "hook_attn_scores")
        self.patterns = tuple(e for e in flat if e.point != "hook_attn_scores")
        if self.knockouts and self.patterns:
            self.point = None  # two steps: .scores and .pattern
        elif self.knockouts:
            self.point = "hook_attn_scores"

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.edits))})"

    @property
    def scores(self) -> Compose:
        """The knock-outs: the edit of the scores, before the softmax."""
        return Compose(*self.knockouts)

    @property
    def pattern(self) -> Compose:
        """The pattern edits, after the softmax."""
        return Compose(*self.patterns)

    def knocked(self, H: int, L: int, S: int, device, rows=None) -> torch.Tensor:
        """(H, n, S) bool: True where a knock-out drops a score (any of them)."""
        n = L if rows is None else rows.numel()
        out = torch.zeros(H, n, S, dtype=torch.bool, device=device)
        for e in self.knockouts:
            out |= e.knocked(H, L, S, device, rows)
        return out

    def hooks(self, *layers: int) -> list[tuple[str, Edit]]:
        if self.point is not None:
            return super().hooks(*layers)
        return self.scores.hooks(*layers) + self.pattern.hooks(*layers)

    def dense(self, p, where=None):
        if self.point is None:
            raise SdpaValueError(
                f"{self!r} edits the scores and the pattern: its dense form is two steps, "
                f".scores.dense(scores) before the softmax and .pattern.dense(p) after it"
            )
        for e in self.edits:
            p = e.dense(p, where)
        return p

    def __call__(self, tensor: torch.Tensor, hook=None) -> torch.Tensor:
        if self.point is None:
            raise SdpaValueError(
                f"{self!r} edits the scores and the pattern, two hook points: put it on "
                f"with .hooks(layer), which gives an entry for each"
            )
        return super().__call__(tensor, hook)

    def on_weights(self, w):
        if self.knockouts:
            return None
        for e in self.edits:
            w = e.on_weights(w)
            if w is None:
                return None
        return w

    def fused(self, q, k, v, mask=None, scale=None):
        H, L, S = q.shape[-3], q.shape[-2], k.shape[-2]
        if self.knockouts:
            mask = _without(mask, self.knocked(H, L, S, q.device), L, S, q.device)
        plan = _Plan.of(self.patterns, H)
        if plan is None:  # an edit the plan does not know: on the dense pattern
            p = attention(q, k, v, mask, scale=scale).weights.full()  # (B, H, L, S)
            for e in self.patterns:
                p = e.dense(p)
            return (p.to(v.dtype) @ _kv_heads(v, H)).to(q.dtype)
        return plan.run(q, k, v, mask, scale)


class _Plan:
    """A chain of pattern edits as one edit per head h: P'_h = c_h (X_h - X_h * Z_h),
    X_h the call's pattern (or, frozen, its detached copy) or a replacement (MeanAblate,
    PatchPattern), Z_h the entries zeroed after it, c_h the product of the head scales
    and ablations after it. Worked out on the CPU from the edits alone."""

    def __init__(self, H: int) -> None:
        self.source: list[Edit | None] = [None] * H  # the replacement of each head, if any
        self.frozen = torch.zeros(H, dtype=torch.bool)
        self.zeros: list[tuple[torch.Tensor, Index, Index]] = []  # (heads, queries, keys)
        self.factors: list[tuple[str, object]] = []  # what each edit does to c, in order

    @classmethod
    def of(cls, edits: Sequence[Edit], H: int) -> _Plan | None:
        """The plan of a chain, or None where an edit has no place in one."""
        plan = cls(H)
        for e in edits:
            kind = type(e)
            if kind is ZeroAblate:
                plan.factors.append(("zero", _chosen(e.heads, H, "heads")))
            elif kind is ScaleHeads:
                plan.factors.append(("scale", e))
            elif kind is ZeroPattern:
                plan.zeros.append((_chosen(e.heads, H, "heads"), e.queries, e.keys))
            elif kind is FreezePattern:
                chosen = _chosen(e.heads, H, "heads")
                plan.frozen |= chosen
                plan.factors.append(("detach", chosen))
            elif kind in (MeanAblate, PatchPattern):
                chosen = _chosen(e.heads, H, "heads")
                for h in chosen.nonzero()[:, 0].tolist():
                    plan.source[h] = e
                plan.frozen &= ~chosen
                plan.zeros = [(hs & ~chosen, qs, ks) for hs, qs, ks in plan.zeros]
                plan.factors.append(("reset", chosen))
            else:
                return None
        replaced = torch.tensor([s is not None for s in plan.source])
        if any(bool((hs & replaced).any()) for hs, _, _ in plan.zeros):
            return None  # entries zeroed in a replaced pattern: the dense route
        return plan

    def run(self, q, k, v, mask, scale) -> torch.Tensor:
        """The edited output (B, H, L, Dv)."""
        H, L, S, dev = q.shape[-3], q.shape[-2], k.shape[-2], q.device
        live = torch.tensor([s is None for s in self.source])
        frozen, thawed = self.frozen & live, ~self.frozen & live
        out = w = w_frozen = None
        if bool(thawed.any()):
            out, w = attention(q, k, v, mask, scale=scale)
        if bool(frozen.any()):
            out_f, w_frozen = attention(q.detach(), k.detach(), v, _detached(mask), scale=scale)
            out = out_f if out is None else torch.where(_by_head(frozen.to(dev)), out_f, out)
        if out is None:  # every head replaced
            out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=dev)
        zeroed = self._zeroed(w, w_frozen, frozen, v, H, L, S)
        if zeroed is not None:
            out = out - zeroed
        for (e, detach), heads in self._replacements().items():
            idx = torch.tensor(heads, device=dev)
            out = out.index_copy(1, idx, e._replaced(q, k, v, idx, detach).to(out.dtype))
        if not self.factors:
            return out
        return out * self._factors(H, dev, out.dtype)[:, None, None]

    def _zeroed(self, w, w_frozen, frozen, v, H: int, L: int, S: int):
        """sum over the zeroed entries (i, j) of P_ij v_j, (B, H, L, Dv); None if none."""
        if not self.zeros:
            return None
        dev = v.device
        keys = torch.zeros(S, dtype=torch.bool)
        for _, _, ks in self.zeros:
            keys |= _chosen(ks, S, "keys")
        cols = keys.nonzero()[:, 0]  # (m,): every key some edit zeroes
        if cols.numel() == 0:
            return None
        zeroed = torch.zeros(H, L, cols.numel(), dtype=torch.bool)
        for hs, qs, ks in self.zeros:
            zeroed |= (hs[:, None, None] & _chosen(qs, L, "queries")[None, :, None]
                       & _chosen(ks, S, "keys")[cols][None, None, :])  # fmt: skip
        cols = cols.to(dev)
        if w is None:
            p = w_frozen[..., cols]
        elif w_frozen is None:
            p = w[..., cols]  # (B, H, L, m): the key columns, carrying their gradient
        else:
            p = torch.where(_by_head(frozen.to(dev)), w_frozen[..., cols], w[..., cols])
        p = p * zeroed.to(dev, p.dtype)
        return p.to(v.dtype) @ _kv_heads(v, H).index_select(-2, cols)  # (B, H, L, Dv)

    def _replacements(self) -> dict[tuple[Edit, bool], list[int]]:
        """(replacing edit, frozen) -> the heads it replaces, in order."""
        out: dict[tuple[Edit, bool], list[int]] = {}
        for h, e in enumerate(self.source):
            if e is not None:
                out.setdefault((e, bool(self.frozen[h])), []).append(h)
        return out

    def _factors(self, H: int, device, dtype) -> torch.Tensor:
        """c (H,): each head's factor, with the gradient of any ScaleHeads factors that
        are not frozen after them."""
        c = torch.ones(H, device=device, dtype=dtype)
        for kind, what in self.factors:
            if kind == "scale":
                c = c * what._factors(H, device, dtype)
                continue
            chosen = what.to(device)  # (H,) bool
            if kind == "zero":
                c = c.masked_fill(chosen, 0.0)
            elif kind == "reset":
                c = torch.where(chosen, torch.ones_like(c), c)
            else:  # "detach": a frozen pattern carries no gradient to its factors
                c = torch.where(chosen, c.detach(), c)
        return c


# ---- choosing calls: layers, stacks, module paths ----


class Site(NamedTuple):
    """One attention module of a model, as on_layers and on_modules choose among them."""

    path: str  # its qualified name in the model: "model.decoder.layers.1.encoder_attn"
    stack: str  # the layer list it is in, "model.decoder.layers" (outside one: its parent)
    kind: str  # "self", or "cross" (its keys and values come from another sequence)
    layer: int | None  # module.layer_idx; None where the module has none


class Layout:
    """The attention modules of a model (a Site each, in model order) and its attention
    stacks, the (stack, kind) pairs they fall into: what on_layers and on_modules choose
    among. Each choice is worked out at its first call and kept."""

    def __init__(self, sites: Iterable[Site] = ()) -> None:
        self.sites: list[Site] = []
        self.stacks: list[tuple[str, str]] = []
        self.version = 0  # one more per module added
        self._kept: dict[tuple, frozenset | None] = {}
        for site in sites:
            self.add(site)

    def __repr__(self) -> str:
        return f"Layout({len(self.sites)} attention modules in stacks {self._stacks()})"

    def add(self, site: Site) -> None:
        """One more attention module (one the model showed only when called)."""
        self.sites.append(site)
        if (site.stack, site.kind) not in self.stacks:
            self.stacks.append((site.stack, site.kind))
        self._kept = {}
        self.version += 1

    def choose(self, layers: tuple[int, ...], stack: str | None, kind: str | None,
               who: str) -> frozenset | None:  # fmt: skip
        """The (stack, kind) pairs on_layers(*layers, stack=, kind=) means here, or None
        for every call; raises where that is no pair, or several with layers given."""
        key = (layers, stack, kind)
        if key not in self._kept:
            self._kept[key] = self._choose(layers, stack, kind, who)
        return self._kept[key]

    def modules(self, paths: tuple[str, ...], who: str) -> frozenset:
        """The paths of the attention modules that on_modules(*paths) means."""
        key = ("paths", paths)
        if key not in self._kept:
            chosen: set[str] = set()
            for path in paths:
                got = [s.path for s in self.sites if _under(path, s.path)]
                if not got:
                    raise SdpaValueError(
                        f"{who}: {path!r} is no attention module of this model, nor a "
                        f"block holding one; its attention modules: {self._some(path)}"
                    )
                chosen.update(got)
            self._kept[key] = frozenset(chosen)
        return self._kept[key]

    def short(self, stack: str) -> str:
        """The shortest run of stack's dotted name that names it alone ("decoder")."""
        others = [s for s, _ in self.stacks if s != stack]
        parts = stack.split(".")
        for n in range(1, len(parts) + 1):
            for i in range(len(parts) - n + 1):
                run = ".".join(parts[i : i + n])
                if not any(_in_stack(run, o) for o in others):
                    return run
        return stack

    def _choose(self, layers, stack, kind, who) -> frozenset | None:
        if not layers and stack is None and kind is None:
            return None
        pairs = [
            (s, k) for s, k in self.stacks
            if (stack is None or _in_stack(stack, s)) and (kind is None or k == kind)
        ]  # fmt: skip
        if not pairs:
            raise SdpaValueError(
                f"{who}: stack={stack!r}, kind={kind!r} names no attention stack of this "
                f"model; its stacks: {self._stacks()}"
            )
        if layers and len(pairs) > 1:
            calls = [s for s in self.sites if (s.stack, s.kind) in pairs and _at(s) in layers]
            listing = ", ".join(f"{s.path} ({self.short(s.stack)}, {s.kind})" for s in calls)
            options = " or ".join(f"on_layers({_args(layers, self.short(s), k)})" for s, k in pairs)
            raise SdpaValueError(
                f"{who} is ambiguous: layer numbers repeat across this model's attention "
                f"stacks {self._stacks(pairs)}, and it would replace {len(calls)} calls "
                f"per forward pass: {listing or 'none known before the call'}; name one: "
                f"{options}, or choose modules by path with on_modules"
                f"({(calls[-1].path if calls else 'path')!r})"
            )
        for layer in layers:  # one pair: two of its modules may still share a layer_idx
            twins = [
                s.path for s in self.sites if (s.stack, s.kind) == pairs[0] and s.layer == layer
            ]
            if len(twins) > 1:
                raise SdpaValueError(
                    f"{who}: {len(twins)} attention modules of stack {pairs[0][0]!r} "
                    f"({pairs[0][1]}) carry layer {layer}: {twins}; choose them by path "
                    f"with on_modules({twins[0]!r})"
                )
        return None if len(pairs) == len(self.stacks) else frozenset(pairs)  # None: all

    def _stacks(self, pairs=None) -> str:
        kinds: dict[str, list[str]] = {}
        for s, k in pairs or self.stacks:
            kinds.setdefault(s, []).append(k)
        return ", ".join(f"{s!r} ({', '.join(k)})" for s, k in kinds.items())

    def _some(self, path: str) -> str:
        last = path.rsplit(".", 1)[-1]
        near = [s.path for s in self.sites if s.path.rsplit(".", 1)[-1] == last] or [
            s.path for s in self.sites
        ]
        return ", ".join(near[:4]) + (f", ... ({len(near)} in all)" if len(near) > 4 else "")


class _Selected:
    """An `edit(model, fn)` function: the edit's fused output for the calls chosen (by
    layer, stack and kind, or by module path), None elsewhere."""

    def __init__(self, edit: Edit, who: str, *, layers=(), stack=None, kind=None, paths=()):
        self.edit, self.who = edit, who
        self.layers, self.stack, self.kind, self.paths = tuple(layers), stack, kind, paths
        self._seen: tuple = (None, -1, None)  # the last layout, its version, what it chose

    def __repr__(self) -> str:
        return self.who

    def __call__(self, info, q, k, v, mask):
        if not self.chooses(info):
            return None
        return self.edit.fused(q, k, v, mask, getattr(info, "scale", None))

    def chooses(self, info) -> bool:
        """Whether the call info describes is one this function replaces."""
        layout = getattr(info, "layout", None)
        seen, version, chosen = self._seen
        if layout is not None and (layout is not seen or layout.version != version):
            if self.paths:  # worked out once per layout
                chosen = layout.modules(self.paths, self.who)
            else:
                chosen = layout.choose(self.layers, self.stack, self.kind, self.who)
            self._seen = (layout, layout.version, chosen)
        if self.paths:
            path = getattr(info, "path", None)
            if not isinstance(path, str):
                raise SdpaTypeError(
                    f"{self.who} needs each call's module path (info.path, which "
                    f"sdpa.integrations.transformers.edit gives), got an info without one: "
                    f"{type(info).__name__}"
                )
            if layout is not None:
                return path in chosen
            return any(_under(p, path) for p in self.paths)
        if layout is not None:
            if chosen is not None and (info.stack, info.kind) not in chosen:
                return False
        elif self.stack is not None or self.kind is not None:  # an info of another host
            stack, kind = getattr(info, "stack", None), getattr(info, "kind", None)
            if (self.stack is not None and not isinstance(stack, str)) or (
                self.kind is not None and kind is None
            ):
                raise SdpaTypeError(
                    f"{self.who} needs each call's stack and kind (info.stack, info.kind, "
                    f"which sdpa.integrations.transformers.edit gives), got "
                    f"{type(info).__name__} without them"
                )
            if self.stack is not None and not _in_stack(self.stack, stack):
                return False
            if self.kind is not None and kind != self.kind:
                return False
        return not self.layers or getattr(info, "layer", None) in self.layers


def _check_layers(layers, stack, kind) -> None:
    bad = [layer for layer in layers if not isinstance(layer, int) or isinstance(layer, bool)]
    if bad:
        raise SdpaTypeError(f"on_layers takes layer numbers as ints, on_layers(1, 3), got {bad!r}")
    if stack is not None and (not isinstance(stack, str) or not stack):
        raise SdpaTypeError(
            f"stack must be a stack's dotted name or a run of it ('decoder', "
            f"'model.decoder.layers'), got {stack!r}"
        )
    if kind not in (None, "self", "cross"):
        raise SdpaValueError(f"kind must be 'self' or 'cross' (or None for both), got {kind!r}")


def _args(layers, stack, kind) -> str:
    """on_layers' arguments as written."""
    parts = [str(layer) for layer in layers]
    parts += [f"{n}={x!r}" for n, x in (("stack", stack), ("kind", kind)) if x is not None]
    return ", ".join(parts)


def _in_stack(run: str, stack: str) -> bool:
    """Whether run's dotted parts are consecutive parts of stack ("decoder" of
    "model.decoder.layers")."""
    want, parts = run.split("."), stack.split(".")
    n = len(want)
    return any(parts[i : i + n] == want for i in range(len(parts) - n + 1))


def _under(path: str, module_path: str) -> bool:
    """Whether module_path is path or a module inside it."""
    return module_path == path or module_path.startswith(path + ".")


def _at(site: Site) -> int | None:
    """The layer a site answers to: its layer_idx, else its index in the stack's list."""
    if site.layer is not None:
        return site.layer
    rest = site.path[len(site.stack) :].lstrip(".").split(".")[0]
    return int(rest) if rest.isdigit() else None


# ---- what an edit function may answer ----


def answer_of(got, query: torch.Tensor, value: torch.Tensor, where: str):
    """An `edit(model, fn)` function's answer for one call, as (output, weights or None):
    a tensor (B, H, L, Dv) in q's dtype, or an sdpa.AttentionResult of that output;
    anything else refused, naming `where` (the call). The one check the transformers and
    diffusers edits share."""
    result = isinstance(got, AttentionResult)
    out, weights = (got.output, got.weights) if result else (got, None)
    if not isinstance(out, torch.Tensor) or (result and not isinstance(weights, HANDLES)):
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
