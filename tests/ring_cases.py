"""Worker processes for the ring attention tests: a gloo group that stays up for many
cases, each checked on every rank against single-process sdpa.attention and against the
float64 oracle (tests/oracle.py) on the gathered sequence."""

from __future__ import annotations

import datetime
import time
import traceback

import torch
import torch.distributed as dist

import sdpa
from sdpa import distributed as sd
from sdpa import masks

from oracle import oracle


def worker(rank: int, world: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    while True:
        task = tasks.get()
        if task is None:
            break
        name, kwargs = task
        try:
            results.put((rank, None, CASES[name](rank, world, **kwargs)))
        except Exception as e:  # reported to the test, which fails with it
            results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))
    dist.destroy_process_group()


def _inputs(seed, B, Hq, Hkv, L, S, E, Ev, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, E, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Ev, generator=g).to(dtype)
    grad = torch.randn(B, Hq, L, Ev, generator=g).to(dtype)
    return q, k, v, grad


def _mask(kind, B, L, seed):
    g = torch.Generator().manual_seed(seed + 1)
    if kind is None:
        return None
    if kind == "padding":  # length 1: every shard but the first fully padded
        return masks.padding([(1, L // 2 + 1, L)[b % 3] for b in range(B)])
    if kind == "documents":
        ids = torch.sort(torch.randint(0, 4, (B, L), generator=g), dim=-1).values
        return masks.documents(ids)
    if kind == "window":
        return masks.sliding_window(5) & masks.padding(torch.full((B,), L - 3))
    if kind == "dead":  # documents whose query ids never occur among the keys
        q_ids = torch.arange(L) % 3
        return masks.documents(q_ids, torch.where(q_ids == 2, 0, q_ids))
    raise ValueError(kind)


def _keep(kind, B, L, seed):
    """The mask `kind` of _mask written out independently of sdpa.masks, for the oracle:
    (B|1, 1, L, L) bool (True = takes part), or None."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    g = torch.Generator().manual_seed(seed + 1)
    if kind is None:
        return None
    if kind == "padding":
        lengths = torch.tensor([(1, L // 2 + 1, L)[b % 3] for b in range(B)])
        return (j < lengths[:, None, None])[:, None]
    if kind == "documents":
        ids = torch.sort(torch.randint(0, 4, (B, L), generator=g), dim=-1).values
        return (ids[:, :, None] == ids[:, None, :])[:, None]
    if kind == "window":  # the window of 5 ending at the query (L == S), and padding
        return ((j > i - 5) & (j <= i) & (j < L - 3))[None, None]
    if kind == "dead":
        q_ids = torch.arange(L) % 3
        return (q_ids[:, None] == torch.where(q_ids == 2, 0, q_ids)[None, :])[None, None]
    raise ValueError(kind)


def _oracle(q, k, v, keep, causal, scale, dtype=torch.float64):
    """The float64 oracle on the gathered sequence: (out, p), differentiable in q, k, v."""
    if keep is not None and q.ndim == 3:  # (B, L, E): the mask without its head dim
        keep = keep[:, 0]
    return oracle(q, k, v, keep, causal=causal, scale=scale, dtype=dtype)


def _lse64(q, k, keep, causal, scale):
    """Each query's log-sum-exp of its scores in float64, written out as the oracle
    builds the scores; 0 for rows that see no key."""
    q, k = q.detach().double(), k.detach().double()
    if q.ndim == 4:  # GQA: query head h on key head h // group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    elif keep is not None:
        keep = keep[:, 0]
    s = q @ k.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    if keep is not None:
        s = s.masked_fill(~keep, -torch.inf)
    lse = s.logsumexp(-1)
    return lse.masked_fill(lse == -torch.inf, 0.0)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def compare(
    rank, world, *, seed, layout="contiguous", causal=False, mask=None, B=2, Hq=4, Hkv=None,
    n=8, m=None, E=8, Ev=None, scale=None, dtype="float32", grad=False, three_d=False,
):  # fmt: skip
    """This rank's output, LSE (and gradients) against sdpa.attention on the whole
    sequence and against the float64 oracle: the largest errors, for the test to judge.
    "*64" errors are against the oracle; "ref_*64" those of single-process sdpa.attention
    in the same dtype, for the 16-bit bounds."""
    dtype = getattr(torch, dtype)
    Hkv, m, Ev = Hkv or Hq, m or n, Ev or E
    L, S = n * world, m * world
    q, k, v, g = _inputs(seed, B, Hq, Hkv, L, S, E, Ev, dtype)
    if three_d:
        q, k, v, g = q[:, 0], k[:, 0], v[:, 0], g[:, 0]
    mk = _mask(mask, B, L, seed)
    whole = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    ref = sdpa.attention(*whole, mk, causal=causal, scale=scale)

    def cut(t):
        return sd.shard(t, rank, world, layout=layout).detach().clone().requires_grad_(grad)

    parts = [cut(t) for t in (q, k, v)]
    ours = sd.ring_attention(*parts, mk, causal=causal, scale=scale, layout=layout, timeout=60)
    keep = _keep(mask, B, L, seed)
    exact = [t.double().requires_grad_(grad) for t in (q, k, v)]
    exact_out = _oracle(*exact, keep, causal, scale)[0]

    def mine(t):  # this rank's part of a whole-sequence tensor
        return sd.shard(t, rank, world, layout=layout)

    exact_lse = _lse64(*exact[:2], keep, causal, scale)
    errors = {
        "out": _max_err(ours.output, mine(ref.output)),
        "lse": _max_err(ours.weights.lse, mine(ref.weights.lse[..., None])[..., 0]),
        "out64": _max_err(ours.output, mine(exact_out)),
        "ref_out64": _max_err(mine(ref.output), mine(exact_out)),
        "lse64": _max_err(ours.weights.lse, mine(exact_lse[..., None])[..., 0]),
    }
    if dtype in (torch.bfloat16, torch.float16):  # the oracle run in that dtype
        errors["oracle_out64"] = _max_err(
            mine(_oracle(q, k, v, keep, causal, scale, dtype=dtype)[0]), mine(exact_out)
        )
    if grad:
        (ref.output * g).sum().backward()
        (ours.output * mine(g)).sum().backward()
        (exact_out * g.double()).sum().backward()
        for name, part, full, x in zip("qkv", parts, whole, exact, strict=True):
            errors[f"d{name}"] = _max_err(part.grad, mine(full.grad))
            errors[f"d{name}64"] = _max_err(part.grad, mine(x.grad))
    return errors


def weights(rank, world, *, seed, layout="contiguous", causal=False, mask=None, Hkv=2):
    """Rows, entropy, top-k, row max and received sums of this rank against the float64
    oracle's weights of the gathered sequence."""
    B, Hq, n, E = 2, 4, 8, 8
    L = n * world
    q, k, v, _ = _inputs(seed, B, Hq, Hkv, L, L, E, E, torch.float32)
    mk = _mask(mask, B, L, seed)
    ours = sd.ring_attention(
        *(sd.shard(t, rank, world, layout=layout) for t in (q, k, v)), mk,
        causal=causal, layout=layout, timeout=60,
    ).weights  # fmt: skip
    pos = sd.positions(n, rank, world, layout)
    p = _oracle(q, k, v, _keep(mask, B, L, seed), causal, None)[1]  # (B, Hq, L, S) float64
    mine = p[:, :, pos]  # this rank's query rows
    plogp = torch.where(mine > 0, mine * mine.log(), torch.zeros_like(mine))
    i = int(torch.randint(n, (1,), generator=torch.Generator().manual_seed(seed + rank)))
    values, indices = ours.topk(3)
    return {
        "shape": int(ours.shape != torch.Size((B, Hq, n, L))),
        "row": _max_err(ours[1, :, i], mine[1, :, i]),
        "rows": _max_err(ours.full(), mine),
        "entropy": _max_err(ours.entropy(), -plogp.sum(-1)),
        "topk": _max_err(values, mine.topk(3, dim=-1).values),
        "topk_index": _max_err(mine.gather(-1, indices), values),
        "amax": _max_err(ours.amax(), mine.amax(-1)),
        # this rank's keys, the attention they receive from all L queries
        "sum": _max_err(ours.sum(dim=-2), p.sum(-2)[:, :, pos]),
        "mean": _max_err(ours.mean(dim=-2), p.mean(-2)[:, :, pos]),
    }


def disagree(rank, world, *, what):
    """Ranks that call with different shapes or masks, one rank with a bad mask, or one
    whose weights went stale: the error every rank raises (type and message), or None."""
    q = torch.randn(1, 2, 8, 4 if what != "shape" or rank == 0 else 6)  # (the head size)
    mask = "not a mask" if what == "bad_mask" and rank == world - 1 else None
    if what == "score_mod" and rank == world - 1:  # softcap / sinks: not run by the ring
        mask = masks.softcap(5.0, masks.causal())
    if what == "mask":  # same shapes, other document ids on the last rank
        ids = torch.arange(8 * world) // (4 if rank < world - 1 else 8)
        mask = masks.documents(ids)
    timeout = -1 if what == "timeout" and rank == world - 1 else 30
    if what == "batch5d":  # two batch dims, and a mask with one of 6
        q, mask = torch.randn(2, 3, 2, 8, 4), masks.padding([8] * 6)
    try:
        result = sd.ring_attention(q, q, q, mask, timeout=timeout)
        if what == "stale":
            if rank == world - 1:
                q.add_(1.0)  # e.g. an optimizer step before reading the weights
            result.weights.entropy()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def fail(rank, world, *, where, timeout):
    """The last rank fails in its first block of the forward ring (after the first
    transfer started), or skips the backward: how the others end, and after how long."""
    from sdpa.distributed import kernels

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    calls = [0]
    if where == "forward" and rank == world - 1:
        real = kernels.forward

        def broken(*args):
            calls[0] += 1  # the first block: its transfer to the next rank has started
            raise MemoryError("out of memory in a block")
            return real(*args)

        kernels.forward = broken
    t0 = time.monotonic()
    try:
        out = sd.ring_attention(q, q, q, timeout=timeout).output
        if where == "backward" and rank != world - 1:
            out.sum().backward()
        if where == "backward" and rank == world - 1:
            time.sleep(timeout + 2)
            return "skipped the backward"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"
    return None


def absent(rank, world, *, timeout):
    """Rank world-1 never calls: how the others fail, and after how long."""
    if rank == world - 1:
        time.sleep(timeout + 2)
        return "absent"
    q = torch.randn(1, 2, 8, 4)
    t0 = time.monotonic()
    try:
        sd.ring_attention(q, q, q, timeout=timeout)
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"
    return None


CASES = {
    "compare": compare,
    "weights": weights,
    "disagree": disagree,
    "absent": absent,
    "fail": fail,
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, target=None):
    """Start `world` workers (target(rank, world, port, tasks, results), default this
    module's worker); returns (send a case to all, collect their answers, stop)."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in range(world)]
    target = worker if target is None else target
    procs = [
        ctx.Process(target=target, args=(r, world, port, queues[r], results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()

    def run(name, wait=120, **kwargs):
        for q in queues:
            q.put((name, kwargs))
        got = {}
        deadline = time.monotonic() + wait
        while len(got) < world:
            rank, error, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            got[rank] = (error, value)
        return [got[r] for r in range(world)]

    def stop():
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    return run, stop
