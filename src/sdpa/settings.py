"""Tuning settings: the sizes and limits where sdpa switches engines, in one object.

Engines read the settings of the current context (`sdpa.settings.get()`) wherever
they need one, so one call may read them at several points (the backend's choice, each
read's tile size, a kernel's eligibility): a call and each later read of its weights
run with the settings in force when they run, and a read's backward with those of its
forward. `override` changes some of them inside a `with` block, for this thread or
asyncio task only (a `contextvars.ContextVar`), and restores them on exit. The
defaults were measured on CPU with benchmarks/; none changes a result beyond rounding,
only which engine computes it and how much memory it takes at once.

    with sdpa.settings.override(chunk_bytes=2**20):   # smaller tiles, less memory
        w.sum(dim=-2)
    sdpa.settings.get().chunk_bytes                   # 4194304 again

Lowest layer: imports only sdpa.errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

from sdpa.errors import SdpaTypeError, SdpaValueError

__all__ = ["Settings", "get", "override", "using"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """sdpa's tuning settings (read with `get()`, changed with `override(...)`).

    Each field says what it trades, its unit and its default.
    """

    chunk_bytes: int = 4 * 2**20
    """Working memory (bytes) of one chunk of query rows (tile.chunk_rows, the one place a
    tile size is chosen): a tile of the weights engine (rows, sums, entropy, top-k of
    AttentionWeights, their backward), a chunk of the chunked backend and of ring
    attention's plain-torch block kernels. Tiles that stay in cache make the passes over
    them fast: measured on CPU at (1, 4, 4096, 32), 4 MiB tiles read entropy and sums
    1.2-4x faster than 64 MiB ones, and the chunked backend's softcap calls at (1, 8, 2048,
    64) 1.3-2x faster. Single-pass statistics over long rows (a read's forward: sums,
    entropy, top-k, amax, u @ w, max logits) take tiles of 256 rows where that fits in 4x
    this (rows.stat_budget: at 16384 keys, 64 rows ran 1.1-1.4x slower), the entropy
    blocks of keys of this size in tiles of up to 2048 rows (rows.pieces); and the weights
    engine folds every head of a batch element into one tile where their complete rows
    fit in 4x this (rows._step: the KL reads and backward of an 8 x 512 distillation
    step made 26,095 aten ops instead of 66,099). Default 4 MiB."""

    exact_lse_limit: float = 32.0
    """Weights engine: rows whose |lse| exceeds this (a large finite bias such as -1e9,
    scores in the hundreds), where a float32 LSE has lost digits, take their own row max
    as the shift instead of the LSE; reads of chosen keys, which cannot, read such rows
    whole. Lower: more rows so treated (slower, never less exact). Unit: nats.
    Default 32."""

    kernel_devices: frozenset[str] = frozenset({"cuda"})
    """Device types where the Triton kernels serve weights statistics (entropy, received
    attention); elsewhere the chunked weights engine does. An empty set runs the chunked
    engine everywhere (the kernels' reference). Default {"cuda"}."""

    kernel_mask_bytes: int = 64 * 2**20
    """A structured mask is materialised (bool) for the Triton kernels up to this many
    bytes; past it the chunked engine, one tile at a time, serves. Default 64 MiB."""

    kernel_lse_limit: float = 1024.0
    """The received-attention kernel serves rows with |lse| up to this; past it (a huge
    finite bias) the chunked engine recomputes them exactly. Unit: nats. Default 1024."""

    mask_chunk_bytes: int = 16 * 2**20
    """Ring attention: bytes of bool keep-mask plus float bias materialised at once for
    a chunk of query rows when planning a shard's calls. Default 16 MiB."""

    lazy_chunk_bytes: int = 16 * 2**20
    """Lazy expressions of the weights (sdpa.lazy: `(w * keep).sum(-1)`, `w.mT.amax(-2)`):
    bytes of one chunk of query rows evaluated at once, every read and op of the
    expression on it counted. Each chunk is several reads of the weights engine and
    torch ops, so larger chunks cost less per row, up to where the heap fragments:
    measured on CPU at (2, 3, 16384, 16384), `(w > 0.1).sum(-1)` took 6.8 s in 8 MiB
    chunks, 4.3 s in 16 MiB and 4.0 s in 32 MiB, its peak 15 MiB at 16 MiB and 62 MiB at
    32 MiB (`w.sum(-1)`, a lazy read of its own: 0.9 s). Default 16 MiB."""

    small_weights: int = 2**21
    """Largest B * Hq * L * S (scores) the small backend takes (the listing's math in
    one product, weights kept): past it torch's fused kernel is faster on CPU. 0 turns
    the small backend off. Default 2**21."""

    small_head: int = 2**16
    """Largest L * S of one head the small backend takes (its scores must stay in
    cache). 0 turns the small backend off. Default 2**16."""

    small_causal: int = 2**14
    """Largest L * S per head the small backend takes under causal or structured
    masking (the fused kernel skips the masked half of the work, the product cannot).
    Default 2**14."""

    one_product_weights: int = 2**16
    """Lazy weights up to this many scores (B * Hq * L * S) are computed whole, in one
    product, the first time any is read: below the weights engine's fixed cost per
    call. 0 turns it off. Default 2**16."""


_INTS = ("chunk_bytes", "kernel_mask_bytes", "mask_chunk_bytes", "lazy_chunk_bytes")
_COUNTS = ("small_weights", "small_head", "small_causal", "one_product_weights")
_LIMITS = ("exact_lse_limit", "kernel_lse_limit")
_NAMES = tuple(f.name for f in dataclasses.fields(Settings))

# (the default is frozen: immutable, so one instance serves every context)
_CURRENT: ContextVar[Settings] = ContextVar("sdpa_settings", default=Settings())  # noqa: B039

get = _CURRENT.get
"""The settings of the current context (thread / asyncio task): `sdpa.settings.get()`."""


def _checked(name: str, value: object) -> object:
    """value if it suits the field `name`, else a clear error."""
    if name in _INTS or name in _COUNTS:
        low = 1 if name in _INTS else 0
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not is_int or value < low:
            raise (SdpaValueError if is_int else SdpaTypeError)(
                f"settings.override: {name} must be an int >= {low} "
                f"({'bytes' if name in _INTS else 'scores'}), got {value!r} "
                f"({type(value).__name__}); default {getattr(Settings, name)}"
            )
        return value
    if name in _LIMITS:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not 0 < value < float("inf"):
            raise (SdpaValueError if number else SdpaTypeError)(
                f"settings.override: {name} must be a finite number > 0 (nats), got "
                f"{value!r}; default {getattr(Settings, name)}"
            )
        return float(value)
    # kernel_devices
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise SdpaTypeError(
            f"settings.override: kernel_devices must be a set of device types, e.g. "
            f"{{'cuda'}} or set(), got {value!r} ({type(value).__name__})"
        )
    devices = frozenset(value)
    if not all(isinstance(d, str) for d in devices):
        raise SdpaTypeError(
            f"settings.override: kernel_devices holds device type names (str), got {value!r}"
        )
    return devices


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Within the block, the current settings with `changes` (field=value); restored on
    exit. Affects only this thread / asyncio task (and tasks it starts inside). Unknown
    names and unsuitable values are refused before anything changes.

        with sdpa.settings.override(small_weights=0, chunk_bytes=2**20) as s:
            ...   # s is the Settings in force
    """
    unknown = sorted(set(changes) - set(_NAMES))
    if unknown:
        raise SdpaTypeError(
            f"settings.override got unknown setting(s) {unknown}; the settings are "
            f"{list(_NAMES)} (see help(sdpa.settings.Settings))"
        )
    new = dataclasses.replace(get(), **{n: _checked(n, v) for n, v in changes.items()})
    token = _CURRENT.set(new)
    try:
        yield new
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def using(tuning: Settings) -> Iterator[Settings]:
    """Within the block, exactly these settings (a Settings from `get()` earlier): how
    a backward pass runs with the settings of its forward, on autograd's threads."""
    if not isinstance(tuning, Settings):
        raise SdpaTypeError(f"settings.using takes a Settings, got {type(tuning).__name__}")
    token = _CURRENT.set(tuning)
    try:
        yield tuning
    finally:
        _CURRENT.reset(token)
