"""torch's fused CUDA attention ops for the fused backend: output and LSE.

The op is the one torch's own scaled_dot_product_attention would run for the same
tensors (torch._fused_sdp_choice, which honours torch.nn.attention.sdpa_kernel), so
the fused path is as fast as torch's default backend:
- flash (`_scaled_dot_product_flash_attention`): float16/bfloat16, no mask, key/value
  heads may divide query heads; LSE (B, H, L).
- memory-efficient (`_scaled_dot_product_efficient_attention`): float32 too, and an
  additive bias in the input dtype whose rows are 16-element aligned; LSE padded
  along L (to a multiple of 32 in some versions), sliced here.
- cuDNN (`_scaled_dot_product_cudnn_attention`): taken without a mask only (its bias
  layout rules vary between versions; with a mask the efficient op runs instead);
  LSE (B, H, L) or (B, H, L, 1). Its signature changed across versions, so it is
  called by argument name.
- anything else (float64, a float32 mask with 16-bit inputs, or where torch would pick
  its math path): the math in plain torch, float32 softmax.
torch's choice is asked once per shape class (`shape_class`: what its checks read, not
the lengths of a decoding step) and each op looked up once, so a call costs the host
about what the CPU lane does. Every op's backward is registered, so autograd works
through each. The kernels' causal
flag is only used for L == S (flash aligns it bottom-right, torch's is_causal is
top-left); otherwise causality is folded into the bias. Rows that see no key are run
unmasked (bias 0) and zeroed afterwards with torch.where, so their output and LSE are 0
and no NaN reaches the gradients, whatever a kernel does with an empty row: nothing
here reads a value on the host (no sync; a CUDA graph can capture the call).
"""

from __future__ import annotations

import torch

from sdpa import masks, tile
from sdpa.backends import aten

MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3  # torch.nn.attention.SDPBackend values
HEAD_ALIGN = 8  # torch's CUDA kernels take head sizes in multiples of 8
BIAS_ALIGN = 16  # memory-efficient attention wants bias rows aligned to 16 elements


def choice(q, k, v, bias, causal: bool, scale: float) -> int:
    """The SDPBackend value torch's own SDPA picks for these tensors (MATH if unknown)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return MATH
    gqa = k.shape[1] != q.shape[1]
    try:
        return int(choose(q, k, v, bias, 0.0, causal, scale=scale, enable_gqa=gqa))
    except (RuntimeError, TypeError):  # no viable kernel, or an older signature
        return MATH


# -- torch's choice, once per shape class ----------------------------------------------

_C = torch._C
_FLAG_READERS = tuple(
    f
    for f in (
        getattr(_C, "_get_flash_sdp_enabled", None),
        getattr(_C, "_get_mem_efficient_sdp_enabled", None),
        getattr(_C, "_get_cudnn_sdp_enabled", None),
        getattr(_C, "_get_math_sdp_enabled", None),
        getattr(_C, "_get_sdp_priority_order", None),  # sdpa_kernel(..., set_priority=True)
        torch.are_deterministic_algorithms_enabled,
    )
    if f is not None
)
CHOICES_MAX = 256
_choices: dict[tuple, int] = {}  # shape class -> SDPBackend value


def _flags() -> tuple:
    """What besides the tensors decides torch's choice: the backends torch.nn.attention.
    sdpa_kernel enables and their priority, deterministic algorithms."""
    return tuple(_hashable(f()) for f in _FLAG_READERS)


def _hashable(x: object) -> object:
    return tuple(x) if isinstance(x, list) else x


def shape_class(q, k, v, bias, causal: bool) -> tuple:
    """What decides torch._fused_sdp_choice for these tensors, and nothing that changes
    from call to call of one model (the lengths of a decoding step): device, dtype, head
    size, heads, the layout of each tensor (heads or lengths outermost), the bias's dtype
    and row alignment, causality, one query or L == S, whether autograd records (and
    `choice` itself: a test that replaces it gets its own entries)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    layout = (q.stride(1) < q.stride(2), k.stride(1) < k.stride(2), v.stride(1) < v.stride(2))
    mask = None if bias is None else (bias.dtype, bias.stride(-2) % BIAS_ALIGN == 0)
    L, S = q.shape[2], k.shape[2]
    return (
        q.device, q.dtype, q.shape[3], q.shape[1], k.shape[1], layout, mask, causal,
        L == 1, L == S, grad, choice, _flags(),
    )  # fmt: skip


def chosen(q, k, v, bias, causal: bool, scale: float) -> int:
    """`choice`, asked once per shape class (torch's checks are about its kernels' limits
    on dtypes, head sizes, layouts, masks and flags, not on the lengths); a call the op
    then refuses asks again (`_run`)."""
    key = shape_class(q, k, v, bias, causal)
    picked = _choices.get(key)
    if picked is None:
        picked = choice(q, k, v, bias, causal, scale)
        if len(_choices) >= CHOICES_MAX:
            _choices.clear()
        _choices[key] = picked
    return picked


def _bias(mask, causal: bool, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device):
    """(bias, dead) for a mask (a bool keep-mask, or float: 0/-inf or additive;
    broadcasting to (B, H, L, S)) and top-left causality folded in: bias (B, H, L, S) in
    `dtype` with 16-element aligned rows (a view, stride 0 where broadcast), rows that
    see no key set to 0; dead (B|1, H|1, L|1, 1) bool marks those rows. Device ops only:
    nothing is read on the host."""
    B, H, L, S = shape
    base = tile.distinct(mask) if mask is not None else None  # (Bm, Hm, Lm, Sm)
    if causal and base is not None and base.dtype == torch.bool:
        base = base & masks.top_left(L, S, device)  # (Bm, Hm, L, S)
    elif causal:
        causal_bias = tile.causal_bias(L, S, dtype if base is None else base.dtype, device)
        base = causal_bias[None, None] if base is None else base + causal_bias  # (.., L, S)
    dead = tile.sees_no_key(base)  # (Bm, Hm, Lm, 1)
    padded = -(-S // BIAS_ALIGN) * BIAS_ALIGN
    buf = torch.empty(*base.shape[:-1], padded, dtype=dtype, device=device)[..., :S]
    if base.dtype == torch.bool:  # 0 where a key takes part (every key of a dead row)
        keep = (base | dead).expand(*base.shape[:-1], S)
        buf.fill_(-torch.inf).masked_fill_(keep, 0.0)  # (Bm, Hm, Lm, S)
    else:
        buf.copy_(base.expand(*base.shape[:-1], S).masked_fill(dead, 0.0))  # (Bm, Hm, Lm, S)
    return buf.expand(B, H, L, S), dead


def _lse(lse: torch.Tensor, B: int, H: int, L: int) -> torch.Tensor:
    """A kernel's LSE as (B, H, L): drops a trailing 1 and the padding along L."""
    return lse.reshape(B, H, -1)[..., :L]


def _expand_heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, H, S, D), query head h on key/value head h // (H // Hkv)."""
    return t if t.shape[1] == H else t.repeat_interleave(H // t.shape[1], dim=1)


_ops: dict[str, object] = {}  # op name -> its OpOverload, looked up once


def _op(name: str):
    """torch.ops.aten's `name`.default (an OpOverload: no overload resolution per call)."""
    op = _ops.get(name)
    if op is None:
        op = _ops[name] = aten.op(name).default
    return op


def _flash(q, k, v, bias, causal, scale):
    out = _op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _efficient(q, k, v, bias, causal, scale):
    op = _op("_scaled_dot_product_efficient_attention")
    out = op(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out[0], out[1]


_cudnn_names: list[frozenset[str]] = []  # the cuDNN op's argument names (they vary)


def _cudnn(q, k, v, bias, causal, scale):
    op = _op("_scaled_dot_product_cudnn_attention")
    if not _cudnn_names:
        _cudnn_names.append(frozenset(a.name for a in op._schema.arguments))
    names = _cudnn_names[0]
    kwargs = {"dropout_p": 0.0, "is_causal": causal, "return_debug_mask": False, "scale": scale}
    if "attn_bias" in names:
        kwargs["attn_bias"] = None
    if "compute_log_sumexp" in names:
        kwargs["compute_log_sumexp"] = True
    out = op(q, k, v, **{n: x for n, x in kwargs.items() if n in names})
    return out[0], out[1]


def _math(q, k, v, bias, causal, scale):
    """The listing in plain torch by the tile rule, float32 softmax for 16-bit inputs;
    differentiable."""
    L, S = q.shape[2], k.shape[2]
    window = tile.window(masks.and_top_left(bias) if causal else bias, L, S, device=q.device)
    out, lse, _ = tile.attend(q, k, v, window, tile.Scoring(scale))
    return out, lse  # (B, H, L, D), (B, H, L)


_RUN = {FLASH: _flash, EFFICIENT: _efficient, CUDNN: _cudnn}


def _run(picked: int, q, k, v, bias, causal: bool, scale: float):
    """The op `picked` (the math path for MATH); where the op refuses a choice made for
    this shape class, torch is asked again for these very tensors."""
    run = _RUN.get(picked, _math)
    if run is _math:
        return _math(q, k, v, bias, causal, scale)
    try:
        return run(q, k, v, bias, causal, scale)
    except RuntimeError:
        fresh = choice(q, k, v, bias, causal, scale)
        if fresh == picked:
            raise
        _choices[shape_class(q, k, v, bias, causal)] = fresh
        return _RUN.get(fresh, _math)(q, k, v, bias, causal, scale)


def kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, L, D) and LSE (B, H, L) of attention on CUDA tensors.

    q (B, H, L, D), k and v (B, Hkv, S, D): one head size, a multiple of 8, unit last
    stride. mask: None, bool (True = takes part) or float (0/-inf for a keep-mask, else
    added), broadcasting to (B, H, L, S). causal: top-left. Rows that see no key give
    output 0 and LSE 0. Never reads a value on the host.
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    if mask is None and (not causal or L == S):  # the lean call: the op, as torch picks it
        picked = chosen(q, k, v, None, causal, scale)
        if picked == FLASH or (picked in _RUN and k.shape[1] == H):
            out, lse = _run(picked, q, k, v, None, causal, scale)
            return out, _lse(lse, B, H, L)
    fold = causal and (mask is not None or L != S)
    # the kernels take the bias in the input dtype: a float32 bias for 16-bit inputs
    # would be rounded, and the weights (rebuilt with the float32 bias) would disagree
    exact = mask is not None and mask.is_floating_point() and mask.dtype != q.dtype
    bias, dead = (None, None)
    if mask is not None or fold:
        bias_dtype = mask.dtype if exact else q.dtype
        bias, dead = _bias(mask, fold, bias_dtype, (B, H, L, S), q.device)
    causal = causal and not fold
    picked = MATH if exact else chosen(q, k, v, bias, causal, scale)
    if picked != FLASH and k.shape[1] != H:  # only flash takes fewer key/value heads
        k, v = _expand_heads(k, H), _expand_heads(v, H)  # (B, H, S, D)
        if picked not in _RUN and not exact:  # the efficient op may take them now
            picked = chosen(q, k, v, bias, causal, scale)
    if picked == CUDNN and bias is not None:
        picked = EFFICIENT
    out, lse = _run(picked, q, k, v, bias, causal, scale)
    lse = _lse(lse, B, H, L)
    if dead is not None:  # the edge convention, whatever the op gave those rows
        out, lse = tile.zero_dead(out, lse, dead)
    return out, lse
