"""Backend registry: `select(inputs, name)` picks who runs an attention call.

"auto" takes the first backend in `PRIORITY` that supports the inputs (small: the
listing's math in one product, keeping the weights, for small scores on CPU; fused: torch's
kernels; chunked: the reference math in row chunks, for softcap and gradients of float
masks; reference: everything, dropout on CPU included); an explicit
name never falls back, and when nothing fits the error lists every backend's reasons.
"""

from __future__ import annotations

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


__all__ = ["BACKENDS", "PRIORITY", "Backend", "NotSupportedError", "select", "select_fast"]
