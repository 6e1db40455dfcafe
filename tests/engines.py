"""The engines every oracle matrix runs, in one place.

The backends come from the registry (sdpa.backends.PRIORITY, auto's order), so a backend
added there runs in every oracle file without an edit to any test; the engines that are
not backends follow them:

    small      the kept weights: the listing's math in one product (reads are torch ops
               on those weights), at the small backend's real thresholds
    fused      torch's fused kernel and its LSE, read by the rows engine (sdpa.rows)
    chunked    the reference math over row chunks and its LSE, read by the rows engine
    reference  the listing's math materialised and its LSE, read by the rows engine
    triton     the fused kernel's LSE, the statistics from the Triton kernels (run by
               Triton's interpreter on CPU: slow, for small sizes)

The sets a test parametrizes over, each named by what its engines have in common:

    ENGINES          every engine: the backends, then the engines that are not backends
    BACKEND_ENGINES  the engines with a forward of their own (each backend once): for
                     outputs, and reads no kernel serves (the others repeat a backend)
    KERNEL_ENGINES   the engines that are a backend's forward with other reads (triton)

A test runs over one of these and skips, in the engine's own words, what the engine
refuses (`refusal`, `skip_refused`), rather than naming the engines that take its inputs:
tests/test_engines_listed.py fails where a test file lists two backends by name.

`run(engine, q, k, v, mask, **kw)` gives (output, weights, the settings its reads run
under: a reusable `with` block); `refusal(...)` why an engine does not take some
inputs ("" where it does), for a skip that names the reason. Both take "auto" too (the
dispatcher, under the suite's settings).
"""

from __future__ import annotations

import pytest

import sdpa
from sdpa import masks, settings
from sdpa.backends import BACKENDS, PRIORITY, NotSupportedError, select, small
from sdpa.inputs import normalize

BACKEND_ENGINES = tuple(backend.name for backend in PRIORITY)
KERNEL_ENGINES = ("triton",)
ENGINES = (*BACKEND_ENGINES, *KERNEL_ENGINES)
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
    """The backend= that runs `engine`'s forward (a kernel engine's is the fused one)."""
    return "fused" if engine in KERNEL_ENGINES else engine


def _call_settings(engine: str) -> dict:
    return KEPT if engine == "small" else {}


def reads_of(engine: str) -> Reads:
    return Reads(
        KEPT if engine == "small" else {"kernel_devices": {"cpu"}} if engine == "triton" else {}
    )


def run(engine: str, q, k, v, mask=None, **kw):
    """(output, weights, Reads) of `engine`'s call."""
    reads = reads_of(engine)
    with Reads(_call_settings(engine)):
        out, w = sdpa.attention(q, k, v, mask, backend=backend_of(engine), **kw)
    return out, w, reads


def refusal(engine: str, q, k, v, mask=None, **kw) -> str:
    """Why `engine` does not take these inputs, in its own words ("" where it does)."""
    with Reads(_call_settings(engine)):
        inputs = normalize(q, k, v, mask, **kw)
        if engine == "auto":
            try:
                select(inputs)
            except NotSupportedError as e:
                return str(e)
            return ""
        why = BACKENDS[backend_of(engine)].not_supported_reasons(inputs)
        if engine == "small" and not why and not small.fits(inputs):
            why = ["over the small backend's thresholds"]
    if engine == "triton" and isinstance(mask, masks.ScoreMod):
        why = [*why, "the Triton kernels score plain q . k (no softcap or sinks)"]
    return "; ".join(why)


def skip_refused(engine: str, q, k, v, mask=None, **kw) -> None:
    """Skip the test, naming the engine's reason, where `engine` refuses these inputs."""
    why = refusal(engine, q, k, v, mask, **kw)
    if why:
        pytest.skip(f"{engine}: {why}")


def run_or_skip(engine: str, q, k, v, mask=None, **kw):
    """`run`, after `skip_refused`: (output, weights, Reads) where the engine takes the
    inputs; the test skips, naming the engine's reason, where it does not."""
    skip_refused(engine, q, k, v, mask, **kw)
    return run(engine, q, k, v, mask, **kw)
