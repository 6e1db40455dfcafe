"""Backend registry: `select(inputs, name)` picks who runs an attention call.

"auto" takes the first backend in `PRIORITY` that supports the inputs (small: the
listing's math in one product, keeping the weights, for small scores on CPU; fused: torch's
kernels; chunked: the reference math in row chunks, for softcap and gradients of float
masks; reference: everything, dropout on CPU included); an explicit
name never falls back, and when nothing fits the error lists every backend's reasons.
"""

from __future__ import annotations

import torch

from sdpa import masks, tile
from sdpa.backends import aten
from sdpa.backends.base import Backend, NotSupportedError
from sdpa.backends.chunked import Chunked
from sdpa.backends.fused import Fused
from sdpa.backends.reference import Reference
from sdpa.backends.small import Small, fits
from sdpa.errors import SdpaValueError
from sdpa.inputs import Inputs

PRIORITY: tuple[Backend, ...] = (Small(), Fused(), Chunked(), Reference())
BACKENDS: dict[str, Backend] = {b.name: b for b in PRIORITY}
_SMALL, _FUSED = BACKENDS["small"], BACKENDS["fused"]


def select_fast(inputs: Inputs) -> Backend:
    """`select(inputs)` for inputs from `fast_normalize` (no dropout, softcap, sinks or
    mask gradient; CPU or CUDA), decided in O(1): on CPU small where it fits, else fused
    (where this torch lacks the fused CPU op, `select` decides); on CUDA fused, once its
    `not_supported_reasons` (a few attribute reads) say it runs them, else `select`."""
    if inputs[0].is_cpu:  # (the query)
        if fits(inputs):
            return _SMALL
        if aten.CPU_FLASH is None:
            return select(inputs)
        return _FUSED
    if _FUSED.not_supported_reasons(inputs):
        return select(inputs)
    return _FUSED


def _describe(reasons: dict[str, list[str]]) -> str:
    return "; ".join(f"{name}: {', '.join(r)}" for name, r in reasons.items())


def select(inputs: Inputs, name: str = "auto", priority: tuple[Backend, ...] = PRIORITY) -> Backend:
    """The backend that runs `inputs`; raises NotSupportedError naming every reason."""
    if name == "auto":
        reasons: dict[str, list[str]] = {}
        for backend in priority:
            why = backend.not_supported_reasons(inputs)
            if not why:
                return backend
            reasons[backend.name] = why
        raise NotSupportedError(f"no backend can run these inputs. {_describe(reasons)}")
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if backend is None:
        raise SdpaValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    why = backend.not_supported_reasons(inputs)
    if why:
        raise NotSupportedError(
            f"backend {name!r} cannot run these inputs ({_describe({name: why})}); "
            f"backend='auto' picks one that can"
        )
    return backend


def run(
    backend: Backend, inputs: Inputs
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """backend.run(inputs), the sinks' gradient taken apart where they want one: the
    engine runs with the sinks held constant (its q, k, v gradients are exact so) and
    the sinks get theirs from `_SinkGrad`, every engine alike. With dropout the
    engine's own autograd differentiates them (the dropped pattern is not recomputed)."""
    sinks = inputs.sinks
    if (
        sinks is None
        or not sinks.requires_grad
        or not torch.is_grad_enabled()
        or inputs.dropout_p > 0
    ):
        return backend.run(inputs)
    out, lse, p = backend.run(inputs._replace(sinks=sinks.detach()))
    return _SinkGrad.apply(out, sinks, inputs), lse, p


class _SinkGrad(torch.autograd.Function):
    """The output unchanged; backward: the output's gradient, and the sinks' from the
    output and LSE recomputed in float64 (tile.sink_grad). In float32 the sum over rows
    of p_sink (dO . out) from float32 terms was up to 3x the listing's error on
    flash-attention's test matrix (its rule allows 2x); the float64 pass costs about
    2.5 float32 forwards and runs only where the sinks want a gradient."""

    @staticmethod
    def forward(ctx, out, sinks, inputs):
        ctx.save_for_backward(inputs.query, inputs.key, inputs.value, inputs.tensor_mask, sinks)
        ctx.inputs = inputs
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, sinks = ctx.saved_tensors  # (torch's in-place check)
        dsinks = None
        if ctx.needs_input_grad[1]:
            f64 = torch.float64
            if mask is not None and mask.is_floating_point():
                mask = mask.detach().to(f64)
            exact = ctx.inputs._replace(
                query=q.detach().to(f64), key=k.detach().to(f64), value=v.detach().to(f64),
                mask=masks.join(mask, ctx.inputs.structured), sinks=sinks.detach().to(f64),
            )  # fmt: skip
            engine = _FUSED if q.is_cpu and not _FUSED.not_supported_reasons(exact) else None
            with torch.no_grad():
                out, lse, _ = (engine or BACKENDS["chunked"]).run(exact)
            dsinks = tile.sink_grad(dout, out, lse, exact.sinks).to(sinks.dtype)
        return dout, dsinks, None


__all__ = ["BACKENDS", "PRIORITY", "Backend", "NotSupportedError", "run", "select", "select_fast"]
