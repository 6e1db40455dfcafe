"""Sequence parallelism's three schemes across 1, 2, 4 and 8 gloo processes: memory and
traffic per rank.

For each number of ranks, one process per rank holds only its shard of a (1, H, L, 32)
float32 self-attention (default H = 8, L = 65536) and runs one forward of
sdpa.distributed's ring_attention, ulysses_attention or hybrid_attention (--schemes,
default all three). Ulysses splits the heads across its group, so H must divide by the
group's size: the default is 8 heads so that Ulysses runs at 1, 2, 4 and 8 ranks (a
scheme whose group does not divide the heads is skipped, with a printed note). The
hybrid runs Ulysses inside groups of U = 2 consecutive ranks and the ring across the
R = ranks / 2 groups (ranks 2j and 2j + 1 form Ulysses group j; ring group u holds
ranks u, u + 2, ...; so rank r holds shard r), only at an even number of ranks >= 4.
Per rank it reports:
- held: the peak bytes of tensors the implementation holds (its shards of q, k, v plus
  everything it allocates: key/value buffers in flight, the all-to-alls' pieces,
  accumulators, kernel outputs), tracked tensor by tensor with a dispatch mode; its
  target: held <= 1.5 / ranks of the single-process row's held + 64 MiB;
- RSS: the rise of the process's peak resident set over the baseline after the shards
  exist (kernel scratch and allocator slack included);
- sent: payload bytes it sent (sd.traffic: all but the headers) against the scheme's
  theory, written out here from the shapes (`theory`), and the control bytes (the
  4096-byte headers, one per peer of each group);
- time: wall time of the forward (the slowest rank's). On a 2-core machine the ranks
  share the cores, so time is not a speed claim; memory and traffic are the point.
The first row of each mode is single-process sdpa.attention on the whole sequence.

benchmarks/results/ring.json (ring_attention alone, H = 4) was made before the scheme
axis: `--schemes ring --heads 4` repeats it; benchmarks/results/ring_schemes.json is the
scheme comparison at 8 ranks and L = 16384 (`--length 16384 --ranks 8`: on 2 cores the
default length and ranks for every scheme take too long).

`--check` runs, instead, each scheme once at 8 processes on a (1, 8, 512, 16) input,
dense and causal zigzag, and compares every rank's output (and log-sum-exp) with
single-process sdpa.attention on the whole sequence: max abs error <= 1e-5, else it
exits 1 (tests/test_ring_slow.py runs the same checks: pytest -m slow).

    python benchmarks/bench_ring.py --json benchmarks/results/ring.json
    python benchmarks/bench_ring.py --length 16384 --ranks 8 \
        --json benchmarks/results/ring_schemes.json
    python benchmarks/bench_ring.py --markdown benchmarks/results/ring.json
    python benchmarks/bench_ring.py --check
"""

from __future__ import annotations

import argparse
import collections
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
SCHEMES = ["ring", "ulysses", "hybrid"]
IMPL = {scheme: f"{scheme}_attention" for scheme in SCHEMES}
WHOLE = "sdpa.attention (whole sequence)"
HYBRID_U = 2  # the hybrid's Ulysses group size
HEADER = 4096  # bytes of one header (sdpa.distributed's control message)
MIB = 2**20
TOLERANCE = 1e-5  # --check: max abs error against single-process attention
CHECK_SHAPE = (1, 8, 512, 16)  # --check's (B, H, L, D)


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


def grid(scheme: str, ranks: int) -> tuple[int, int]:
    """(U, R): the Ulysses group's size and the ring's of `scheme` at `ranks`."""
    U = {"ring": 1, "ulysses": ranks, "hybrid": HYBRID_U}[scheme]
    return U, ranks // U


def why_not(scheme: str, ranks: int, heads: int) -> str | None:
    """Why `scheme` cannot run at `ranks` on `heads` heads, or None where it can."""
    if scheme == "hybrid" and (ranks < 2 * HYBRID_U or ranks % HYBRID_U):
        return f"the hybrid (U = {HYBRID_U}) needs an even number of ranks >= {2 * HYBRID_U}"
    U, _ = grid(scheme, ranks)
    if heads % U:
        return f"{heads} heads do not divide by its Ulysses group of {U}"
    return None


def theory(scheme: str, ranks: int, B: int, H: int, n: int, D: int, itemsize: int = 4) -> dict:
    """Bytes one rank sends in one forward of `scheme`, by kind, for equal shards of n
    rows (B, H, n, D) of q, k and v, every pair of ring places sharing visible entries
    (dense, and causal under zigzag: every shard holds a head and a tail piece).

    Ulysses (U ranks): the all-to-alls send (U - 1) / U of this rank's q, k and v shards
    (each other member's H / U heads) and, back, the other members' rows of this rank's
    H / U heads of the output and of the log-sum-exp (float32). The ring (R places):
    R - 1 key/value chunks, each of U shards' rows for H / U heads. Headers: one per
    peer of each group (U - 1 + R - 1)."""
    U, R = grid(scheme, ranks)
    h = H // U  # heads per Ulysses member
    sent: collections.Counter[str] = collections.Counter()
    if U > 1:
        sent["q"] = (U - 1) * B * h * n * D * itemsize
        sent["kv"] = (U - 1) * 2 * B * h * n * D * itemsize
        sent["out"] = (U - 1) * B * h * n * D * itemsize
        sent["lse"] = (U - 1) * B * h * n * 4
    if R > 1:
        sent["kv"] += (R - 1) * 2 * B * h * (U * n) * D * itemsize
    sent["control"] = HEADER * ((U - 1) + (R - 1))
    return {what: nbytes for what, nbytes in sent.items() if nbytes}


def _groups(scheme: str, ranks: int) -> dict:
    """The scheme's keyword arguments for its groups. The hybrid's: Ulysses groups of U
    consecutive ranks, ring groups of the ranks of one Ulysses index (rank j * U + u:
    Ulysses index u, ring index j, shard j * U + u). Every rank makes every group."""
    if scheme != "hybrid":
        return {}
    U, R = grid(scheme, ranks)
    me = dist.get_rank()
    mine = {}
    for j in range(R):
        g = dist.new_group([j * U + u for u in range(U)])
        if me // U == j:
            mine["ulysses_group"] = g
    for u in range(U):
        g = dist.new_group([j * U + u for j in range(R)])
        if me % U == u:
            mine["ring_group"] = g
    return mine


def _call(scheme: str, groups: dict, q, k, v, **kwargs):
    fn = {"ring": sd.ring_attention, "ulysses": sd.ulysses_attention,
          "hybrid": sd.hybrid_attention}[scheme]  # fmt: skip
    return fn(q, k, v, **groups, **kwargs)


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip


def _rank(rank, world, port, L, H, D, mode, whole, scheme, results):
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
        results.put(dict(rank=0, shards=shards, held=shards + held.peak, rss=rss, sent={},
                         seconds=seconds))  # fmt: skip
        return
    _init(rank, world, port)
    groups = _groups(scheme, world)
    with torch.no_grad(), Held():
        _call(scheme, groups, *small, causal=causal, layout=layout, timeout=600)
    dist.barrier()
    base = peak_rss_kib()
    with torch.no_grad(), Held().known(q, k, v) as held, sd.traffic() as sent:
        t0 = time.perf_counter()
        _call(scheme, groups, q, k, v, causal=causal, layout=layout, timeout=600)
        seconds = time.perf_counter() - t0
    rss = (peak_rss_kib() - base) / 1024
    results.put(dict(rank=rank, shards=shards, held=shards + held.peak, rss=rss,
                     sent={w: b for w, b in sent.sent.items() if b}, seconds=seconds))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world: int, *args) -> list:
    """Run target(rank, world, port, *args, results) in `world` spawned processes: each
    puts one answer (a dict with its "rank"); returns them in rank order."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        answers = [results.get(timeout=1800) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return sorted(answers, key=lambda r: r["rank"])


def measure(
    world: int, L: int, H: int, D: int, mode: str, whole: bool = False, scheme: str = "ring"
) -> dict:
    """One row: `scheme` (or, whole, single-process sdpa.attention) at `world` ranks."""
    ranks = _spawn(_rank, world, L, H, D, mode, whole, scheme)
    U, R = (1, 1) if whole else grid(scheme, world)
    n = L // world
    expect = {} if whole else theory(scheme, world, 1, H, n, D)
    payload = [sum(b for w, b in r["sent"].items() if w != "control") for r in ranks]
    control = [r["sent"].get("control", 0) for r in ranks]
    payload_theory = sum(b for w, b in expect.items() if w != "control")
    return {
        "impl": WHOLE if whole else IMPL[scheme],
        "scheme": None if whole else scheme,
        "mode": mode,
        "ranks": world,
        "ulysses": U,
        "ring": R,
        "shape": [1, H, L, D],
        "shards_mib": max(r["shards"] for r in ranks) / MIB,
        "held_mib": max(r["held"] for r in ranks) / MIB,
        "rss_mib": max(r["rss"] for r in ranks),
        "sent_mib": max(payload) / MIB,
        "theory_sent_mib": payload_theory / MIB,
        "payload_bytes": max(payload),
        "theory_payload_bytes": payload_theory,
        "control_bytes": max(control),
        "theory_control_bytes": expect.get("control", 0),
        "theory_by_kind": expect,
        # every rank sent exactly the theory's bytes of every kind, headers included
        "bytes_match": all(r["sent"] == expect for r in ranks),
        "seconds": max(r["seconds"] for r in ranks),
        "per_rank": ranks,
    }


def judge(rows: list[dict]) -> list[dict]:
    """Each sharded row's memory target, from its mode's single-process row: held per
    rank <= 1.5 / ranks of that row's held + 64 MiB."""
    whole = {r["mode"]: r["held_mib"] for r in rows if r["impl"] == WHOLE}
    for r in rows:
        if r["impl"] != WHOLE and r["mode"] in whole:
            r["target_mib"] = 1.5 / r["ranks"] * whole[r["mode"]] + 64
            r["meets_target"] = r["held_mib"] <= r["target_mib"]
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB" if nbytes else "0"


def markdown(rows: list[dict]) -> str:
    """The table of `rows`; rows of a run before the scheme axis (ring.json: no
    payload_bytes) in that run's columns."""
    if not all("payload_bytes" in r for r in rows):
        return _markdown_ring(rows)
    lines = [
        "| mode | impl | ranks | U x R | shards / rank | held / rank | target | RSS rise / rank "
        "| payload sent / rank | theory | control / rank | time |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        whole = r["impl"] == WHOLE
        grid_ = "-" if whole else f"{r['ulysses']} x {r['ring']}"
        target = (
            "-" if "target_mib" not in r
            else f"<= {r['target_mib']:.0f} MiB: {'met' if r['meets_target'] else 'missed'}"
        )  # fmt: skip
        same = "-" if whole else "equal" if r["bytes_match"] else "differs"
        lines.append(
            f"| {r['mode']} | `{r['impl']}` | {r['ranks']} "
            f"| {grid_} "
            f"| {r['shards_mib']:.0f} MiB | {r['held_mib']:.0f} MiB | {target} "
            f"| {r['rss_mib']:.0f} MiB | {_mib(r['payload_bytes'])} "
            f"| {_mib(r['theory_payload_bytes'])} ({same}) "
            f"| {r['control_bytes'] // 1024} KiB | {r['seconds']:.2f} s |"
        )
    return "\n".join(lines)


def _markdown_ring(rows: list[dict]) -> str:
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


def _check_rank(rank, world, port, scheme, shape, results):
    """Every mode on this rank's shard against sdpa.attention on the whole sequence."""
    torch.set_num_threads(1)
    answer = {"rank": rank}
    try:
        _init(rank, world, port)
        groups = _groups(scheme, world)
        B, H, L, D = shape
        g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
        q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
        for mode, (causal, layout) in MODES.items():
            ref = sdpa.attention(q, k, v, causal=causal)

            def mine(t, layout=layout):  # this rank's shard (rank r holds shard r)
                return sd.shard(t, rank, world, layout=layout)

            ours = _call(scheme, groups, *map(mine, (q, k, v)), causal=causal,
                         layout=layout, timeout=120)  # fmt: skip
            lse = ref.weights.lse[..., None]
            answer[mode] = {
                "out": (ours.output - mine(ref.output)).abs().max().item(),
                "lse": (ours.weights.lse - mine(lse)[..., 0]).abs().max().item(),
            }
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # reported, so that the check fails with it
        answer["error"] = f"{type(e).__name__}: {e}"
    results.put(answer)


def check(scheme: str, world: int = 8, shape: tuple = CHECK_SHAPE) -> dict:
    """`scheme` at `world` gloo processes on one (B, H, L, D) float32 self-attention,
    dense and causal zigzag: {mode: {"out": err, "lse": err}}, the largest abs error of
    any rank's rows against single-process sdpa.attention on the whole sequence, and
    "errors": what ranks raised. check_failures(result) names what misses TOLERANCE."""
    answers = _spawn(_check_rank, world, scheme, tuple(shape))
    got: dict = {"errors": [f"rank {a['rank']}: {a['error']}" for a in answers if "error" in a]}
    for mode in MODES:
        each = [a[mode] for a in answers if mode in a]
        got[mode] = {w: max((e[w] for e in each), default=float("nan")) for w in ("out", "lse")}
    return got


def check_failures(result: dict, tolerance: float = TOLERANCE) -> list[str]:
    """What a `check` result misses: errors raised, errors over the tolerance."""
    failures = list(result["errors"])
    for mode in MODES:
        for what, err in result[mode].items():
            if not err <= tolerance:  # (NaN: a rank gave no answer)
                failures.append(f"{mode}: max |{what} - sdpa.attention's| = {err:.2e}")
    return failures


def run_checks(schemes: list[str], world: int = 8) -> int:
    failed = 0
    for scheme in schemes:
        t0 = time.perf_counter()
        result = check(scheme, world)
        failures = check_failures(result)
        said = ", ".join(f"{m} out {result[m]['out']:.1e} lse {result[m]['lse']:.1e}"
                         for m in MODES)  # fmt: skip
        verdict = "ok" if not failures else "FAILED: " + "; ".join(failures)
        print(f"check {IMPL[scheme]} at {world} processes {CHECK_SHAPE}: {said} "
              f"({time.perf_counter() - t0:.0f} s): {verdict}", flush=True)  # fmt: skip
        failed += bool(failures)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=65536, help="L = S (default 65536)")
    parser.add_argument("--heads", type=int, default=8, help="(default 8: Ulysses to 8 ranks)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    parser.add_argument("--json", help="write results and environment here")
    parser.add_argument("--markdown", help="print the table of an earlier --json run and exit")
    parser.add_argument(
        "--check", action="store_true",
        help=f"check each scheme's output at 8 processes on {CHECK_SHAPE} and exit",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)["results"]))
        return 0
    if args.check:
        return run_checks(args.schemes)
    env = environment()
    print(f"environment: {env}")
    rows = []
    for mode in args.modes:
        rows.append(measure(1, args.length, args.heads, args.dim, mode, whole=True))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
        for scheme in args.schemes:
            for world in args.ranks:
                reason = why_not(scheme, world, args.heads)
                if reason:
                    print(f"skipped {IMPL[scheme]} at {world} ranks: {reason}", flush=True)
                    continue
                rows.append(measure(world, args.length, args.heads, args.dim, mode, False, scheme))
                judge(rows)
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
