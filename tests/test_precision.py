"""Precision by flash-attention's rule, on a fixed set of seeds (issue 24, items 6 and 8).

Every engine's output, weights, statistics and LSE are within twice the error of the
same math in the input precision (the listing run in float32, or in the 16-bit dtype)
against the float64 oracle, with the floors of tests/tolerances.py where the listing
itself is exact. Reads of chosen keys or pairs cannot normalise their rows: they are
held to tolerances.selection_atol instead (the weights guide says so).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engines import BACKEND_ENGINES, refusal, run
from sdpa import masks

from oracle import oracle
from tolerances import OUT_FLOOR, STAT_FLOOR, WEIGHTS_FLOOR, selection_atol, within_rule

KINDS = ["none", "bool", "float", "causal", "softcap", "sinks"]


def _cases(n: int, seed: int = 0) -> list[tuple]:
    """Fixed random cases: (B, H, Hkv, L, S, E, scale, kind), sizes on and off the block
    edges, head sizes 16, 59 and 111, scales up to 2."""
    rnd = random.Random(seed)
    out = [(1, 1, 1, 130, 129, 59, 1.7, "none")]  # issue 24's case: 2.1x torch's error
    while len(out) < n:
        L = rnd.choice([1, 7, 64, 65, 129, 130, 257])
        kind = rnd.choice(KINDS)
        S = L if kind == "causal" else rnd.choice([1, 7, 64, 65, 129, 130, 257])
        H = rnd.choice([1, 2, 4])
        Hkv = rnd.choice([h for h in (1, 2, 4) if H % h == 0])
        E = rnd.choice([16, 59, 111])
        out.append((rnd.choice([1, 2]), H, Hkv, L, S, E, rnd.choice([None, 0.3, 1.7, 2.0]), kind))
    return out


CASES = _cases(24)


def _inputs(case, seed, dtype=torch.float32):
    B, H, Hkv, L, S, E, scale, kind = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, E, generator=g) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    mask = arg = softcap = sinks = None
    if kind == "bool":
        mask = arg = torch.rand(B, 1, L, S, generator=g) < 0.7
    elif kind == "float":
        mask = arg = torch.randn(B, 1, L, S, generator=g) * 2
    elif kind == "causal":
        arg, mask = masks.causal(), masks.causal().materialize(L, S)
    elif kind == "softcap":
        softcap, arg = 1.5, masks.softcap(1.5)
    elif kind == "sinks":
        z = torch.randn(H, 1, 1, generator=g)
        arg, sinks = masks.sinks(z), z[..., 0].expand(B, H, L)
    return [t.to(dtype) for t in (q, k, v)], mask, arg, softcap, sinks, scale


def _lse(q, k, mask, scale, softcap, sinks, dtype):
    """The LSE of the scores in `dtype` (the listing's logsumexp, the sink's column in)."""
    q, k = q.to(dtype), k.to(dtype)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = q @ k.mT * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask.to(dtype) if mask.is_floating_point() else s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype)[..., None].expand(*s.shape[:-1], 1)], -1)
    lse = torch.logsumexp(s, -1)
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _entropy(p):
    return -torch.where(p > 0, p * torch.where(p > 0, p, 1.0).log(), 0.0).sum(-1)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("i", range(len(CASES)))
def test_float32_within_twice_the_listings_error(engine, i):
    case = CASES[i]
    (q, k, v), mask, arg, softcap, sinks, scale = _inputs(case, 1000 + i)
    why = refusal(engine, q, k, v, arg, scale=scale)
    if why:
        pytest.skip(f"{engine}: {why}")
    E = q.shape[-1]
    sc = 1 / math.sqrt(E) if scale is None else scale
    out, w, reads = run(engine, q, k, v, arg, scale=scale)
    with reads:
        o64, p64 = oracle(q, k, v, mask, scale=sc, softcap=softcap, sinks=sinks)
        o32, p32 = oracle(
            q, k, v, mask, scale=sc, softcap=softcap, sinks=sinks, dtype=torch.float32
        )
        checks = {
            "output": (out, o32, o64, OUT_FLOOR),
            "weights": (w.full(), p32, p64, WEIGHTS_FLOOR),
            "rows": (w[:, :, q.shape[2] // 2], p32[:, :, q.shape[2] // 2],
                     p64[:, :, q.shape[2] // 2], WEIGHTS_FLOOR),
            "sum": (w.sum(dim=-2), p32.sum(-2), p64.sum(-2), STAT_FLOOR),
            "entropy": (w.entropy(), _entropy(p32), _entropy(p64), STAT_FLOOR),
            "amax": (w.amax(-1), p32.amax(-1), p64.amax(-1), WEIGHTS_FLOOR),
            "topk": (w.topk(1)[0], p32.topk(1, dim=-1)[0], p64.topk(1, dim=-1)[0],
                     WEIGHTS_FLOOR),
            "lse": (w.lse, _lse(q, k, mask, sc, softcap, sinks, torch.float32),
                    _lse(q, k, mask, sc, softcap, sinks, torch.float64), STAT_FLOOR),
        }  # fmt: skip
        failed = []
        for name, (ours, listing, truth, floor) in checks.items():
            ok, mine, theirs = within_rule(ours, listing, truth, floor)
            if not ok:
                failed.append(f"{name} {mine:.2e} > 2 x {theirs:.2e} (served by {w.served_by})")
        S = k.shape[2]
        keys = [0, S // 2, S - 1]
        err = (w[..., keys].double() - p64[..., keys]).abs().max().item()
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        bound = selection_atol(w.lse, (q.double() @ kk.double().mT).abs().max().item() * sc)
        if err > bound:
            failed.append(f"key columns {err:.2e} > {bound:.2e}")
    assert not failed, f"{case}: " + "; ".join(failed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("i", range(0, len(CASES), 3))
def test_16_bit_within_twice_the_listings_error(dtype, engine, i):
    """Outputs within 2x the listing's error in that dtype; the weights and statistics
    come back in float32 (better than the 16-bit listing's, held to it all the same)."""
    case = CASES[i]
    (q, k, v), mask, arg, softcap, sinks, scale = _inputs(case, 2000 + i, dtype)
    why = refusal(engine, q, k, v, arg, scale=scale)
    if why:
        pytest.skip(f"{engine}: {why}")
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, w, reads = run(engine, q, k, v, arg, scale=scale)
    o64, p64 = oracle(q, k, v, mask, scale=sc, softcap=softcap, sinks=sinks)
    o16, p16 = oracle(q, k, v, mask, scale=sc, softcap=softcap, sinks=sinks, dtype=dtype)
    with reads:
        p, entropy = w.full(), w.entropy()
    for name, ours, listing, truth in (
        ("output", out, o16, o64),
        ("weights", p, p16, p64),
        ("entropy", entropy, _entropy(p16.float()), _entropy(p64)),
    ):
        ok, mine, theirs = within_rule(ours, listing, truth, 1e-3 if name == "output" else 1e-4)
        assert ok, f"{case} {name}: {mine:.2e} > 2 x {theirs:.2e}"
