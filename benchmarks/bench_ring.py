"""Ring attention across 1, 2, 4 and 8 gloo processes: memory and traffic per rank.

For each number of ranks, one process per rank holds only its shard of a (1, 4, L, 32)
float32 self-attention (default L = 65536) and runs one forward of
sdpa.distributed.ring_attention. Per rank it reports:
- held: the peak bytes of tensors the implementation holds (its shards of q, k, v plus
  everything it allocates: key/value buffers in flight, accumulators, kernel outputs),
  tracked tensor by tensor with a dispatch mode;
- RSS: the rise of the process's peak resident set over the baseline after the shards
  exist (kernel scratch and allocator slack included);
- sent: bytes it sent, counted at torch.distributed, against the theory
  (ranks - 1) / ranks of K and V;
- time: wall time of the forward. On a 2-core machine the ranks share the cores, so
  time is not a speed claim; memory and traffic are the point.
The first row of each mode is single-process sdpa.attention on the whole sequence.

    python benchmarks/bench_ring.py --json benchmarks/results/ring.json
    python benchmarks/bench_ring.py --markdown benchmarks/results/ring.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sdpa
from sdpa import distributed as sd
from sdpa.benchmark import environment
from sdpa.measure import peak_rss_kib

MODES = {  # name: (causal, layout)
    "dense": (False, "contiguous"),
    "causal zigzag": (True, "zigzag"),
}


class Held(TorchDispatchMode):
    """Bytes of the tensor storages created under it that are still alive, and their
    peak (a storage counts once, however many views it has)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._seen:
                    self._seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, size)
        return out

    def known(self, *tensors: torch.Tensor) -> Held:
        """Storages that exist already (the inputs): views of them allocate nothing."""
        self._seen.update(t.untyped_storage().data_ptr() for t in tensors)
        return self

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def _count_sent():
    """Wrap batch_isend_irecv: returns a function giving the bytes sent so far."""
    sent = [0]
    original = dist.batch_isend_irecv

    def counting(ops):
        sent[0] += sum(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend
        )
        return original(ops)

    dist.batch_isend_irecv = counting
    return lambda: sent[0]


def _rank(rank, world, port, L, H, D, mode, whole, results):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    causal, layout = MODES[mode]
    n = L // world
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))  # this rank's shards
    shards = 3 * q.numel() * q.element_size()
    small = [t[:, :, :256] for t in (q, k, v)]  # warm-up: one-time costs (thread pools,
    # libraries, connections) are not the call's memory
    if whole:  # the single-process baseline: sdpa.attention on all of it
        with torch.no_grad(), Held():
            sdpa.attention(*small, causal=causal)
        base = peak_rss_kib()
        with torch.no_grad(), Held().known(q, k, v) as held:
            t0 = time.perf_counter()
            sdpa.attention(q, k, v, causal=causal)
            seconds = time.perf_counter() - t0
        rss = (peak_rss_kib() - base) / 1024
        results.put(dict(rank=0, shards=shards, held=shards + held.peak, rss=rss, sent=0,
                         seconds=seconds))  # fmt: skip
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    with torch.no_grad(), Held():
        sd.ring_attention(*small, causal=causal, layout=layout, timeout=600)
    sent = _count_sent()
    dist.barrier()
    base = peak_rss_kib()
    with torch.no_grad(), Held().known(q, k, v) as held:
        t0 = time.perf_counter()
        sd.ring_attention(q, k, v, causal=causal, layout=layout, timeout=600)
        seconds = time.perf_counter() - t0
    rss = (peak_rss_kib() - base) / 1024
    results.put(dict(rank=rank, shards=shards, held=shards + held.peak, rss=rss, sent=sent(),
                     seconds=seconds))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, L: int, H: int, D: int, mode: str, whole: bool = False) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, L, H, D, mode, whole, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ranks = sorted((results.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    kv = 2 * L * H * D * 4  # bytes of the whole K and V
    mib = 2**20
    return {
        "impl": "sdpa.attention (whole sequence)" if whole else "ring_attention",
        "mode": mode,
        "ranks": world,
        "shape": [1, H, L, D],
        "shards_mib": max(r["shards"] for r in ranks) / mib,
        "held_mib": max(r["held"] for r in ranks) / mib,
        "rss_mib": max(r["rss"] for r in ranks),
        "sent_mib": max(r["sent"] for r in ranks) / mib,
        "theory_sent_mib": (world - 1) / world * kv / mib,
        "seconds": max(r["seconds"] for r in ranks),
        "per_rank": ranks,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| mode | impl | ranks | shards / rank | held / rank | RSS rise / rank "
        "| sent / rank | theory (R-1)/R of K+V | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | `{r['impl']}` | {r['ranks']} | {r['shards_mib']:.0f} MiB "
            f"| {r['held_mib']:.0f} MiB | {r['rss_mib']:.0f} MiB | {r['sent_mib']:.0f} MiB "
            f"| {r['theory_sent_mib']:.0f} MiB | {r['seconds']:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=65536, help="L = S (default 65536)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", help="write results and environment here")
    parser.add_argument("--markdown", help="print the table of an earlier --json run and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)["results"]))
        return 0
    env = environment()
    print(f"environment: {env}")
    rows = []
    for mode in args.modes:
        rows.append(measure(1, args.length, args.heads, args.dim, mode, whole=True))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
        for world in args.ranks:
            rows.append(measure(world, args.length, args.heads, args.dim, mode))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
