"""The communication of sdpa.distributed: a header check before any work, then
point-to-point transfers between the ranks of an ordered list, every wait bounded by a
timeout so that a rank that fails or never comes gives an error on the others instead
of a hang.

Every transfer is a point-to-point send (torch.distributed.batch_isend_irecv), so a
"ring" is any ordered list of global ranks (a process group's, or the ranks of a hybrid
scheme's groups in sequence order), and every byte sent is counted here, by what it
carries (`traffic`).

Everything here is a collective of the ranks of the ring: every rank calls it in the
same order. After a timeout the process group is unusable (a gloo or NCCL operation
in flight cannot be cancelled): destroy it and start a fresh one.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from sdpa import masks

HEADER_BYTES = 4096
T = TypeVar("T")
CONTROL = "control"  # headers: what every call sends besides its payload
TAGS = {CONTROL: 1, "kv": 2, "grad": 3, "q": 4, "out": 5, "lse": 6, "reads": 7, "mask": 8}
AFTER_TIMEOUT = (
    "the process group cannot be used after this (an operation in flight cannot be "
    "cancelled): call torch.distributed.destroy_process_group() and start a new group"
)


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


class Traffic:
    """Bytes this process sent through sdpa.distributed while it was active, by what
    they carried: "kv" (key/value shards), "grad" (gradients), "q", "out", "lse"
    (Ulysses' all-to-alls), "mask" (tensor masks: key padding with the shards, rows in
    Ulysses' all-to-all), "reads" (the weights' reads), "control" (headers)."""

    def __init__(self) -> None:
        self.sent: collections.Counter[str] = collections.Counter()

    @property
    def payload(self) -> int:
        return sum(n for what, n in self.sent.items() if what != CONTROL)

    @property
    def control(self) -> int:
        return self.sent[CONTROL]

    def __repr__(self) -> str:
        return f"Traffic(payload={self.payload}, control={self.control}, {dict(self.sent)})"


_COUNTING: list[Traffic] = []


@contextlib.contextmanager
def traffic() -> Iterator[Traffic]:
    """Count the bytes this process sends through sdpa.distributed inside the block:

    with sd.traffic() as sent:
        out, w = sd.ring_attention(q, k, v)
    sent.payload, sent.control, sent.sent["kv"]
    """
    counter = Traffic()
    _COUNTING.append(counter)
    try:
        yield counter
    finally:
        _COUNTING.remove(counter)


def _count(what: str, tensors: Sequence[torch.Tensor]) -> None:
    if _COUNTING:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        for counter in _COUNTING:
            counter.sent[what] += nbytes


def require_initialized() -> None:
    """Refuse, before any collective, a process whose torch.distributed is not started."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "sdpa.distributed needs torch.distributed initialised: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets "
            "the environment for it)"
        )


class Ring:
    """This rank's place in an ordered list of ranks: `ranks` are global ranks (default:
    those of `group`, in its order); rank and world are this process's index in the
    list and the list's length. Transfers are point-to-point, on `group`."""

    def __init__(
        self, group: dist.ProcessGroup | None, timeout: float, ranks: Sequence[int] | None = None
    ):
        """timeout: seconds every wait may take (valid_timeout(timeout) must hold)."""
        require_initialized()
        self.group = group
        if ranks is None:
            world = dist.get_world_size(group)
            ranks = [dist.get_global_rank(group, r) if group else r for r in range(world)]
        self._global = list(ranks)
        self.world = len(self._global)
        self.rank = self._global.index(dist.get_rank())
        self.timeout = timeout

    @property
    def ranks(self) -> list[int]:
        """The global ranks of the list, in its order."""
        return list(self._global)

    def wait(self, works, what: Callable[[], str]) -> None:
        """Wait for `works` (torch.distributed handles) within the timeout: a timeout
        raises RingTimeoutError saying the group is unusable, another failure RingError
        (saying so too where a peer's connection closed: a rank failed); what() says
        what was awaited."""
        try:
            for w in works:
                w.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            said = str(e).lower()
            timed_out = "timeout" in said or "timed out" in said
            lost = "closed by peer" in said or "reset by peer" in said
            kind = RingTimeoutError if timed_out else RingError
            after = f"; {AFTER_TIMEOUT}" if timed_out or lost else ""
            raise kind(f"rank {self.rank}: {what()} ({e}){after}") from None

    def start(
        self,
        sends: dict[int, Sequence[torch.Tensor]],
        recvs: dict[int, Sequence[torch.Tensor]],
        what: str,
    ) -> list:
        """Send tensors to some ranks and receive others' into given buffers (peers are
        indices in this ring), without waiting; `what` names the payload (Traffic's
        keys). Between two ranks, sends and receives of one kind match in order."""
        own = self.rank
        if own in sends or own in recvs:  # this rank to itself: a copy
            for s, r in zip(sends.pop(own, ()), recvs.pop(own, ()), strict=True):
                r.copy_(s)
        tag = TAGS[what]
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), self._global[p], self.group, tag)
            for p, ts in sends.items()
            for t in ts
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self._global[p], self.group, tag)
            for p, ts in recvs.items()
            for t in ts
        ]
        _count(what, [t for ts in sends.values() for t in ts])
        return dist.batch_isend_irecv(ops) if ops else []

    def finish(self, works: list, what: str) -> None:
        """Wait for transfers started by `start`; `what` says which call and step."""
        self.wait(
            works,
            lambda: (
                f"{what}: a transfer did not finish within {self.timeout} s; a rank failed, "
                f"or did not run it (it is a collective: every rank runs it)"
            ),
        )

    def exchange(self, sends, recvs, what: str, call: str) -> None:
        """`start` and `finish` at once."""
        self.finish(self.start(sends, recvs, what), call)

    def all_gather(self, t: torch.Tensor, what: str, call: str) -> list[torch.Tensor]:
        """Every rank's t (the same shape everywhere), in rank order."""
        every = [t if r == self.rank else torch.empty_like(t) for r in range(self.world)]
        others = [r for r in range(self.world) if r != self.rank]
        self.exchange({r: [t] for r in others}, {r: [every[r]] for r in others}, what, call)
        return every

    def agree(self, header: dict, device: torch.device, call: str = "ring attention") -> list[dict]:
        """Every rank's header (a small JSON-able dict), in rank order. A header with
        an "error" entry makes every rank raise, naming the rank that failed. call:
        what the ranks are starting, for the error when one never comes."""
        headers = self.headers(header, device, call)
        if "error" not in header:
            raise_failed(headers, self.rank)
        return headers

    def headers(self, header: dict, device: torch.device, call: str) -> list[dict]:
        """Every rank's header, in rank order, errors included (`agree` raises on them)."""
        if "error" in header:  # room for the rest of the header
            header = {"error": header["error"][: HEADER_BYTES // 2]}
        text = json.dumps(header).encode()
        if len(text) >= HEADER_BYTES:
            text = json.dumps({"error": f"a header of {len(text)} bytes: {text[:200]!r}"}).encode()
        mine = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device)
        mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        every = self.all_gather(
            mine,
            CONTROL,
            f"not every rank reached {call} (a rank failed before it, or does not call it)",
        )
        headers = []
        for rank, t in enumerate(every):
            raw = bytes(t.cpu().tolist()).rstrip(b"\0")
            try:
                headers.append(json.loads(raw.decode()))
            except ValueError:
                raise RingError(
                    f"rank {self.rank}: rank {rank} sent an unreadable header ({raw[:80]!r}...); "
                    f"every rank must call the same sdpa.distributed function"
                ) from None
        return headers

    def check_then_agree(
        self,
        check: Callable[[], tuple[dict, T]],
        device: torch.device,
        catch: tuple,
        call: str = "ring attention",
    ) -> tuple[list[dict], T]:
        """Run this rank's own checks (`check` returns the header to agree on and a value
        for the caller), then exchange headers as `agree` does. An exception of a type in
        `catch` is first announced to every rank (they raise RingError naming this one),
        then raised here: a local failure never leaves the others waiting."""
        try:
            header, value = check()
        except catch as e:
            self.agree({"error": f"{type(e).__name__}: {e}"}, device, call)
            raise
        return self.agree(header, device, call), value


def raise_failed(headers: list[dict], rank: int) -> None:
    """RingError naming the first rank whose header reports an error, if any."""
    failed = [(r, h["error"]) for r, h in enumerate(headers) if "error" in h]
    if failed:
        who, message = failed[0]
        raise RingError(f"rank {rank}: rank {who} failed: {message}")


def check_agreement(headers: list[dict], rank: int, call: str, hint: str) -> None:
    """Raise RingError naming every entry the ranks' headers disagree on."""
    differ = [key for key in headers[0] if any(h.get(key) != headers[0][key] for h in headers)]
    if differ:
        seen = "; ".join(
            f"{key}: " + ", ".join(f"rank {r} {h.get(key)}" for r, h in enumerate(headers))
            for key in differ
        )
        raise RingError(
            f"rank {rank}: the ranks called {call} with different arguments ({seen}). {hint}"
        )
