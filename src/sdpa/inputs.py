"""Validation and the one normalised record every backend reads.

Two ways in, one record out. `fast_normalize` recognises the calls made most (plain
4-D tensors of one dtype on one device, no mask or a plain 4-D one, autocast off) in
O(1) from types and shapes, and returns the record `normalize` would; every other call
goes through `normalize`, which checks the arguments in the order of its steps below
(nothing is computed on bad input: the first error names what is wrong), applies
torch's autocast casting rule, and lays the tensors out as 4-D views, without copying
where broadcasting allows:

    query (B, Hq, L, E)   key (B, Hkv, S, E)   value (B, Hkv, S, Ev)
    mask  None, or a bool/float tensor broadcastable to (B, Hq, L, S)

B: all leading (batch) dims flattened; Hq: query heads; Hkv: key/value heads, dividing
Hq (grouped-query attention: query head h uses key/value head h // (Hq // Hkv)).
Inputs of 2 or 3 dims have no heads dim: Hq = Hkv = 1 and a 3-D input's dim -3 is batch.
`lead` is the user-facing shape in front of (L, S): the weights are (*lead, L, S) and
the output (*lead, L, Ev).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import sys
from typing import NamedTuple

import torch
from torch.fx.experimental import symbolic_shapes

from sdpa import masks
from sdpa.errors import SdpaTypeError, SdpaValueError

HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics are computed in for inputs of `dtype`: float32 for
    16-bit inputs, else the input dtype. The one definition: every backend calls it."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


# Sizes may be symbolic under torch.export / torch.compile, and data dependent (an
# unbacked batch size after boolean indexing): a Python `if` on such a size cannot be
# decided. `known(cond)` is the condition where it can be decided and False where it
# cannot (torch's size-oblivious rule: an unknown size is neither 0 nor 1).
_guard_or_false = getattr(symbolic_shapes, "guard_or_false", None) or (
    symbolic_shapes.guard_size_oblivious  # torch < 2.7
)


def known(cond: bool | torch.SymBool) -> bool:
    """True where `cond` holds and can be decided without guarding on data."""
    return cond if cond.__class__ is bool else _guard_or_false(cond)


def empty(*sizes: int | torch.SymInt) -> bool:
    """Whether any of the sizes is known to be 0 (never guards on an unbacked size)."""
    for n in sizes:  # noqa: SIM110 (a loop, not any(): this runs on every call)
        if n == 0 if n.__class__ is int else _guard_or_false(n == 0):
            return True
    return False


def no_work(Hq: int, L: int, S: int) -> bool:
    """Inputs.no_work from the sizes at hand (heads, queries, keys)."""
    return empty(Hq, L, S)


class Inputs(NamedTuple):
    """Validated attention inputs in (B, H, L, D) layout (see the module docstring)."""

    query: torch.Tensor  # (B, Hq, L, E)
    key: torch.Tensor  # (B, Hkv, S, E)
    value: torch.Tensor  # (B, Hkv, S, Ev)
    mask: torch.Tensor | masks.Mask | masks.TensorAnd | None  # bool (True = takes part)
    # or float (added), broadcasting to (B, Hq, L, S); a structured mask (batch dim B, if
    # any); or both ANDed (masks.split reads them). causal=True is masks.TOP_LEFT in it.
    scale: float
    dropout_p: float
    lead: tuple[int, ...]  # user-facing dims in front of (L, S)
    softcap: float | None = None  # scores s -> softcap * tanh(s / softcap) before the mask
    sinks: torch.Tensor | None = None  # (B, Hq, L|1) sink logits, compute dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32 for 16-bit inputs (softmax statistics), else the input dtype."""
        return compute_dtype(self.query.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the full attention weights, (*lead, L, S)."""
        return (*self.lead, self.query.shape[-2], self.key.shape[-2])

    @property
    def group(self) -> int:
        """Query heads per key/value head: query head h uses key/value head h // group."""
        hkv = self.key.shape[1]
        return 1 if empty(hkv) else self.query.shape[1] // hkv

    @property
    def causal_only(self) -> bool:
        """Whether the only masking is top-left causality (causal=True, or a structured
        mask that is exactly the top-left causal one): the kernels' own causal path,
        decided without a scan."""
        mask = self.mask
        if mask is masks.TOP_LEFT:
            return True
        return isinstance(mask, masks.Mask) and mask.is_top_left_causal(
            self.query.shape[2], self.key.shape[2]
        )

    @property
    def tensor_mask(self) -> torch.Tensor | None:
        """The mask's tensor part (bool keep-mask or float bias), or None."""
        mask = self.mask
        return mask if mask.__class__ is torch.Tensor else masks.split(mask)[0]

    @property
    def structured(self) -> masks.Mask | None:
        """The mask's structured part (causality, windows, padding, documents), or None."""
        return masks.split(self.mask)[1]

    @property
    def no_work(self) -> bool:
        """Whether there is no score to compute (0 heads, queries or keys): the output
        is all 0 (empty, or rows that see no key), decided from shapes alone."""
        q, k = self.query, self.key
        nq, nk = q.numel(), k.numel()
        if nq.__class__ is int and nk.__class__ is int and nq and nk:
            return False  # (every size of q and k > 0: the common case, without a shape)
        _, H, L, _ = q.shape
        return no_work(H, L, k.shape[2])


def normalize(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | masks.Mask | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    torch_semantics: bool = False,
    gqa: bool = True,
) -> Inputs:
    """Validate the arguments of an attention call and lay them out as `Inputs`.

    torch_semantics: the drop-in's rules where torch is laxer than `attention`: causal
    with L != S is top-left instead of refused, and `scale` and `dropout_p` may be any
    real number torch takes (bool, inf and nan included). gqa: allow Hkv < Hq (the
    drop-in's enable_gqa); Hkv == 1 always broadcasts.

    The steps, in the order errors are reported: types, autocast, dtypes and devices,
    sizes and layout (`_Shape`), the mask, causality, scale and dropout, then the 4-D
    views (`_lay_out`). `fast_normalize` gives the same record for the common calls.
    """
    query, key, value, mask, mods = _check_types(query, key, value, mask, causal)
    device = query.device
    if autocast_enabled(device.type):
        query, key, value, mask = autocast([query, key, value, mask], device.type)
    _check_dtypes_devices(query, key, value)
    shape = _shape_of(query, key, value, gqa)
    mask = _check_mask(mask, query, shape)
    _check_causal(causal, shape, torch_semantics)
    scale = _check_scale(scale, shape.E, torch_semantics)
    dropout_p = _check_dropout(dropout_p, torch_semantics)
    return _lay_out(query, key, value, mask, mods, causal, scale, dropout_p, shape)


def folded(mask: torch.Tensor | masks.Mask | None, causal: bool):
    """The call's mask with causal=True folded in (masks.and_top_left): the one place
    the flag becomes a mask."""
    return masks.and_top_left(mask) if causal else mask


# -- 1. types: plain tensors, a mask sdpa can read, bool flags ---------------------------


def _check_types(query, key, value, mask, causal):
    """Plain tensors of 2+ dims, a mask sdpa can read, a bool causal flag ->
    (query, key, value, mask, score mods or None), a ScoreMod's mask unwrapped."""
    query = _check_tensor("query", query)
    key = _check_tensor("key", key)
    value = _check_tensor("value", value)
    mods = None
    if isinstance(mask, masks.ScoreMod):  # softcap / sinks around a mask
        mods, mask = mask, mask.mask
    mask = _check_mask_type(mask)
    check_flag("causal", causal)
    return query, key, value, mask, mods


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SdpaTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_readable(
        name,
        t,
        "sdpa.attention takes dense tensors (pad them and pass a key-padding mask, "
        "sdpa.masks.padding(lengths)); the drop-in sdpa.scaled_dot_product_attention takes "
        "nested tensors where torch does. Pass a plain tensor "
        "(t.as_subclass(torch.Tensor) if a subclass's storage is what you mean)",
    )
    if t.ndim < 2:
        raise SdpaValueError(
            f"{name} must have at least 2 dims (..., length, features), got shape {_shape(t)}"
        )
    return t


_PLAIN_TORCH_FUNCTIONS = (
    torch.Tensor.__torch_function__.__func__,  # type: ignore[attr-defined]
    torch._C._disabled_torch_function_impl,  # Parameter, FakeTensor, DTensor...
)


def _own_torch_function(t: torch.Tensor) -> bool:
    """Whether t is a tensor subclass that redefines torch functions (its storage may not
    be its meaning, as for torch.nn.attention.bias.CausalBias)."""
    if type(t) is torch.Tensor:
        return False
    impl = type(t).__torch_function__
    return getattr(impl, "__func__", impl) not in _PLAIN_TORCH_FUNCTIONS


def _check_readable(name: str, t: torch.Tensor, what_works: str) -> None:
    """Refuse, by name, a tensor whose storage is not its meaning: a nested tensor, or a
    subclass with its own __torch_function__."""
    if t.is_nested:
        kind = "a nested tensor"
    elif _own_torch_function(t):
        kind = f"a {type(t).__name__}, a tensor subclass with its own __torch_function__"
    else:
        return
    raise SdpaTypeError(
        f"{name} is {kind}: sdpa would read its storage, not its meaning. {what_works}"
    )


def _check_mask_type(mask: object) -> torch.Tensor | masks.Mask | None:
    """The mask as sdpa reads it: torch's causal bias objects become the causal mask of
    the same alignment; other tensor subclasses with their own meaning are refused."""
    if mask is None or isinstance(mask, masks.Mask):
        return mask
    if mask.__class__ is masks.TensorAnd:  # a tensor AND a structured mask
        tensor = _check_mask_type(mask.tensor)
        if isinstance(tensor, masks.Mask):  # torch's causal bias objects
            return tensor & mask.structured
        return masks.join(tensor, mask.structured)
    if not isinstance(mask, torch.Tensor):
        raise SdpaTypeError(
            f"mask must be None, a torch.Tensor (bool/int: nonzero takes part; float: added "
            f"to the scores) or an sdpa.masks object, got {type(mask).__name__}"
        )
    if is_causal_bias(mask):
        top_left = mask.variant.name == "UPPER_LEFT"  # else LOWER_RIGHT
        return masks.TOP_LEFT if top_left else masks.causal("bottom-right")
    _check_readable(
        "mask",
        mask,
        "Pass a plain bool or float tensor, an sdpa.masks object, or torch's "
        "causal_upper_left / causal_lower_right (mapped to sdpa.masks.causal)",
    )
    return mask


def is_causal_bias(mask: object) -> bool:
    """Whether mask is torch.nn.attention.bias.CausalBias (causal_upper_left / lower_right).
    Read from sys.modules: importing that module imports triton, and a mask cannot be a
    CausalBias before its module is imported."""
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


def check_flag(name: str, flag: object) -> None:
    """A Python bool, as torch's SDPA wants its flags (a string or tensor is refused)."""
    if not isinstance(flag, bool):
        raise SdpaTypeError(f"{name} must be True or False, got {flag!r} ({type(flag).__name__})")


# -- 2. autocast: torch's casting rule for SDPA, applied once here -----------------------


def autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled, False for device types autocast does not know (meta)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def autocast(tensors: list[torch.Tensor | None], device_type: str) -> list[torch.Tensor | None]:
    """torch's autocast rule for SDPA: floating tensors other than float64 take the
    autocast dtype (torch.get_autocast_dtype); bool masks and float64 are left alone."""
    target = torch.get_autocast_dtype(device_type)
    return [
        t.to(target)
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype not in (torch.float64, target)
        else t
        for t in tensors
    ]


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off inside (sdpa applies torch's autocast casting once, at the entry)."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# -- 3. dtypes and devices ---------------------------------------------------------------


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_dtypes_devices(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dtype not in _DTYPES:
        kind = "a float8 or other low-precision" if query.is_floating_point() else "a non-floating"
        raise SdpaTypeError(
            f"query is {kind} tensor ({query.dtype}); sdpa computes in float32, float64, "
            f"bfloat16 or float16: cast q, k and v first (e.g. q.to(torch.bfloat16)), as "
            f"torch's scaled_dot_product_attention wants too"
        )
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise SdpaTypeError(
            f"query, key and value must have the same dtype, got query {query.dtype}, "
            f"key {key.dtype}, value {value.dtype}; cast them to one dtype"
        )
    device = query.device
    if key.device != device or value.device != device:
        raise SdpaValueError(
            f"query, key and value must be on one device, got query {device}, "
            f"key {key.device}, value {value.device}"
        )


# -- 4. sizes and layout -----------------------------------------------------------------


class _Shape(NamedTuple):
    """The sizes of a call, read from the user's shapes (see the module docstring)."""

    batch: tuple[int, ...]  # batch dims, flattened to B
    hq: int
    hkv: int
    has_heads: bool  # inputs of 4+ dims: dim -3 is heads
    L: int
    S: int
    E: int

    @property
    def lead(self) -> tuple[int, ...]:
        """The user-facing dims in front of (L, S)."""
        return (*self.batch, self.hq) if self.has_heads else self.batch


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _shape_of(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gqa: bool) -> _Shape:
    """Sizes that agree (E, S), batch dims that broadcast, heads that divide."""
    qs, ks, vs = _shape(query), _shape(key), _shape(value)
    _check_sizes(qs, ks, vs)
    batch, hq, hkv, has_heads = _layout(qs, ks, vs, gqa)
    return _Shape(batch, hq, hkv, has_heads, qs[-2], vs[-2], qs[-1])


def _check_sizes(qs: tuple[int, ...], ks: tuple[int, ...], vs: tuple[int, ...]) -> None:
    """E shared by query and key, S shared by key and value."""
    E, S = qs[-1], vs[-2]
    if ks[-1] != E:
        raise SdpaValueError(
            f"query and key must have the same feature size E, got query {qs} "
            f"(E={E}) and key {ks} (E={ks[-1]})"
        )
    if ks[-2] != S:
        raise SdpaValueError(
            f"key and value must have the same length S, got key {ks} "
            f"(S={ks[-2]}) and value {vs} (S={S})"
        )


def _layout(
    qs: tuple[int, ...], ks: tuple[int, ...], vs: tuple[int, ...], gqa: bool
) -> tuple[tuple[int, ...], int, int, bool]:
    """(batch dims, Hq, Hkv, has_heads) of the inputs' shapes (see the module docstring)."""
    if max(len(qs), len(ks), len(vs)) < 4:  # (L, E) or (N, L, E): dim -3 is batch
        batch = _broadcast(
            "batch dim (dim -3 of 3-D inputs)",
            [qs[:-2], ks[:-2], vs[:-2]],
            ["query", "key", "value"],
        )
        return batch, 1, 1, False
    batch = qs[:-3]  # (..., H, L, E): dim -3 is heads
    if ks[:-3] != batch or vs[:-3] != batch:
        batch = _broadcast(
            "batch dims (all but the last 3)",
            [qs[:-3], ks[:-3], vs[:-3]],
            ["query", "key", "value"],
        )
    hq, hk, hv = [s[-3] if len(s) >= 3 else 1 for s in (qs, ks, vs)]
    if known(hq == hk) and known(hk == hv):  # the common case: one number of heads
        return batch, hq, hq, True
    if known(hk == hv) or known(hk == 1) or known(hv == 1):
        hkv = hv if known(hk == 1) else hk
    else:  # key and value heads each dividing the query heads, as torch's enable_gqa takes
        for name, h, shape in (("key", hk, ks), ("value", hv, vs)):
            if empty(h) or known(hq % h != 0):
                raise SdpaValueError(
                    f"key and value have different numbers of heads (key {ks}: {hk}, "
                    f"value {vs}: {hv}), so each must divide the query heads, got {hq} "
                    f"query heads (query {qs}) and {h} {name} heads ({name} {shape})"
                )
        hkv = math.lcm(hk, hv)  # both repeated to it: query head h still uses key head
        # h // (Hq // hk) and value head h // (Hq // hv)
    if known(hq == 1):
        hq = hkv  # one query head broadcast over every key/value head
    if (empty(hkv) and not empty(hq)) or (not empty(hkv) and known(hq % hkv != 0)):
        raise SdpaValueError(
            f"key/value heads must divide query heads (grouped-query attention), got "
            f"{hq} query heads (query {qs}) and {hkv} key/value heads (key {ks})"
        )
    if not gqa and known(hkv != hq) and not known(hkv == 1):
        raise SdpaValueError(
            f"query has {hq} heads and key/value {hkv}: pass enable_gqa=True for "
            f"grouped-query attention (query head h uses key/value head h // {hq // hkv})"
        )
    return batch, hq, hkv, True


def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """torch's broadcasting of shapes, or None if they do not broadcast (pure Python:
    torch.broadcast_shapes costs several microseconds)."""
    n = max(len(s) for s in shapes)
    out = []
    for i in range(-n, 0):
        size = 1
        for s in shapes:
            d = s[i] if -i <= len(s) else 1
            if not known(d == 1):
                if not (known(size == 1) or known(size == d)):
                    return None
                size = d
        out.append(size)
    return tuple(out)


def _broadcast(what: str, shapes: list[tuple[int, ...]], names: list[str]) -> tuple[int, ...]:
    out = _broadcast_shape(*shapes)
    if out is None:
        seen = ", ".join(f"{n} {s}" for n, s in zip(names, shapes, strict=True))
        raise SdpaValueError(
            f"the {what} of query, key and value must broadcast (equal, or 1), got {seen}"
        )
    return out


# -- 5. the mask -------------------------------------------------------------------------


def _check_mask(
    mask: torch.Tensor | masks.Mask | None, query: torch.Tensor, shape: _Shape
) -> torch.Tensor | masks.Mask | None:
    """A structured mask that fits (L, S) and the batch; a tensor mask as bool or
    float in the softmax precision, broadcasting to the weights' shape."""
    tensor, structured = masks.split(mask)
    if structured is not None:
        check_structured(structured, shape.batch, shape.L, shape.S)
    if tensor is not None:
        tensor = _normalize_mask(tensor, query, shape.lead, shape.L, shape.S)
    return masks.join(tensor, structured)


def check_structured(mask: masks.Mask, batch: tuple[int, ...], L: int, S: int) -> None:
    mask.validate(L, S)
    if mask.batch is not None and batch != (mask.batch,):
        raise SdpaValueError(
            f"{mask!r} has a batch dim of {mask.batch}, so the inputs need exactly one batch "
            f"dim of that size ((B, H, L, E) or (B, L, E)), got batch dims {batch}"
        )


def _normalize_mask(
    mask: torch.Tensor, query: torch.Tensor, lead: tuple[int, ...], L: int, S: int
) -> torch.Tensor:
    if mask.device != query.device:
        raise SdpaValueError(f"mask is on {mask.device} but query is on {query.device}")
    if mask.dtype == torch.bool:
        pass
    elif mask.is_floating_point():
        # float masks are added in the softmax precision (float32 for 16-bit inputs)
        want = compute_dtype(query.dtype)
        if mask.dtype not in (want, query.dtype):
            mask = mask.to(want)
    elif mask.is_complex():
        raise SdpaTypeError(f"mask must be bool, integer or real floating, got {mask.dtype}")
    else:  # integer keep-mask, the listing's convention: nonzero takes part
        mask = mask != 0
    target = (*lead, L, S)
    if mask.ndim > len(target) or _broadcast_shape(_shape(mask), target) != target:
        raise SdpaValueError(
            f"mask of shape {_shape(mask)} does not broadcast to the weights' shape {target} "
            f"(..., L={L}, S={S}); a 2-D mask is (L, S), key padding is "
            f"{'(B, 1, 1, S)' if len(lead) >= 2 else '(N, 1, S) for 3-D inputs'}"
        )
    return mask


# -- 6. causality, 7. scale and dropout --------------------------------------------------


def _check_causal(causal: bool, shape: _Shape, torch_semantics: bool) -> None:
    """causal=True needs L == S, except in the drop-in (torch's top-left)."""
    L, S = shape.L, shape.S
    if causal and not torch_semantics and L != S:
        raise SdpaValueError(
            f"causal=True needs as many queries as keys, got L={L} and S={S}: for L != S "
            f"the alignment is ambiguous. Pass the mask you mean instead: "
            f"mask=sdpa.masks.causal(align='bottom-right') (KV-cache decoding, "
            f"FlashAttention) or align='top-left' (torch's is_causal)"
        )


def scale_of(scale: object, E: int) -> float:
    """The scale sdpa.attention uses for `scale` at head width E (1/sqrt(E) for None):
    the one default, for integrations that tell a caller the scale of a call."""
    return _check_scale(scale, E, torch_semantics=False)


def _check_scale(scale: object, E: int, torch_semantics: bool) -> float:
    """1/sqrt(E) for None; else a real number (a 0-d tensor or numpy scalar will do)."""
    if scale is None:  # E = 0: every score is an empty dot product (0), any scale will do
        return 1.0 if empty(E) else 1.0 / math.sqrt(E)
    if isinstance(scale, numbers.Real) or (isinstance(scale, torch.Tensor) and scale.numel() == 1):
        value = float(scale)
        if torch_semantics or (not isinstance(scale, bool) and math.isfinite(value)):
            return value
    raise SdpaValueError(f"scale must be a finite number or None (1/sqrt(E)), got {scale!r}")


def _check_dropout(dropout_p: object, torch_semantics: bool) -> float:
    """A probability in [0, 1]: a number (a 0-d tensor or a bool too, as torch takes
    them, in the drop-in)."""
    if dropout_p.__class__ is float and 0.0 <= dropout_p <= 1.0:  # the common case
        return dropout_p  # type: ignore[return-value]
    ok_types = (numbers.Real, torch.Tensor) if torch_semantics else (int, float)
    number = isinstance(dropout_p, ok_types) and (
        torch_semantics or not isinstance(dropout_p, bool)
    )
    if number and (not isinstance(dropout_p, torch.Tensor) or dropout_p.numel() == 1):
        value = float(dropout_p)
        if 0.0 <= value <= 1.0:
            return value
    raise SdpaValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p!r}")


# -- 8. the 4-D views --------------------------------------------------------------------


def _lay_out(query, key, value, mask, mods, causal, scale, dropout_p, shape: _Shape) -> Inputs:
    """The checked arguments as `Inputs`, tensors as 4-D views (B, H, X, Y)."""
    batch, hq, hkv, has_heads = shape.batch, shape.hq, shape.hkv, shape.has_heads
    q4 = _to_4d(query, batch, hq, has_heads)  # (B, Hq, L, E)
    k4 = _to_4d(key, batch, hkv, has_heads)  # (B, Hkv, S, E)
    v4 = _to_4d(value, batch, hkv, has_heads)  # (B, Hkv, S, Ev)
    tensor, structured = masks.split(mask)
    if tensor is not None:
        tensor = _mask_to_4d(tensor, batch, hq, has_heads, shape.L, shape.S)  # (B|1,Hq|1,L,S)
    lead = shape.lead
    mask = folded(masks.join(tensor, structured), causal)
    if mods is None:
        return Inputs(q4, k4, v4, mask, scale, dropout_p, lead)
    sinks = mods.sinks
    if sinks is not None:
        sinks = _normalize_sinks(sinks, query, lead, shape.L, q4.shape[0])  # (B, Hq, L|1)
    return Inputs(q4, k4, v4, mask, scale, dropout_p, lead, mods.softcap, sinks)


def _to_4d(t: torch.Tensor, batch: tuple[int, ...], heads: int, has_heads: bool) -> torch.Tensor:
    """(..., X, Y) -> (B, heads, X, Y): a view, or a copy only when >1 batch dims must
    be broadcast and flattened."""
    if has_heads and t.ndim == 4 and len(batch) == 1 and t.shape[:2] == (batch[0], heads):
        return t  # already (B, heads, X, Y)
    if not has_heads:  # (X, Y) or (N, X, Y): no heads dim
        t = t.unsqueeze(-3)  # (.., 1, X, Y)
    elif t.ndim >= 3 and t.shape[-3] not in (1, heads):  # key and value of other head counts
        t = t.repeat_interleave(heads // t.shape[-3], dim=-3)  # (..., heads, X, Y): a copy
    t = t.reshape((1,) * (len(batch) + 3 - t.ndim) + tuple(t.shape))  # (*1s, h, X, Y)
    t = t.expand(*batch, heads, t.shape[-2], t.shape[-1])  # (*batch, heads, X, Y)
    if len(batch) != 1:
        t = t.reshape(math.prod(batch), heads, t.shape[-2], t.shape[-1])  # (B, heads, X, Y)
    return t


def _mask_to_4d(
    mask: torch.Tensor, batch: tuple[int, ...], hq: int, has_heads: bool, L: int, S: int
) -> torch.Tensor:
    """(..., L|1, S|1) -> (B|1, Hq|1, L, S) as a view (stride 0 where broadcast)."""
    if not has_heads:
        mask = mask.reshape((1,) * (len(batch) + 2 - mask.ndim) + tuple(mask.shape))
        mask = mask.unsqueeze(-3)  # (N|1, 1, L|1, S|1)
    else:
        mask = mask.reshape((1,) * (len(batch) + 3 - mask.ndim) + tuple(mask.shape))
    heads = mask.shape[-3]
    if len(batch) > 1:  # flatten several batch dims into B
        mask = mask.expand(*batch, heads, mask.shape[-2], mask.shape[-1])
        mask = mask.reshape(math.prod(batch), heads, mask.shape[-2], mask.shape[-1])
    return mask.expand(mask.shape[0], heads, L, S)  # (B|1, Hq|1, L, S)


def _normalize_sinks(
    sinks: torch.Tensor, query: torch.Tensor, lead: tuple[int, ...], L: int, B: int
) -> torch.Tensor:
    """Sink logits broadcasting to the weights' (*lead, L, 1) -> (B, Hq, L|1) in the
    softmax precision (differentiable)."""
    if sinks.device != query.device:
        raise SdpaValueError(f"sinks are on {sinks.device} but query is on {query.device}")
    target = (*lead, L, 1)
    if sinks.ndim > len(target) or _broadcast_shape(_shape(sinks), target) != target:
        raise SdpaValueError(
            f"sinks of shape {_shape(sinks)} do not broadcast to {target} (..., Hq, L, 1), "
            f"the extra column of the scores: pass (Hq, 1, 1) for one logit per head"
        )
    want = compute_dtype(query.dtype)
    rows = L if sinks.ndim >= 2 and sinks.shape[-2] != 1 else 1
    sinks = sinks.expand(*lead, rows, 1).reshape(B, -1, rows)  # (B, Hq, L|1)
    return sinks.to(want)


# -- the fast lane: the common calls, recognised in O(1) ---------------------------------


_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})


_SQRT = {n: 1.0 / math.sqrt(n) for n in range(1, 1025)}  # default scales, no call


_is_compiling = torch.compiler.is_compiling


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
)


_TENSOR = torch.Tensor
# FakeTensor (torch._subclasses, imported by torch itself) is a plain tensor to
# `normalize` too: shapes without data, as under FakeTensorMode (CUDA ones on a
# CPU-only machine: how the tests hold the CUDA lane to `normalize`)
_FAKE = getattr(getattr(torch, "_subclasses", None), "FakeTensor", _TENSOR)


_new_inputs = tuple.__new__  # Inputs(...) without the NamedTuple's keyword handling


def fast_normalize(
    query: object,
    key: object,
    value: object,
    mask: object = None,
    causal: object = False,
    scale: object = None,
    dropout_p: object = 0.0,
    gqa: bool = True,
) -> Inputs | None:
    """`normalize` for the calls made most, decided in O(1) from types and shapes, or
    None: then `normalize` validates (and names what is wrong).

    Takes plain 4-D tensors q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) of one
    float dtype on one CPU or CUDA device (fake ones too: torch._subclasses.FakeTensor),
    Hkv dividing Hq (only Hkv == Hq without gqa), every size > 0; mask None or a plain
    4-D tensor on that device, bool or float in the input or softmax dtype (not
    requiring grad), shaped (B|1, Hq|1, L|1, S); causal a bool (L == S if True); scale
    None or a finite float; dropout_p 0.0; autocast off; not while torch.compile traces.
    Returns exactly what `normalize` returns for them (tests/test_fast_path.py holds the
    two equal, field by field, across this domain and its edges).
    """
    cls = query.__class__
    if (
        (cls is not _TENSOR and cls is not _FAKE)
        or key.__class__ is not cls
        or value.__class__ is not cls
        or dropout_p.__class__ is not float
        or dropout_p != 0.0
        or _any_autocast()  # (any device: the lane then leaves it to normalize)
        or _is_compiling()
    ):
        return None
    try:  # a strided nested tensor has no size: it raises here
        B, Hq, L, E = query.size()
        B_k, Hkv, S, E_k = key.size()
        B_v, Hkv_v, S_v, Ev = value.size()
    except (RuntimeError, ValueError):  # nested, or not 4-D
        return None
    dtype = query.dtype
    if (
        B_k != B or B_v != B or E_k != E or Hkv_v != Hkv or S_v != S
        or not (B and Hkv and L and S and E and Ev) or Hq % Hkv
        or (Hkv != Hq and not gqa)
        or key.dtype is not dtype or value.dtype is not dtype or dtype not in _FLOATS
    ):  # fmt: skip
        return None
    on_cpu = query.is_cpu
    if on_cpu:
        if not (key.is_cpu and value.is_cpu):
            return None
    else:
        device = query.device
        if device.type != "cuda" or key.device != device or value.device != device:
            return None
    if causal is not False and (causal is not True or L != S):
        return None
    if scale is None:
        scale = _SQRT.get(E) or 1.0 / math.sqrt(E)
    elif scale.__class__ is not float or not math.isfinite(scale):
        return None
    if mask is not None:
        if mask.__class__ is not cls:
            return None
        try:
            mb, mh, ml, ms = mask.size()
        except (RuntimeError, ValueError):
            return None
        md = mask.dtype
        if (
            (mb != B and mb != 1) or (mh != Hq and mh != 1) or (ml != L and ml != 1)
            or ms != S or not (mask.is_cpu if on_cpu else mask.device == device)
        ):  # fmt: skip
            return None
        if md is not torch.bool and (
            (md is not dtype and md is not compute_dtype(dtype)) or mask.requires_grad
        ):
            return None
        if ml != L:
            mask = mask.expand(mb, mh, L, S)
    if causal:
        mask = folded(mask, causal)
    return _new_inputs(Inputs, (query, key, value, mask, scale, 0.0, (B, Hq), None, None))


# -- for the engines ---------------------------------------------------------------------


def sink_rows(sinks: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The sinks (B, H, L|1) of query rows `rows`: one logit per head serves every row."""
    return sinks if sinks is None or sinks.shape[-1] == 1 else sinks[..., rows]
