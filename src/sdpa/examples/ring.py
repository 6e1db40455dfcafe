"""Ring attention across processes: one long sequence, one shard per rank.

Every rank draws the same (1, 4, L, 32) sequence from a seed (a real job would load
only its shard), keeps its zigzag shard, and runs causal ring attention forward and
backward; each rank reports its rows' entropy and the attention its keys receive, and
the result is checked against single-process sdpa.attention where that fits.

    torchrun --nproc-per-node 4 examples/ring.py              # CPU processes, gloo
    torchrun --nproc-per-node 8 examples/ring.py --length 65536  # GPUs: NCCL, cuda:LOCAL_RANK
    python examples/ring.py                                   # one process
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import sdpa
from sdpa import distributed as sd


def _init() -> torch.device:
    """Join the torchrun group (NCCL on GPUs, gloo on CPUs), or make a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="sequence length L")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32, help="head size")
    args = parser.parse_args(argv)
    device = _init()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        g = torch.Generator().manual_seed(0)
        whole = [torch.randn(1, args.heads, args.length, args.dim, generator=g) for _ in "qkv"]
        q, k, v = (
            sd.shard(t, rank, world, layout="zigzag").to(device).requires_grad_() for t in whole
        )
        result = sd.ring_attention(q, k, v, causal=True, layout="zigzag")
        result.output.square().mean().backward()  # a backward ring: gradients for the shards
        entropy = result.weights.entropy()  # (1, H, n) this rank's queries
        received = result.weights.sum(dim=-2)  # (1, H, n) this rank's keys, from all queries
        pos = sd.positions(q.shape[-2], rank, world, "zigzag")
        half = len(pos) // 2
        print(
            f"rank {rank}/{world}: positions {pos[0]}-{pos[half - 1]} and "
            f"{pos[half]}-{pos[-1]}, "
            f"output {tuple(result.output.shape)}, mean entropy {entropy.mean():.3f} nats, "
            f"most attended key {pos[received[0, 0].argmax()]}, "
            f"gradient norms |dq| {q.grad.norm():.3e}, |dk| {k.grad.norm():.3e}, "
            f"|dv| {v.grad.norm():.3e}",
            flush=True,
        )
        if args.length <= 8192:  # check against one process on the whole sequence
            ref = sdpa.attention(*(t.to(device) for t in whole), causal=True).output
            mine = sd.shard(ref, rank, world, layout="zigzag")
            err = (result.output.detach() - mine).abs().max().item()
            print(f"rank {rank}: max |ring - single process| = {err:.2e}", flush=True)
            if err > 1e-4:
                return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
