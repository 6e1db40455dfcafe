"""PyTorch's own fused kernel, through the op that also returns the log-sum-exp.

On CPU that is `aten._scaled_dot_product_flash_attention_for_cpu`: it wants 4-D
(B, H, L, D) tensors with one head size D for q, k and v, each with a unit stride in its
last dim (it silently misreads others), a float mask (bool masks
become 0/-inf), and has no dropout. Different head sizes are padded with zeros (which
changes no score and no output column) and the output sliced back. Its backward is
registered, so autograd works through it. On CUDA, `sdpa.backends.cuda` runs the
flash / memory-efficient / cuDNN op torch itself would pick (head sizes padded to a
multiple of 8, as torch pads them). `_KERNELS` is keyed by device type; block skipping
works the same on every device. Attention sinks (`sdpa.masks.sinks`) correct each
call's output and LSE exactly (`tile.add_sinks`); a softcap cannot run here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sdpa import masks, tile
from sdpa.backends import aten, blocks, cuda
from sdpa.backends.base import Backend
from sdpa.backends.reference import Reference
from sdpa.errors import NotSupportedError
from sdpa.inputs import Inputs, no_work, sink_rows


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The CPU kernel silently misreads a last dim whose stride is not 1. Any other
    layout it takes as it is: its backward lays an output gradient out as it wants
    ((B, L, H, D) in memory, what a model's transposed output hands back), so a copy to
    (B, H, L, D) here would be one more pass, then undone by the kernel's own."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _cpu_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if sinks is None:
        return aten.CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return _CpuSinks.apply(q, k, v, mask, causal, scale, sinks)


class _CpuSinks(torch.autograd.Function):
    """torch's CPU flash kernel with sinks, differentiable in q, k and v.

    Forward: the kernel's (out, lse), the sink merged on top (tile.add_sinks: out' =
    out * sigma, sigma = exp(lse - lse'), lse' = logaddexp(lse, z)). Backward: the
    kernel's own backward given out' and lse' is exact, because the sink's value is 0
    (it adds nothing to dP and D_i = dO_i . out'_i). The sinks' own gradient is taken
    apart, for every engine alike (sdpa.backends.run): here they are constants."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, sinks):
        raw, lse = aten.CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        out, lse_s = tile.add_sinks(raw, lse, sinks.detach())
        ctx.save_for_backward(q, k, v, mask, out, lse_s)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse_s)
        return out, lse_s

    @staticmethod
    def backward(ctx, dout, _dlse):
        if ctx.needs_input_grad[6]:
            raise NotSupportedError(
                "internal: the fused kernel was given sinks that require grad; their "
                "gradient is taken by sdpa.backends.run, which hands the engine constants"
            )
        q, k, v, mask, out, lse = ctx.saved_tensors
        dq, dk, dv = aten.CPU_FLASH_BACKWARD(
            _unit_stride(dout), q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask,
            scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def _cuda_kernel(q, k, v, mask, causal, scale, sinks=None):
    """cuda.kernel, with sinks applied to its result (not_supported_reasons keeps
    gradients away: they would miss the LSE's share)."""
    out, lse = cuda.kernel(q, k, v, mask, causal, scale)
    return (out, lse) if sinks is None else tile.add_sinks(out, lse, sinks)


Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_KERNELS: dict[str, Kernel] = {"cpu": _cpu_kernel, "cuda": _cuda_kernel}
_HEAD_ALIGN = {"cuda": cuda.HEAD_ALIGN}  # head sizes the device's kernels take


def _prepare(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unit last strides and one head size D (a multiple of the device's alignment):
    smaller ones zero-padded (zero features add nothing to q.k, zero value columns are
    sliced off the output)."""
    q, k, v = _unit_stride(inputs.query), _unit_stride(inputs.key), _unit_stride(inputs.value)
    E, Ev = q.shape[-1], v.shape[-1]
    D = max(E, Ev)
    align = None if q.is_cpu else _HEAD_ALIGN.get(q.device.type)
    if align is not None:
        D = -(-D // align) * align
    return aten.pad_to(q, D), aten.pad_to(k, D), aten.pad_to(v, D)  # (B, H, X, D) each


def _piece_mask(inputs: Inputs, p: blocks.Piece, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU kernel's additive mask of one piece, or None where it sees every key."""
    return tile.additive(blocks.keep(inputs, p), dtype) if p.masked else None


class _CpuPieces(torch.autograd.Function):
    """The block plan's CPU kernel calls as one autograd node (no sinks): the forward
    writes each piece's (out, lse) into whole ones; the backward runs the kernel's own
    backward per piece into whole dq, dk and dv. (Autograd through the pieces' slices
    would zero-fill and add a whole (B, H, L, D) gradient per piece and input: at
    (8, 12, 512, 32), 48 such passes a step, a fifth of its time.) The masks are
    rebuilt in the backward rather than kept."""

    @staticmethod
    def forward(ctx, q, k, v, inputs, pieces):
        B, H, L, _ = q.shape
        out = q.new_zeros(B, H, L, v.shape[-1])
        lse = q.new_zeros(B, H, L, dtype=inputs.compute_dtype)
        for p in pieces:
            if p.k1 > p.k0:  # (rows that see no key: out 0, lse 0, as made)
                rows = (p.batch, slice(None), slice(p.q0, p.q1))
                kv = (p.batch, slice(None), slice(p.k0, p.k1))
                o, s = aten.CPU_FLASH(
                    q[rows], k[kv], v[kv], 0.0, False,
                    attn_mask=_piece_mask(inputs, p, q.dtype), scale=inputs.scale,
                )  # fmt: skip
                out[rows], lse[rows] = o, s
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.inputs, ctx.pieces = inputs, pieces
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for p in ctx.pieces:
            if p.k1 == p.k0:
                continue
            rows = (p.batch, slice(None), slice(p.q0, p.q1))
            kv = (p.batch, slice(None), slice(p.k0, p.k1))
            gq, gk, gv = aten.CPU_FLASH_BACKWARD(
                _unit_stride(dout[rows]), q[rows], k[kv], v[kv], out[rows], lse[rows], 0.0,
                False, attn_mask=_piece_mask(ctx.inputs, p, q.dtype), scale=ctx.inputs.scale,
            )  # fmt: skip
            dq[rows] = gq  # (each query row is in one piece)
            dk[kv] += gk
            dv[kv] += gv
        return dq, dk, dv, None, None


def _run_pieces(
    inputs: Inputs, pieces: list[blocks.Piece], q, k, v, kernel: Kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel call per piece; pieces tile (batch, query rows) exactly once. On CPU
    without sinks, under autograd, one node for them all (_CpuPieces)."""
    if (
        kernel is _cpu_kernel and inputs.sinks is None and aten.CPU_FLASH_BACKWARD is not None
        and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):  # fmt: skip
        return _CpuPieces.apply(q, k, v, inputs, pieces)
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for p in pieces:
        qp = q[p.batch, :, p.q0 : p.q1]  # (b, Hq, r, D)
        sinks = sink_rows(inputs.sinks, slice(p.q0, p.q1))
        sinks = None if sinks is None else sinks[p.batch]  # (b, Hq, r|1)
        if p.k1 == p.k0:  # sees no key: the tile rule's convention
            out, lse = tile.no_keys(qp, v.shape[-1], sinks, inputs.compute_dtype)
        else:
            mask = blocks.keep(inputs, p) if p.masked else None  # (bool: the CUDA glue's)
            mask = tile.additive(mask, q.dtype) if q.is_cpu else mask
            kp, vp = k[p.batch, :, p.k0 : p.k1], v[p.batch, :, p.k0 : p.k1]
            out, lse = kernel(qp, kp, vp, mask, False, inputs.scale, sinks)
        groups.setdefault((p.batch.start, p.batch.stop), []).append((out, lse))
    outs = [_joined([o for o, _ in g], 2) for g in groups.values()]  # along queries
    lses = [_joined([s for _, s in g], 2) for g in groups.values()]
    return _joined(outs, 0), _joined(lses, 0)  # along batch


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat of parts along dim, a lone part as it is (a copy of it would be one
    more pass over the output)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _one_masked_call(pieces: list[blocks.Piece], S: int) -> bool:
    """The plan is the plain call: every row, every key, with the mask."""
    return len(pieces) == 1 and pieces[0].masked and (pieces[0].k0, pieces[0].k1) == (0, S)


class Plan(NamedTuple):
    """Which kernel calls the fused backend makes for some inputs: the one decision that
    `run` executes, `path` renders (served_by, sdpa.explain) and the fast lane tests.

    call: "empty" (no score to compute: zeros), "one" (one kernel call over every row
    and key) or "pieces" (the block plan's calls). mask: for "one", what the call is
    given: None, a tensor, or a structured part to materialise (whole: "with the mask
    whole"). causal: the kernel's own causal path (top-left). pieces: for "pieces"."""

    call: str
    mask: torch.Tensor | masks.Mask | masks.TensorAnd | None = None
    causal: bool = False
    pieces: list[blocks.Piece] | None = None
    whole: bool = False  # a structured part materialised for the one call
    direct: bool = False  # one call with the mask as it is: the fast lane (set by _plan)


_new = tuple.__new__


def _plan(call: str, mask=None, causal: bool = False, pieces=None, whole: bool = False) -> Plan:
    """A Plan, `direct` derived from the rest (one call, nothing materialised), made
    without the named tuple's keyword handling (plan runs on every call)."""
    direct = call == "one" and not whole
    return _new(Plan, (call, mask, causal, pieces, whole, direct))


_UNMASKED, _CAUSAL, _EMPTY = _plan("one"), _plan("one", None, True), _plan("empty")
_REFERENCE = Reference()


def plan(inputs: Inputs, sizes: tuple[int, int, int] | None = None) -> Plan:
    """The kernel calls for `inputs`: the common calls (no mask, causal=True, a tensor
    mask the kernel takes whole, with or without causal=True) decided in O(1) from the
    mask's type and shapes; the rest from the block plan (read on the host on CPU, from
    the masks' host-side spans elsewhere). sizes: (Hq, L, S), where the caller has them."""
    q, mask = inputs.query, inputs.mask
    if sizes is None:
        _, Hq, L, _ = q.shape
        S = inputs.key.shape[2]
    else:
        Hq, L, S = sizes
    if no_work(Hq, L, S):  # torch's kernels crash on 0 heads, queries or keys
        return _EMPTY
    if mask is None:
        return _UNMASKED
    if mask is masks.TOP_LEFT:
        return _CAUSAL
    rest, causal = masks.causal_flag(mask, L, S)  # top-left causality as the kernel's flag
    tensor = isinstance(rest, torch.Tensor)
    if rest is None or (tensor and blocks.whole(rest, L, q.is_cpu)):
        return _plan("one", rest, causal)  # no block to skip
    pieces = blocks.pieces(inputs)
    if pieces is None or _one_masked_call(pieces, S) or all(p.k1 == p.k0 for p in pieces):
        # one call (a plan with no kernel call at all would cut the output from autograd)
        if tensor:
            return _plan("one", rest, causal)
        return _plan("one", mask, False, whole=True)
    return _plan("pieces", pieces=pieces)


class Fused(Backend):
    name = "fused"

    def path(self, inputs: Inputs) -> str:
        """What `run` does with these inputs, in words (from `plan`)."""
        op = "torch's CPU flash kernel" if inputs.query.is_cpu else "torch's fused CUDA op"
        sinks = ", sinks merged on top" if inputs.sinks is not None else ""
        how = plan(inputs)
        if how.call == "empty":
            return "no score to compute: zeros"
        if how.call == "pieces":
            calls = sum(p.k1 > p.k0 for p in how.pieces)
            return f"block plan: {calls} calls of {op} on the visible key spans{sinks}"
        if how.whole:
            return f"one call of {op} with the mask whole{sinks}"
        masked = " with the mask" if how.mask is not None else ""
        causal = " on its own causal path" if how.causal else ""
        return f"one call of {op}{masked}{causal}{sinks}"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        q = inputs.query  # (is_cpu / is_cuda: a tenth of device.type's time, asked per call)
        device = "cpu" if q.is_cpu else "cuda" if q.is_cuda else q.device.type
        if device not in _KERNELS:
            reasons.append(f"inputs on {device} (the fused backend runs on: {', '.join(_KERNELS)})")
        elif device == "cpu" and (
            aten.CPU_FLASH is None or (inputs.sinks is not None and aten.CPU_FLASH_BACKWARD is None)
        ):  # (the backward op serves the sinks' correction; torch differentiates the rest)
            reasons.append(
                f"this torch ({torch.__version__}) has no {' or '.join(aten.missing_cpu_ops())} "
                f"(a private op, renamed or removed)"
            )
        if inputs.dropout_p > 0 and device == "cpu":
            reasons.append(
                f"dropout_p={inputs.dropout_p} > 0 on CPU (torch's fused CPU kernel has no dropout)"
            )
        elif inputs.dropout_p > 0:
            reasons.append(
                f"dropout_p={inputs.dropout_p} > 0 on {device} (the fused path runs without "
                f"dropout; the reference backend applies it)"
            )
        if inputs.softcap is not None:
            reasons.append(
                f"softcap={inputs.softcap} (torch's fused kernels cannot cap the scores; the "
                f"chunked backend applies it tile by tile)"
            )
        sinks = inputs.sinks
        if (
            sinks is not None
            and device != "cpu"
            and torch.is_grad_enabled()
            and (sinks.requires_grad or any(t.requires_grad for t in inputs[:3]))
        ):
            reasons.append(
                f"sinks with gradients on {device} (the sink correction is differentiated "
                f"through the kernel's backward on CPU only)"
            )
        tensor = inputs.tensor_mask
        if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
            reasons.append(
                "a float mask that requires grad (torch's fused kernel has no gradient for "
                "attn_mask)"
            )
        return reasons

    def run(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The plan's calls, with a direct plan on the calls made most (no sinks, one head
        size, unit last strides; on CUDA no mask) sent straight to the kernel, decided
        from shapes in well under a microsecond.

        On CPU that is torch's own binding of the LSE-returning op, which costs what
        F.scaled_dot_product_attention costs (0.96-1.00x at every decoding shape of
        benchmarks/bench_decode.py; torch.ops' dispatch of the same op costs 1.2x), and
        with a bool mask less (its additive form cached: 0.79-0.99x F.sdpa given the
        bool mask, which converts it on every call): so the output never comes from
        F.sdpa with the LSE left for later (docs/guide/gpu-lean-entry.md)."""
        q, k, v, _, scale = inputs[:5]
        B, H, L, E = q.size()
        _, _, S, Ev = v.size()
        how = plan(inputs, (H, L, S))
        if how.direct and inputs.sinks is None and H.__class__ is int and E == Ev and E > 1:
            plain = (  # every size a plain int (is_contiguous would guard on a traced one)
                B.__class__ is int and L.__class__ is int and S.__class__ is int
                and E.__class__ is int
            )  # fmt: skip
            if (plain and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or (
                q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1
            ):  # (unit last strides: read from contiguity where sizes are plain ints)
                if q.is_cpu:
                    mask = how.mask
                    if mask is not None:
                        mask = tile.additive(mask, q.dtype)  # (cached for a bool mask)
                    out, lse = aten.CPU_FLASH(q, k, v, 0.0, how.causal, attn_mask=mask, scale=scale)
                    return out, lse, None
                if how.mask is None and E % cuda.HEAD_ALIGN == 0 and q.is_cuda:
                    out, lse = cuda.kernel(q, k, v, None, how.causal, scale)
                    return out, lse, None
        out, lse = self.forward(inputs, how)
        return out, lse, None

    def forward(self, inputs: Inputs, how: Plan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        how = plan(inputs) if how is None else how
        if how.call == "empty":
            return _REFERENCE.forward(inputs)  # nothing to compute: zeros, differentiable
        on_cpu = inputs.query.is_cpu
        kernel = _cpu_kernel if on_cpu else _KERNELS[inputs.query.device.type]
        q, k, v = _prepare(inputs)
        Ev = inputs.value.shape[-1]
        if how.call == "pieces":
            out, lse = _run_pieces(inputs, how.pieces, q, k, v, kernel)
            return out[..., :Ev], lse
        mask = how.mask
        if how.whole:  # (B|1, H|1, L, S): the structured part materialised, the tensor ANDed
            mask = tile.window(mask, q.shape[2], k.shape[2], device=q.device)
        # (the CPU kernel takes a float mask, converted once and cached; the CUDA glue
        # takes a bool mask as it is, with no cache keyed on device pointers)
        mask = tile.additive(mask, q.dtype) if on_cpu else mask
        out, lse = kernel(q, k, v, mask, how.causal, inputs.scale, inputs.sinks)
        return (out if out.shape[-1] == Ev else out[..., :Ev]), lse
