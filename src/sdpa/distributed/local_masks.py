"""Masks given as tensors to a sharded call: each rank passes its own part.

- A rows mask: bool (True = takes part), integer (nonzero) or float (added to the scores)
  over this rank's query rows and every key of the whole sequence, broadcasting to
  (..., n, S) (dim -2: n, or 1 for the same mask on every row of this rank). A float
  mask's gradient comes back to the rank that gave it.
- `key_padding(keep)`: (B, m) bool of this rank's own keys (True = a real key), the
  key-padding tensor a data loader gives with its shard; it travels with the key/value
  shards (B * m bytes a transfer).

Shapes in the ring: rows (Bm, Hm, n|1, S) in the 4-D layout; keys (B, m) bool.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sdpa.errors import SdpaTypeError, SdpaValueError


class KeyPadding:
    """This rank's key-padding mask: keep (B, m) bool, True = a real key."""

    def __init__(self, keep: torch.Tensor):
        self.keep = keep

    def __repr__(self) -> str:
        return f"key_padding{tuple(self.keep.shape)}"


def key_padding(keep: torch.Tensor) -> KeyPadding:
    """A key-padding mask of this rank's own keys, (B, m): True (or nonzero) = a real
    key, False = padding. Pass it as the `mask` of a sharded call."""
    if not isinstance(keep, torch.Tensor) or keep.ndim != 2:
        raise SdpaTypeError(
            f"key_padding takes a (B, m) tensor of this rank's keys (True = a real key), got "
            f"{type(keep).__name__}{tuple(getattr(keep, 'shape', ()))}"
        )
    if keep.is_floating_point() or keep.is_complex():
        raise SdpaTypeError(f"key_padding takes a bool or integer tensor, got {keep.dtype}")
    return KeyPadding(keep if keep.dtype == torch.bool else keep != 0)


class Local(NamedTuple):
    """A call's tensor masks on this rank (None: not given)."""

    rows: torch.Tensor | None  # as given (bool or float; integers as bool), (..., n|1, S)
    keys: torch.Tensor | None  # (B, m) bool

    def rows4(self, has_heads: bool) -> torch.Tensor | None:
        """The rows mask in the 4-D layout (Bm, Hm, n|1, S)."""
        t = self.rows
        if t is None:
            return None
        if has_heads:
            return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
        t = t.reshape((1,) * (3 - t.ndim) + tuple(t.shape))
        return t[:, None]

    @property
    def wants_grad(self) -> bool:
        t = self.rows
        return t is not None and t.is_floating_point() and t.requires_grad


NONE = Local(None, None)


def check(mask: object, lead: tuple[int, ...], n: int, m: int, device) -> tuple[Local, str]:
    """This rank's tensor mask, checked against its own shards: (Local, what every rank
    must agree on). lead: the inputs' leading dims ((B, H) or (B,))."""
    if isinstance(mask, KeyPadding):
        keep = mask.keep
        if keep.shape[1] != m or keep.shape[0] != lead[0]:
            raise SdpaValueError(
                f"key_padding must be (B, m) = ({lead[0]}, {m}): this rank's batch and its "
                f"keys, got {tuple(keep.shape)}"
            )
        if keep.device != device:
            raise SdpaValueError(f"key_padding is on {keep.device} but the key is on {device}")
        return Local(None, keep), "key_padding"
    t = mask
    if t.is_complex():
        raise SdpaTypeError(f"mask must be bool, integer or real floating, got {t.dtype}")
    if t.device != device:
        raise SdpaValueError(f"mask is on {t.device} but query is on {device}")
    dims = len(lead) + 2
    if not 2 <= t.ndim <= dims or t.shape[-2] not in (n, 1):
        raise SdpaValueError(
            f"a tensor mask gives this rank's rows over every key: shape broadcasting to "
            f"{(*lead, n, 'S')} with dim -2 of {n} (or 1), got {tuple(t.shape)}"
        )
    outer = t.shape[:-2]
    for have, want in zip(reversed(outer), reversed(lead), strict=False):
        if have not in (1, want):
            raise SdpaValueError(
                f"the mask's leading dims {tuple(outer)} do not broadcast to the inputs' "
                f"{tuple(lead)}"
            )
    if not (t.dtype == torch.bool or t.is_floating_point()):
        t = t != 0  # integer keep-mask, the listing's convention
    kind = "bool" if t.dtype == torch.bool else "float"
    return Local(t, None), f"tensor {kind} {list(outer)} x {t.shape[-1]} keys"


def check_keys(local: Local, S: int) -> None:
    """The rows mask's last dim against the whole sequence's keys (alike on every rank)."""
    if local.rows is not None and local.rows.shape[-1] != S:
        raise SdpaValueError(
            f"a tensor mask gives this rank's rows over every key of the whole sequence, "
            f"S = {S}, got {local.rows.shape[-1]} columns"
        )
