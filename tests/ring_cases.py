"""Worker processes for the ring attention tests: a gloo group that stays up for many
cases, each checked on every rank against single-process sdpa.attention and against the
float64 oracle (tests/oracle.py) on the gathered sequence."""

from __future__ import annotations

import datetime
import math
import time
import traceback

import torch
import torch.distributed as dist

import sdpa
from sdpa import distributed as sd
from sdpa import masks
from sdpa.distributed.layout import PerDocument, Rearranged

from oracle import oracle


def worker(rank: int, world: int, port: int, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    if world in (4, 8):  # the hybrid's groups, made once (every rank makes every group)
        GROUPS.update(_grid(rank, world))
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


GROUPS: dict = {}
U = 2  # the hybrid's Ulysses group size


def _grid(rank: int, world: int) -> dict:
    """The hybrid's groups over `world` ranks, U * R: Ulysses groups [j, j + R, ...] and
    ring groups [u * R, ..., u * R + R - 1], so that a rank's place in the sequence
    (j * U + u) is not its global rank."""
    R = world // U
    groups = {"ulysses": None, "ring": None}
    for j in range(R):
        g = dist.new_group([j + u * R for u in range(U)])
        if rank % R == j:
            groups["ulysses"] = g
    for u in range(U):
        g = dist.new_group([u * R + j for j in range(R)])
        if rank // R == u:
            groups["ring"] = g
    if world == 4:  # ring groups that join different places of the Ulysses groups
        for members in ([0, 3], [1, 2]):
            g = dist.new_group(members)
            if rank in members:
                groups["mixed_ring"] = g
    return {**groups, "place": (rank % R) * U + rank // R}


def run_scheme(scheme, q, k, v, mask, **kwargs):
    """One of sdpa.distributed's three schemes on this rank's shards."""
    if scheme == "ring":
        return sd.ring_attention(q, k, v, mask, **kwargs)
    if scheme == "ulysses":
        return sd.ulysses_attention(q, k, v, mask, **kwargs)
    return sd.hybrid_attention(
        q, k, v, mask, ulysses_group=GROUPS["ulysses"], ring_group=GROUPS["ring"], **kwargs
    )


def place(rank: int, scheme: str) -> int:
    """This rank's shard's index in the sequence."""
    return GROUPS["place"] if scheme == "hybrid" else rank


UNEQUAL = [7, 0, 12, 5, 9, 1, 4, 6]  # shard sizes (the first `world`): one empty


def shard_sizes(kind, world: int, n: int):
    """Every rank's shard size: None (equal, n each), or "unequal"."""
    return None if kind is None else UNEQUAL[:world]


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
    if kind == "packed":
        return masks.documents(_packed(L))
    raise ValueError(kind)


def _packed(L):
    """Document ids of the per_document layout's documents: 4/12, 2/12, 6/12 of L."""
    w = L // 12
    return torch.repeat_interleave(torch.arange(3), torch.tensor([4 * w, 2 * w, 6 * w]))


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
    if kind == "packed":
        ids = _packed(L)
        return (ids[:, None] == ids[None, :])[None, None]
    raise ValueError(kind)


def _oracle(q, k, v, keep, causal, scale, dtype=torch.float64):
    """The float64 oracle on the gathered sequence: (out, p), differentiable in q, k, v."""
    if keep is not None and q.ndim == 3:  # (B, L, E): the mask without its head dim
        keep = keep[:, 0]
    if keep is None or not keep.is_floating_point():
        return oracle(q, k, v, keep, causal=causal, scale=scale, dtype=dtype)
    # a float mask's rows that see no key: out 0 and no gradient, written out here (the
    # listing's softmax of -inf alone gives NaN gradients)
    seen = ~torch.isneginf(keep)
    if causal:
        seen = seen & torch.ones(keep.shape[-2:], dtype=torch.bool).tril()
    dead = ~seen.any(-1, keepdim=True)
    out, p = oracle(q, k, v, keep.masked_fill(dead, 0.0), causal=causal, scale=scale, dtype=dtype)
    return out.masked_fill(dead, 0.0), p.masked_fill(dead, 0.0)


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
    if keep is not None and keep.is_floating_point():
        s = s + keep.double()
    elif keep is not None:
        s = s.masked_fill(~keep, -torch.inf)
    lse = s.logsumexp(-1)
    return lse.masked_fill(lse == -torch.inf, 0.0)


def _scores64(q, k, keep, causal):
    """The raw scores (default scale, plus a float mask) in float64, -inf where masked:
    (B, Hq, L, S)."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.mT * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    if keep is not None and keep.is_floating_point():
        return s + keep.double()
    return s if keep is None else s.masked_fill(~keep, -torch.inf)


def _max_err(a, b):
    """The largest |a - b|, equal infinities counting as 0 (rows that see no key)."""
    a, b = a.double(), b.double()
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    same = a == b
    return torch.where(same, 0.0, (a - b).abs()).max().item()


def _layout(layout, world):
    """A layout by name; "per_document": documents of 4 * world, 2 * world and 6 * world
    positions (12 * world in all), cut head-tail each."""
    if layout == "per_document":
        return sd.per_document([4 * world, 2 * world, 6 * world])
    if layout == "rearranged":  # blocks of 4 positions in a random order, 12 * world in all
        blocks = torch.randperm(3 * world, generator=torch.Generator().manual_seed(world))
        return sd.rearranged((blocks[:, None] * 4 + torch.arange(4)).flatten())
    return layout


def compare(
    rank, world, *, seed, layout="contiguous", causal=False, mask=None, B=2, Hq=4, Hkv=None,
    n=8, m=None, E=8, Ev=None, scale=None, dtype="float32", grad=False, three_d=False,
    scheme="ring", sizes=None,
):  # fmt: skip
    """This rank's output, LSE (and gradients) against sdpa.attention on the whole
    sequence and against the float64 oracle: the largest errors, for the test to judge.
    "*64" errors are against the oracle; "ref_*64" those of single-process sdpa.attention
    in the same dtype, for the 16-bit bounds. scheme: ring, ulysses or hybrid; sizes:
    "unequal" for shards of UNEQUAL sizes (queries and keys alike; contiguous layout)."""
    dtype = getattr(torch, dtype)
    layout = _layout(layout, world)
    if isinstance(layout, PerDocument | Rearranged):
        n = 12
    Hkv, m, Ev = Hkv or Hq, m or n, Ev or E
    cuts = shard_sizes(sizes, world, n)
    L, S = (n * world, m * world) if cuts is None else (sum(cuts), sum(cuts))
    q, k, v, g = _inputs(seed, B, Hq, Hkv, L, S, E, Ev, dtype)
    if three_d:
        q, k, v, g = q[:, 0], k[:, 0], v[:, 0], g[:, 0]

    def mine(t, dim=-2):  # this rank's part of a whole-sequence tensor
        return sd.shard(t, place(rank, scheme), world, layout=layout, sizes=cuts, dim=dim)

    mk, given, keep = _masks(mask, B, Hq, L, S, seed, grad, mine)
    whole = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    ref = sdpa.attention(*whole, mk, causal=causal, scale=scale)
    parts = [mine(t).detach().clone().requires_grad_(grad) for t in (q, k, v)]
    ours = run_scheme(scheme, *parts, given, causal=causal, scale=scale, layout=layout, timeout=60)
    if mask in TENSOR_MASKS:
        keep = keep.detach()
    exact = [t.double().requires_grad_(grad) for t in (q, k, v)]
    exact_out = _oracle(*exact, keep, causal, scale)[0]

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
        if isinstance(given, torch.Tensor) and given.requires_grad:  # a float mask's
            errors["dmask"] = _max_err(given.grad, mine(mk.grad))
    return errors


TENSOR_MASKS = ("rows", "bias", "key_padding")


def _masks(kind, B, Hq, L, S, seed, grad, mine):
    """(the mask of single-process attention, what this rank passes, the oracle's mask)
    for a structured or tensor mask kind; mine(t, dim) cuts this rank's part."""
    if kind not in TENSOR_MASKS:
        mk = _mask(kind, B, L, seed)
        return mk, mk, _keep(kind, B, L, seed)
    mk = _tensor_mask(kind, B, Hq, L, S, seed).requires_grad_(grad and kind == "bias")
    if kind == "key_padding":
        return mk, sd.key_padding(mine(mk[:, 0, 0], dim=-1)), mk
    return mk, mine(mk.detach()).clone().requires_grad_(mk.requires_grad), mk.detach()


def _tensor_mask(kind, B, Hq, L, S, seed):
    """A tensor mask of the whole sequence: "rows" bool (B, 1, L, S) with a row that sees
    nothing; "bias" float (B, Hq, L, S) with -inf entries and a row of them; "key_padding"
    bool (B, 1, 1, S) (True = a real key)."""
    g = torch.Generator().manual_seed(seed + 2)
    if kind == "rows":
        keep = torch.rand(B, 1, L, S, generator=g) < 0.6
        keep[:, :, L // 2] = False
        return keep
    if kind == "bias":
        bias = torch.randn(B, Hq, L, S, generator=g)
        bias = bias.masked_fill(torch.rand(B, Hq, L, S, generator=g) < 0.2, -torch.inf)
        bias[:, 1, L // 3] = -torch.inf
        return bias
    keep = torch.rand(B, 1, 1, S, generator=g) < 0.7
    keep[0, :, :, : S // 2] = False  # whole shards of padding
    return keep


def weights(
    rank, world, *, seed, layout="contiguous", causal=False, mask=None, Hkv=2, scheme="ring",
    sizes=None,
):  # fmt: skip
    """Rows, columns, entropy, top-k, row max, max logits, KL against a second call's
    weights, and received sums of this rank against the float64 oracle's weights of the
    gathered sequence."""
    B, Hq, E = 2, 4, 8
    layout = _layout(layout, world)
    n = 12 if isinstance(layout, PerDocument | Rearranged) else 8
    cuts = shard_sizes(sizes, world, n)
    L = n * world if cuts is None else sum(cuts)
    q, k, v, _ = _inputs(seed, B, Hq, Hkv, L, L, E, E, torch.float32)
    q2 = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 7))
    where = place(rank, scheme)

    def mine(t, dim=-2):
        return sd.shard(t, where, world, layout=layout, sizes=cuts, dim=dim)

    _, given, keep = _masks(mask, B, Hq, L, L, seed, False, mine)
    ours, teacher = (
        run_scheme(scheme, mine(x), mine(k), mine(v), given, causal=causal, layout=layout,
                   timeout=60).weights
        for x in (q, q2)
    )  # fmt: skip
    n = len(pos := sd.positions(mine(q).shape[-2], where, world, layout, sizes=cuts))
    p = _oracle(q, k, v, keep, causal, None)[1]  # (B, Hq, L, S) float64
    mine_p, p_t = p[:, :, pos], _oracle(q2, k, v, keep, causal, None)[1][:, :, pos]
    plogp = torch.where(mine_p > 0, mine_p * mine_p.log(), torch.zeros_like(mine_p))
    kl = torch.where(p_t > 0, p_t * (p_t.log() - mine_p.log()), torch.zeros_like(p_t)).sum(-1)
    i = int(torch.randint(max(n, 1), (1,), generator=torch.Generator().manual_seed(seed + rank)))
    j = int(torch.randint(L, (1,), generator=torch.Generator().manual_seed(seed)))
    values, indices = ours.topk(3)
    logits = _scores64(q, k, keep, causal)
    top = ours.max_logits()
    errors = {
        "shape": int(ours.shape != torch.Size((B, Hq, n, L))),
        "rows": _max_err(ours.full(), mine_p),
        "column": _max_err(ours[..., j], mine_p[..., j]),
        "entropy": _max_err(ours.entropy(), -plogp.sum(-1)),
        "topk": _max_err(values, mine_p.topk(3, dim=-1).values),
        "topk_index": _max_err(mine_p.gather(-1, indices), values),
        "amax": _max_err(ours.amax(), mine_p.amax(-1)),
        "kl": _max_err(ours.kl(teacher), kl),
        "max_logits_row": _max_err(top.row, logits.amax(-1)[:, :, pos]),
        "max_logits_head": _max_err(top.head, logits.amax(-1).amax(-1)),  # every rank's rows
        # this rank's keys, the attention they receive from all L queries
        "sum": _max_err(ours.sum(dim=-2), p.sum(-2)[:, :, pos]),
        "mean": _max_err(ours.mean(dim=-2), p.mean(-2)[:, :, pos]),
    }
    errors["row"] = _max_err(ours[1, :, i : i + 1], mine_p[1, :, i : i + 1])  # (none if n = 0)
    return errors


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
    call = sd.ring_attention
    if what == "heads":  # 5 query heads do not split across the group
        q, call = torch.randn(1, 5, 8, 4), sd.ulysses_attention
    if what == "mixed_ring":  # the hybrid with a ring group across Ulysses places
        return _said(lambda: sd.hybrid_attention(
            q, q, q, ulysses_group=GROUPS["ulysses"], ring_group=GROUPS["mixed_ring"],
            timeout=timeout,
        ))  # fmt: skip
    if what == "zigzag_sizes":  # shards of unequal sizes cannot be zigzag
        q = torch.randn(1, 2, 8 if rank else 6, 4)
        return _said(lambda: sd.ring_attention(q, q, q, layout="zigzag", timeout=timeout))
    try:
        result = call(q, q, q, mask, timeout=timeout)
        if what == "stale":
            if rank == world - 1:
                q.add_(1.0)  # e.g. an optimizer step before reading the weights
            result.weights.entropy()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def qk_clip(rank, world, *, seed):
    """Two data-parallel replicas (the hybrid grid's ring groups, each its own sequence)
    run ring attention over their ring group; max_logits(group=the Ulysses group, which
    joins the replicas) gives every rank the per-head maximum over both sequences:
    (error of this rank's rows, error of the head maximum) against the float64 scores."""
    R = world // U
    replica = rank // R  # = this rank's index in its Ulysses group
    seqs = [_inputs(seed + r, 1, 4, 2, 8 * R, 8 * R, 8, 8, torch.float32) for r in range(U)]
    q, k, v, _ = seqs[replica]
    j = rank % R
    w = sd.ring_attention(
        *(sd.shard(t, j, R) for t in (q, k, v)), causal=True, group=GROUPS["ring"], timeout=60
    ).weights
    top = w.max_logits(group=GROUPS["ulysses"])
    mine = _scores64(q, k, None, True).amax(-1)[:, :, sd.positions(8, j, R)]
    heads = torch.stack([_scores64(a, b, None, True).amax((-1, -2)) for a, b, *_ in seqs])
    return _max_err(top.row, mine), _max_err(top.head, heads.amax(0))


def local_only(rank, world):
    """What a rank may do with its weights alone (it never waits for the others): repr,
    print, shape, dtype, device; numpy() and np.asarray refuse, naming the collective."""
    import numpy as np

    w = sd.ring_attention(*(torch.randn(1, 2, 3 + rank, 4) for _ in range(3)), timeout=5).weights
    said = [repr(w), str(w), tuple(w.shape), str(w.dtype), str(w.device)]
    for convert in (w.numpy, lambda: np.asarray(w), lambda: list(w)):
        said.append(_said(convert))
    return said


def lonely_read(rank, world, *, timeout):
    """Only the last rank reads the weights: its error (the others return None)."""
    q = torch.randn(1, 2, 8, 4)
    w = sd.ring_attention(q, q, q, timeout=timeout).weights
    if rank != world - 1:
        time.sleep(timeout + 2)
        return None
    return _said(w.entropy)


def _said(f):
    try:
        f()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _kv_bytes(B, H, m, E, Ev, itemsize=4):
    return B * H * m * (E + Ev) * itemsize


def traffic(rank, world, *, scheme, kind):
    """Bytes this rank sent in a forward and in a backward, by what they carried, and
    the scheme's theory, written out from the shapes. kind: "dense" (equal shards),
    "unequal" (UNEQUAL sizes, one empty), "causal" (contiguous, equal), "documents"
    (UNEQUAL sizes, documents that end where the shards end)."""
    B, Hq, Hkv, E, Ev, n = 1, 4, 2, 8, 4, 8
    sizes = UNEQUAL[:world] if kind in ("unequal", "documents") else [n] * world
    L = sum(sizes)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = _inputs(0, B, Hq, Hkv, L, L, E, Ev, torch.float32)
    mask = None
    if kind == "documents":  # one document per shard
        mask = masks.documents(torch.repeat_interleave(torch.arange(world), torch.tensor(sizes)))
    where = place(rank, scheme)
    if kind == "key_padding":  # (B, m) of this rank's keys, travelling with them
        mask = sd.key_padding(torch.ones(B, sizes[where], dtype=torch.bool))
    parts = [sd.shard(t, where, world, sizes=sizes).clone().requires_grad_() for t in (q, k, v)]
    with sd.traffic() as forward:
        out = run_scheme(scheme, *parts, mask, causal=kind == "causal", timeout=60).output
    with sd.traffic() as backward:
        (out * sd.shard(grad, where, world, sizes=sizes)).sum().backward()
    del g
    Uw = {"ring": 1, "ulysses": world, "hybrid": U}[scheme]
    Rw = world // Uw
    j, u = divmod(where, Uw)  # this rank's ring place and Ulysses member
    theory = {"forward": {}, "backward": {}}
    f, b = theory["forward"], theory["backward"]
    hq = Hq // Uw
    hkv = math.lcm(Hkv, Uw) // Uw  # key/value heads per member, repeated to divide by U
    members = [sizes[i * Uw : (i + 1) * Uw] for i in range(Rw)]  # each ring place's shards
    chunk = [sum(ms) for ms in members]
    mine, group = sizes[where], members[j]
    if Uw > 1:  # the all-to-alls: this rank's heads of others out, others' rows of its heads back
        f["q"] = (Uw - 1) * B * hq * mine * E * 4
        f["kv"] = (Uw - 1) * _kv_bytes(B, hkv, mine, E, Ev)
        f["out"] = sum(B * hq * group[x] * Ev * 4 for x in range(Uw) if x != u)
        f["lse"] = sum(B * hq * group[x] * 4 for x in range(Uw) if x != u)
        b["grad"] = (Uw - 1) * B * hq * mine * Ev * 4  # dout, this rank's rows
        b["grad"] += sum(  # dq, dk, dv of the others' rows
            B * hq * group[x] * E * 4 + _kv_bytes(B, hkv, group[x], E, Ev)
            for x in range(Uw) if x != u
        )  # fmt: skip

    def needs(a, c):  # ring place a's queries see some key of place c's chunk
        if not chunk[a] or not chunk[c]:
            return False
        return {"causal": c <= a, "documents": a == c}.get(kind, True)

    senders = [d for d in range(Rw) if d != j and needs(d, j)]
    ring_kv = sum(_kv_bytes(B, hkv, chunk[j], E, Ev) for d in senders)
    if kind == "key_padding":  # B * m bytes with each shard; Ulysses: every member's
        f["mask"] = b["mask"] = B * chunk[j] * len(senders)
        f["mask"] += (Uw - 1) * B * mine
    if Rw > 1:
        f["kv"] = f.get("kv", 0) + ring_kv
        b["kv"] = ring_kv  # the shards again
        b["grad"] = b.get("grad", 0) + sum(
            _kv_bytes(B, hkv, chunk[c], E, Ev) for c in range(Rw) if c != j and needs(j, c)
        )
    structured = isinstance(mask, masks.Mask)
    agrees = 2 if structured and Rw > 1 else 1  # the header; with a structured mask, the plan
    f["control"] = 4096 * ((Uw - 1) + (Rw - 1) * agrees)
    return {
        "forward": {w: nb for w, nb in forward.sent.items() if nb},
        "backward": {w: nb for w, nb in backward.sent.items() if nb},
        "theory": {phase: {w: nb for w, nb in t.items() if nb} for phase, t in theory.items()},
    }


def fail(rank, world, *, where, timeout, scheme="ring"):
    """The last rank fails in its first block of the forward (after the first transfer
    started), or skips the backward: how the others end, and after how long."""
    from sdpa.distributed import kernels

    q = torch.randn(1, 12, 8, 4, requires_grad=True)
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
        out = run_scheme(scheme, q, q, q, None, timeout=timeout).output
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
    "qk_clip": qk_clip,
    "lonely_read": lonely_read,
    "local_only": local_only,
    "traffic": traffic,
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
        """Every rank's (error, answer) to case `name`."""
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

    run.world = world
    return run, stop
