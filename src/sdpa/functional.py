"""The public calls: `attention` (output and lazy weights) and the torch drop-in."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import torch

from sdpa import masks
from sdpa.backends import PRIORITY, Backend, run, select, select_fast
from sdpa.errors import SdpaValueError
from sdpa.inputs import Inputs, check_flag, fast_normalize, is_causal_bias, no_autocast, normalize
from sdpa.nested import nested_attention
from sdpa.weights import AttentionWeights, GraphWeights, new_handle, versions_now
from sdpa.weights import handle as weights_of


class AttentionResult(NamedTuple):
    """What `attention` and every module return: the listing's two values."""

    output: torch.Tensor  # (..., L, Ev)
    weights: AttentionWeights | GraphWeights  # lazy (..., L, S); GraphWeights in torch.compile


class _Pending:
    """The weights' handle of a call, made when first asked for (new_handle), with the
    version counters of q, k and the mask as they were at the call (so a change in
    place before that first access still makes the handle stale)."""

    __slots__ = ("args", "made")

    def __init__(self, args: tuple):
        self.args, self.made = args, None

    def handle(self) -> AttentionWeights:
        if self.made is None:
            self.made = new_handle(AttentionWeights, *self.args)
        return self.made


class _LazyResult(AttentionResult):
    """An AttentionResult whose weights' handle is made on first access (`.weights`,
    `r[1]`, unpacking, iteration): a call whose weights no one reads (a decoding step's
    `attention(...).output`) makes no handle, a few microseconds of a ~15 us call. It
    reads, unpacks, prints, pickles and copies as the AttentionResult it stands for."""

    __slots__ = ()

    @property
    def weights(self) -> AttentionWeights:
        w = tuple.__getitem__(self, 1)
        return w.handle() if w.__class__ is _Pending else w

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        if index in (1, -1):
            return self.weights
        return tuple.__getitem__(self, index)

    def __iter__(self):
        return iter((tuple.__getitem__(self, 0), self.weights))

    def __repr__(self) -> str:
        return f"AttentionResult(output={self.output!r}, weights={self.weights!r})"

    def __reduce__(self):
        return AttentionResult, (self.output, self.weights)

    def __eq__(self, other: object) -> bool:
        return tuple(self) == other

    def __ne__(self, other: object) -> bool:
        return tuple(self) != other

    __hash__ = AttentionResult.__hash__


_result = tuple.__new__  # _LazyResult(out, pending) without the NamedTuple's keyword handling


def with_output(result: AttentionResult, output: torch.Tensor) -> AttentionResult:
    """result with another output (a module's projection of it) and its weights as they
    are: a handle not yet made stays unmade (unpacking the result would make it)."""
    return _result(result.__class__, (output, tuple.__getitem__(result, 1)))


_FROZEN: contextvars.ContextVar[bool] = contextvars.ContextVar("sdpa_frozen", default=False)
# How many sdpa.frozen() blocks are open, in any thread: a plain int read on every call
# (torch.compile guards on it); only when it is not 0 is the ContextVar read.
_frozen_blocks = 0


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Within the block, every sdpa attention call holds its pattern constant in the
    backward: gradients flow to the values and through the output only, and q, k (and a
    float mask or sinks) get none from the call, as attribution methods that freeze
    attention need (circuit-tracer's frozen patterns). It runs at the fused kernel's
    cost (the call is attention(q.detach(), k.detach(), v)). Every model's calls in the
    block are frozen, for this thread / asyncio task. The weights of such calls refuse
    gradients (with grad enabled a read raises) rather than come back detached.

        with sdpa.frozen():
            loss = model(**batch).loss       # patterns constant in the backward
        loss.backward()                      # only through the values
    """
    global _frozen_blocks
    token = _FROZEN.set(True)
    _frozen_blocks += 1
    try:
        yield
    finally:
        _frozen_blocks -= 1
        _FROZEN.reset(token)


@torch.compiler.disable
def _frozen_here() -> bool:
    """Whether this thread / task is inside sdpa.frozen() (runs outside a compiled graph)."""
    return _FROZEN.get()


def _freeze(inputs: Inputs) -> Inputs:
    """The inputs with q, k, a float mask and the sinks detached."""
    tensor, structured = masks.split(inputs.mask)
    sinks = inputs.sinks
    return inputs._replace(
        query=inputs.query.detach(),
        key=inputs.key.detach(),
        mask=masks.join(None if tensor is None else tensor.detach(), structured),
        sinks=None if sinks is None else sinks.detach(),
    )


def _wanted_grad(query: object, key: object, mask: object) -> bool:
    """Whether q, k or a mask (or its sinks) the user passed required grad."""
    parts = [query, key, mask, getattr(mask, "mask", None), getattr(mask, "sinks", None)]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in parts)


def _compute(
    query,
    key,
    value,
    mask,
    causal,
    scale,
    dropout_p,
    backend: str,
    lane: bool = True,
    **torch_rules,
) -> tuple[Inputs, torch.Tensor, torch.Tensor | None, torch.Tensor | None, Backend]:
    """(inputs, output (*lead, L, Ev), lse (B, Hq, L) or None, the weights (B, Hq, L, S)
    where the backend computed them, else None, the backend that ran). The common calls
    are recognised in O(1) from types and shapes (fast_normalize: 4-D, autocast off,
    nothing to reshape); the rest are validated in full. lane=False: the caller's own
    fast lane missed already."""
    if lane and backend == "auto" and not _frozen_blocks:
        inputs = fast_normalize(query, key, value, mask, causal, scale, dropout_p,
                                torch_rules.get("gqa", True))  # fmt: skip
        if inputs is not None:
            impl = select_fast(inputs)
            return inputs, *impl.run(inputs), impl
    inputs = normalize(
        query, key, value, mask, causal=causal, scale=scale, dropout_p=dropout_p, **torch_rules
    )
    if _frozen_blocks and _frozen_here():
        inputs = _freeze(inputs)
    impl = select(inputs, backend)
    with no_autocast(inputs.query.device.type):  # inputs already carry autocast's dtype
        out, lse, p = run(impl, inputs)
    if len(inputs.lead) != 2:  # (B, Hq, L, Ev) -> (*lead, L, Ev)
        out = out.reshape(*inputs.lead, *out.shape[-2:])
    return inputs, out, lse, p, impl


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> AttentionResult:
    """Scaled dot-product attention that also returns its weights, lazily.

    Shapes: query (..., L, E), key (..., S, E), value (..., S, Ev) -> output (..., L, Ev);
    weights view (..., Hq, L, S). L: queries, S: keys, E: query/key width, Ev: value width.
    Leading dims broadcast; for 4-D+ inputs dim -3 is heads and key/value heads may
    divide query heads (grouped-query attention: query head h uses key/value head
    h // (Hq // Hkv)). A 3-D input's dim -3 is batch.

    mask: bool/int (True/nonzero = takes part) or float (added to the scores),
    broadcasting to (..., L, S); a 2-D mask is (L, S), key padding (B, 1, 1, S).
    causal: query i sees keys j <= i; needs L == S and is ANDed with `mask`.
    scale: defaults to 1/sqrt(E). dropout_p: dropout on the weights before they
    multiply value; the weights returned are the probabilities before dropout.
    Rows with no key left give output 0 and weights 0. Softmax statistics and weights
    are float32 for 16-bit inputs. Under torch.autocast the inputs are cast as torch's
    own scaled_dot_product_attention casts them.

    backend: "auto" (the first that supports the inputs: small, fused, chunked,
    reference), "small", "fused", "chunked" or "reference"; an explicit backend that
    cannot run raises, naming why. mask may also be sdpa.masks.sinks(...) /
    softcap(...) around a mask.

    Equivalent to (up to rounding, without materialising the scores):
        s = query @ key.mT * scale + bias(mask); p = softmax(s); out = dropout(p) @ value
    """
    if backend == "auto" and not _frozen_blocks:  # the lean entry: _compute's fast lane
        inputs = fast_normalize(query, key, value, mask, causal, scale, dropout_p)
        if inputs is not None:
            impl = select_fast(inputs)
            out, lse, p = impl.run(inputs)  # (the lane is never taken while compiling)
            pending = _Pending((inputs, lse, p, impl, False, versions_now(inputs)))
            return _result(_LazyResult, (out, pending))
    inputs, out, lse, p, impl = _compute(
        query, key, value, mask, causal, scale, dropout_p, backend, lane=False
    )  # (the lane above missed, or is not for these calls: not again)
    frozen_call = bool(_frozen_blocks) and _frozen_here() and _wanted_grad(query, key, mask)
    return AttentionResult(out, weights_of(inputs, lse, p, impl, frozen=frozen_call))


def output_only(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """attention(query, key, value, mask, scale=..., dropout_p=...).output, the same
    computation, without making the weights' handle: for an integration's call whose
    weights no one asked for (a decoding step's few microseconds)."""
    return _compute(query, key, value, mask, False, scale, dropout_p, "auto")[1]


class Explanation(NamedTuple):
    """What sdpa.explain says of some inputs (str() prints it as a short table)."""

    backend: str  # the backend backend="auto" picks
    path: str  # how that backend runs these inputs (AttentionWeights.served_by)
    fast_lane: bool  # recognised in O(1) from types and shapes (no full validation)
    reasons: dict[str, list[str]]  # each backend -> why it would not take them ([]: would)

    def __str__(self) -> str:
        lines = [
            f"auto picks {self.backend}: {self.path}",
            f"fast lane: {'yes' if self.fast_lane else 'no (validated in full)'}",
        ]
        width = max(len(name) for name in self.reasons)
        for name, why in self.reasons.items():
            verdict = "would run them" if not why else "; ".join(why)
            mark = "*" if name == self.backend else " "
            lines.append(f"{mark} {name:<{width}}  {verdict}")
        return "\n".join(lines)


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Explanation:
    """Why each backend would or would not take these inputs, and which one
    sdpa.attention(query, key, value, mask, ...) would run, without running it (as
    xFormers' info and torch's refusal warnings tell). Invalid inputs raise the error
    the call would raise.

        print(sdpa.explain(q, k, v, sdpa.masks.softcap(30.0)))
    """
    fast = fast_normalize(query, key, value, mask, causal, scale, dropout_p) is not None
    inputs = normalize(query, key, value, mask, causal=causal, scale=scale, dropout_p=dropout_p)
    reasons = {b.name: b.not_supported_reasons(inputs) for b in PRIORITY}
    impl = select(inputs)
    return Explanation(impl.name, impl.path(inputs), fast, reasons)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, on sdpa's engine.

    Same signature and, for every call torch accepts, torch's result: bool attn_mask
    True = takes part, float attn_mask added, is_causal top-left for L != S, key/value
    heads dividing query heads only with enable_gqa=True. attn_mask together with
    is_causal raises, as torch documents. Beyond torch it also takes integer keep-masks
    and float masks of any float dtype.
    """
    nested = getattr(query, "is_nested", False) or getattr(key, "is_nested", False)
    if nested or getattr(value, "is_nested", False):
        return nested_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            scaled_dot_product_attention,
        )  # fmt: skip
    if is_causal_bias(attn_mask) and is_causal:
        raise SdpaValueError("CausalBias should not be used with causal=True")  # torch's text
    if attn_mask is not None and is_causal:
        raise SdpaValueError(
            "attn_mask and is_causal=True were both given; torch's documentation makes this "
            "an error. AND the causal mask into attn_mask yourself, or use "
            "sdpa.attention(q, k, v, mask, causal=True)"
        )
    check_flag("is_causal", is_causal)
    check_flag("enable_gqa", enable_gqa)
    # torch reads dim -3 of 3-D inputs as heads when enable_gqa=True
    heads_3d = enable_gqa and all(
        isinstance(t, torch.Tensor) and t.ndim == 3 for t in (query, key, value)
    )
    if heads_3d:
        query, key, value = query[None], key[None], value[None]  # (1, H, L|S, E)
    out = _compute(
        query, key, value, attn_mask, is_causal, scale, dropout_p, "auto",
        torch_semantics=True, gqa=enable_gqa,
    )[1]  # fmt: skip
    return out[0] if heads_3d else out
