"""The ring's communication: a header check before any work, then neighbour transfers,
every wait bounded by a timeout so that a rank that fails or never comes gives an error
on the others instead of a hang.

Everything here is a collective of the process group: every rank calls it in the same
order. After an error the group's connections may be closed; start a fresh group.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from sdpa import masks

HEADER_BYTES = 4096
T = TypeVar("T")


def valid_timeout(timeout: object) -> bool:
    return not isinstance(timeout, bool) and isinstance(timeout, int | float) and timeout > 0


def mask_digest(mask: object) -> str:
    """A short fingerprint of a structured mask, contents included (two `documents`
    masks with other ids differ), for the ranks to compare."""
    if mask is None:
        return "None"
    h = hashlib.sha1(type(mask).__name__.encode())
    for name, value in sorted(vars(mask).items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, masks.Mask):  # a mask inside a combination
            h.update(mask_digest(value).encode())
        else:
            h.update(repr(value).encode())
    return f"{type(mask).__name__.lstrip('_').lower()}:{h.hexdigest()[:16]}"


class RingError(RuntimeError):
    """The ranks disagree about the call, or another rank failed."""


class RingTimeoutError(RingError, TimeoutError):
    """A peer did not answer within the timeout."""


class Ring:
    """This rank's place in the group's ring: it receives from `prev`, sends to `next`."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float):
        """timeout: seconds every wait may take (valid_timeout(timeout) must hold)."""
        if not dist.is_available() or not dist.is_initialized():  # local: before any collective
            raise RuntimeError(
                "ring attention needs torch.distributed initialised: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets "
                "the environment for it)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = (self.rank + 1) % self.world
        self.prev = (self.rank - 1) % self.world
        self.timeout = timeout
        # p2p ops take global ranks
        self._global = [dist.get_global_rank(group, r) if group else r for r in range(self.world)]

    def _wait(self, works, what: Callable[[], str]) -> None:
        try:
            for w in works:
                w.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            said = str(e).lower()
            kind = RingTimeoutError if "timeout" in said or "timed out" in said else RingError
            raise kind(f"rank {self.rank}: {what()} ({e})") from None

    def agree(self, header: dict, device: torch.device) -> list[dict]:
        """Every rank's header (a small JSON-able dict), in rank order. A header with
        an "error" entry makes every rank raise, naming the rank that failed."""
        if "error" in header:  # room for the rest of the header
            header = {"error": header["error"][: HEADER_BYTES // 2]}
        text = json.dumps(header).encode()
        if len(text) >= HEADER_BYTES:
            text = json.dumps({"error": f"a header of {len(text)} bytes: {text[:200]!r}"}).encode()
        mine = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
        mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        every = self.all_gather(
            mine,
            "not every rank of the group reached ring attention (a rank failed before it, "
            "or does not call it)",
        )
        headers = []
        for rank, t in enumerate(every):
            raw = bytes(t.cpu().tolist()).rstrip(b"\0")
            try:
                headers.append(json.loads(raw.decode()))
            except ValueError:
                raise RingError(
                    f"rank {self.rank}: rank {rank} sent an unreadable header ({raw[:80]!r}...); "
                    f"every rank of the group must call the same sdpa.distributed function"
                ) from None
        failed = [(r, h["error"]) for r, h in enumerate(headers) if "error" in h]
        if failed and "error" not in header:
            rank, message = failed[0]
            raise RingError(f"rank {self.rank}: rank {rank} failed: {message}")
        return headers

    def check_then_agree(
        self, check: Callable[[], tuple[dict, T]], device: torch.device, catch: tuple
    ) -> tuple[list[dict], T]:
        """Run this rank's own checks (`check` returns the header to agree on and a value
        for the caller), then exchange headers as `agree` does. An exception of a type in
        `catch` is first announced to every rank (they raise RingError naming this one),
        then raised here: a local failure never leaves the others waiting."""
        try:
            header, value = check()
        except catch as e:
            self.agree({"error": f"{type(e).__name__}: {e}"}, device)
            raise
        return self.agree(header, device), value

    def start_rotate(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> list:
        """Send the tensors `send` to the next rank and receive the previous rank's into
        `recv`, without waiting: the transfer overlaps whatever runs before `finish`."""
        if self.world == 1:  # the ring is this rank alone
            for s, r in zip(send, recv, strict=True):
                r.copy_(s)
            return []
        nxt, prev = self._global[self.next], self._global[self.prev]
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prev, self.group) for t in recv]
        return dist.batch_isend_irecv(ops)

    def finish(self, works: list, step: int, what: str) -> None:
        self._wait(
            works,
            lambda: (
                f"{what} ring step {step}: no shard from rank {self.prev} (or none taken by "
                f"rank {self.next}) within {self.timeout} s; a rank failed, or did not run the "
                f"{what} (it is a collective: every rank runs it)"
            ),
        )

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of t over the ranks, in place."""
        work = dist.all_reduce(t, group=self.group, async_op=True)
        self._wait([work], lambda: f"the sum over ranks did not finish within {self.timeout} s")
        return t

    def all_gather(
        self, t: torch.Tensor, reason: str = "the gather over ranks did not finish"
    ) -> list[torch.Tensor]:
        """Every rank's t (same shape everywhere), in rank order."""
        every = [torch.empty_like(t) for _ in range(self.world)]
        work = dist.all_gather(every, t.contiguous(), group=self.group, async_op=True)
        self._wait([work], lambda: f"{reason}, within {self.timeout} s")
        return every
