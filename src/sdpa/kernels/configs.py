"""Pinned launch configs of the statistics kernels: block sizes, warps, stages.

Chosen ahead for sm90 (H100 / H200), not autotuned: tuning every shape would dominate
short runs and make timings depend on what ran first. One table per kernel, keyed by
the input's width class and the head block:

    kernel      16-bit, head <= 128                float32 or head > 128    interpreted
    entropy     128 x  64, 4 warps, 3 st, pipelined  64 x 32, 4 warps, 2 st   16 x 16
    received    128 x  64, 4 warps, 3 st, pipelined  64 x 32, 4 warps, 2 st   16 x 16
    max_logits  128 x 128, 8 warps, 3 st              64 x 32, 4 warps, 2 st   16 x 16

BLOCK_M x BLOCK_N is the tile of the score matrix a program holds: rows are the tile's
resident side (queries for entropy and max logits, keys for received), columns the side
streamed in the loop. Why these (docs/guide/gpu-kernels.md has the numbers, from
scripts/kernel_report.py): at head 128 the two softmax kernels spend as long in exp2
(16 per clock per SM) as in the tensor cores, so they take 80 KiB of shared memory
(Q 32 KiB + 3 stages of 16 KiB) and one warpgroup, two programs per SM, and pipeline
the unmasked loop (the next tile's product runs while this tile's exponentials do;
226 registers under triton 3.6, no spills); max logits has no exponential and takes
the larger GEMM tile.

`use(config)` forces one config in this context (tests run the sm90 tiles under the
interpreter with it; scripts/gpu_check/gpu_bench.py times the unpipelined variant with it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import torch


class Config(NamedTuple):
    """One launch: the score tile a program holds (rows x streamed columns), warps per
    program, software-pipelining stages of the loads, and whether the unmasked loop of
    the softmax kernels issues the next tile's product before this tile's exponentials
    (FlashAttention-3's intra-warpgroup overlap: twice the score registers)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    pipelined: bool = False  # entropy, received: the next tile's Q K^T overlaps this exp2


SM90 = {  # kernel -> (16-bit with head block <= 128, float32 or wider heads)
    "entropy": (Config(128, 64, 4, 3, pipelined=True), Config(64, 32, 4, 2)),
    "received": (Config(128, 64, 4, 3, pipelined=True), Config(64, 32, 4, 2)),
    "max_logits": (Config(128, 128, 8, 3), Config(64, 32, 4, 2)),
}
INTERPRETED = Config(16, 16, 4, 1)  # the interpreter: small tiles run fastest

_FORCED: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "sdpa_kernel_config", default=None
)


def pick(kernel: str, dtype: torch.dtype, block_d: int, interpreted: bool) -> Config:
    """The config `kernel` launches with for inputs of `dtype` and head block `block_d`."""
    forced = _FORCED.get()
    if forced is not None:
        return forced
    if interpreted:
        return INTERPRETED
    narrow, wide = SM90[kernel]
    return wide if dtype == torch.float32 or block_d > 128 else narrow


@contextlib.contextmanager
def use(config: Config) -> Iterator[None]:
    """Launch every statistics kernel with `config` inside this block (this thread or
    task only)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a sdpa.kernels.configs.Config, got {config!r}")
    token = _FORCED.set(config)
    try:
        yield
    finally:
        _FORCED.reset(token)
