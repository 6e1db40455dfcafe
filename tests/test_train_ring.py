"""Ring attention's weights carry gradients: every read of RingWeights, summed over the
ranks, gives the key and query shards the gradient single-process sdpa.attention gives
the whole sequence (2 gloo processes); ranks that disagree on gradients raise at once."""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)

WORLD = 2
B, HQ, HKV, L, E = 2, 4, 2, 16, 8  # L = S: the whole sequence, n = L / WORLD per rank


def _reads(w, g, own_q, own_k, picked, teacher):
    """A loss over every read of the weights w (this rank's rows, or the whole), each
    weighted by a fixed random tensor of the whole sequence sliced to w's rows (own_q)
    and keys (own_k); picked: w's row indices of the rows read one by one."""
    values, _ = w.topk(3)
    parts = [
        (w.entropy() * g["rows"][..., own_q]).sum(),
        (w.sum(dim=-2) * g["keys"][..., own_k]).sum(),
        (values * g["top"][..., own_q, :]).sum(),
        (w.full() * g["full"][..., own_q, :]).sum(),
        (w[1, :, picked] * g["full"][1, :, own_q[picked]]).sum(),
        (w.amax(-1) * g["rows"][..., own_q]).sum(),
        (w.lse * g["rows"][..., own_q]).sum(),
        (w.kl(teacher) * g["rows"][..., own_q]).sum(),  # a distillation loss: into w's side
    ]
    return sum(parts)


def grads_case(rank, world, *, layout, causal, sizes=None):
    """|ours - single process| of dq and dk on this rank's shards, and of the loss."""
    import sdpa
    from sdpa import distributed as sd

    gen = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    q, k, v = (torch.randn(B, h, L, E, generator=gen) for h in (HQ, HKV, HKV))
    g = {
        "rows": torch.randn(B, HQ, L, generator=gen),
        "keys": torch.randn(B, HQ, L, generator=gen),
        "top": torch.randn(B, HQ, L, 3, generator=gen),
        "full": torch.randn(B, HQ, L, L, generator=gen),
    }
    every = torch.arange(L)
    n = [L // world] * world if sizes is None else sizes
    pos = [sd.positions(n[r], r, world, layout, sizes=sizes) for r in range(world)]
    q2 = torch.randn(q.shape, generator=gen)  # the teacher's queries (no gradient)
    whole = [t.clone().requires_grad_() for t in (q, k)]
    w = sdpa.attention(*whole, v, causal=causal).weights
    t = sdpa.attention(q2, k, v, causal=causal).weights
    total = _reads(w, g, every, every, [int(p[2]) for p in pos], t)  # row 2 of each rank
    total.backward()

    def cut(t):
        return sd.shard(t, rank, world, layout=layout, sizes=sizes)

    parts = [cut(t).clone().requires_grad_() for t in (q, k)]
    vs = cut(v)
    ours = sd.ring_attention(*parts, vs, causal=causal, layout=layout, timeout=60).weights
    teacher = sd.ring_attention(
        cut(q2), cut(k), vs,
        causal=causal, layout=layout, timeout=60,
    ).weights  # fmt: skip
    mine = _reads(ours, g, pos[rank], pos[rank], [2] if len(pos[rank]) > 2 else [], teacher)
    mine.backward()  # a collective: every rank runs it
    loss = mine.detach().clone()
    dist.all_reduce(loss)
    return {
        "dq": (parts[0].grad - cut(whole[0].grad)).abs().max(),
        "dk": (parts[1].grad - cut(whole[1].grad)).abs().max(),
        "dk_size": whole[1].grad.abs().max(),
        "loss": (loss - total.detach()).abs(),
    }


def disagree_case(rank, world):
    """Rank 0's shards require grad, rank 1's do not: the error each rank raises."""
    from sdpa import distributed as sd

    q = torch.randn(1, 2, 8, 4, requires_grad=rank == 0)
    w = sd.ring_attention(q, q, q, timeout=30).weights
    try:
        w.entropy()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


CASES = {"grads": grads_case, "disagree": disagree_case}


def worker(rank, world, port, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    while (task := tasks.get()) is not None:
        name, kwargs = task
        try:
            results.put((rank, None, CASES[name](rank, world, **kwargs)))
        except Exception as e:
            results.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring():
    import ring_cases  # (the suite's workers, with this module's cases)

    run, stop = ring_cases.spawn(WORLD, worker)
    yield run
    stop()


@pytest.mark.parametrize(
    "layout,causal,sizes",
    [("contiguous", False, None), ("zigzag", True, None), ("contiguous", True, [5, 11])],
    ids=["contiguous", "zigzag", "unequal"],
)
def test_every_read_of_ring_weights_gives_single_process_gradients(ring, layout, causal, sizes):
    answers = ring("grads", layout=layout, causal=causal, sizes=sizes)
    for rank, (error, errors) in enumerate(answers):
        assert error is None, f"rank {rank}: {error}"
        assert errors["dk_size"] > 0.1  # the reads do reach the keys
        assert errors["loss"] < 1e-4, errors
        assert errors["dq"] < 1e-4 and errors["dk"] < 1e-4, (rank, errors)


def test_ranks_that_differ_on_gradients_raise_at_once(ring):
    answers = ring("disagree")
    for rank, (error, said) in enumerate(answers):
        assert error is None, f"rank {rank}: {error}"
        assert said is not None and said.startswith("RingError"), said
        assert "gradients to different shards" in said
        assert "rank 0 ['query', 'key'], rank 1 none" in said
