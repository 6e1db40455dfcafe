"""Memory budgets for the calls that would allocate a whole L x S view.

`AttentionWeights.full()` and `Mask.materialize()` refuse, before allocating, a result
over `max_bytes` (default DEFAULT_MAX_BYTES, 1 GiB); None lifts the limit.
`release_freed()` keeps chunked work under autograd at a chunk's memory. An op that
takes a lazy tensor's dense value (`w * m` past what is lazy, `w.numpy()`) checks
`dense_limit()`: DEFAULT_MAX_BYTES, or the limit a caller set around it with
`dense_limited` (a TransformerLens bridge's `max_dense_bytes`). Lowest layer: imports
only sdpa.errors.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
from collections.abc import Iterator

from sdpa.errors import SdpaTypeError, WeightsTooLargeError

GIB = 2**30
DEFAULT_MAX_BYTES = GIB  # a default argument (pass max_bytes per call), not a setting
_DENSE_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "sdpa_dense_limit", default=DEFAULT_MAX_BYTES
)


def dense_limit() -> int | None:
    """The bytes an op may take for a lazy tensor's dense value here (None: no limit)."""
    return _DENSE_LIMIT.get()


@contextlib.contextmanager
def dense_limited(max_bytes: int | None) -> Iterator[None]:
    """Within the block, ops that take a lazy tensor's dense value refuse past max_bytes."""
    token = _DENSE_LIMIT.set(check_max_bytes(max_bytes))
    try:
        yield
    finally:
        _DENSE_LIMIT.reset(token)


def check_max_bytes(max_bytes: object) -> int | None:
    """max_bytes as given, if it is a non-negative int or None; else a clear error."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise SdpaTypeError(
            f"max_bytes must be a non-negative int (bytes) or None (no limit), got "
            f"{max_bytes!r} ({type(max_bytes).__name__}); e.g. max_bytes=2**30 for 1 GiB"
        )
    return max_bytes


def check_fits(what: str, shape: tuple[int, ...], itemsize: int, max_bytes: object, hint: str):
    """Raise WeightsTooLargeError, before anything is allocated, when a tensor of `shape`
    and `itemsize` would need more than max_bytes."""
    limit = check_max_bytes(max_bytes)
    need = math.prod(shape) * itemsize
    if limit is not None and need > limit:
        raise WeightsTooLargeError(
            f"{what} {tuple(shape)} need {need:,} bytes ({need / GIB:.2f} GiB), over "
            f"max_bytes={limit:,}. {hint}"
        )


def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # (TypeError: CDLL(None) on Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_freed() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim, about 20 us;
    nothing under another C library). Work cut into chunks under autograd frees each
    chunk's buffers while autograd's small allocations land between them, and glibc's
    heap then keeps every chunk's pages: a lazy `(w * 2).sum(-1)` and its backward at
    L = S = 8192 (4 MiB chunks) peaked 1.5 GiB over its inputs, 27 MiB with this called
    before each chunk's work and each read's backward (measured)."""
    if _TRIM is not None:
        _TRIM(0)
