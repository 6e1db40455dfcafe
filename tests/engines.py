"""The engines every oracle matrix runs, in one place.

    small      the kept weights: the listing's math in one product (reads are torch ops
               on those weights), at the small backend's real thresholds
    fused      torch's fused kernel and its LSE, read by the rows engine (sdpa.rows)
    chunked    the reference math over row chunks and its LSE, read by the rows engine
    reference  the listing's math materialised and its LSE, read by the rows engine
    triton     the fused kernel's LSE, the statistics from the Triton kernels (run by
               Triton's interpreter on CPU: slow, for small sizes)

`run(engine, q, k, v, mask, **kw)` gives (output, weights, the settings its reads run
under: a reusable `with` block); `refusal(...)` why an engine does not take some
inputs ("" where it does), for a skip that names the reason.
"""

from __future__ import annotations

import sdpa
from sdpa import masks, settings
from sdpa.backends import BACKENDS, small
from sdpa.inputs import normalize

ENGINES = ("small", "fused", "chunked", "reference", "triton")
BACKEND_ENGINES = ENGINES[:4]
# the small backend's real thresholds (the suite turns it off elsewhere: conftest)
KEPT = {"small_weights": 2**21, "small_head": 2**16, "small_causal": 2**14}


class Reads:
    """The settings an engine's reads run under, as a reusable `with` block."""

    def __init__(self, changes: dict):
        self.changes = changes

    def __enter__(self):
        self.block = settings.override(**self.changes)
        return self.block.__enter__()

    def __exit__(self, *exc):
        return self.block.__exit__(*exc)


def backend_of(engine: str) -> str:
    return "fused" if engine == "triton" else engine


def reads_of(engine: str) -> Reads:
    return Reads(
        KEPT if engine == "small" else {"kernel_devices": {"cpu"}} if engine == "triton" else {}
    )


def run(engine: str, q, k, v, mask=None, **kw):
    """(output, weights, Reads) of `engine`'s call."""
    reads = reads_of(engine)
    with Reads(KEPT if engine == "small" else {}):
        out, w = sdpa.attention(q, k, v, mask, backend=backend_of(engine), **kw)
    return out, w, reads


def refusal(engine: str, q, k, v, mask=None, **kw) -> str:
    """Why `engine` does not take these inputs, in its own words ("" where it does)."""
    with Reads(KEPT if engine == "small" else {}):
        inputs = normalize(q, k, v, mask, **kw)
        why = BACKENDS[backend_of(engine)].not_supported_reasons(inputs)
        if engine == "small" and not why and not small.fits(inputs):
            why = ["over the small backend's thresholds"]
    if engine == "triton" and isinstance(mask, masks.ScoreMod):
        why = [*why, "the Triton kernels score plain q . k (no softcap or sinks)"]
    return "; ".join(why)
