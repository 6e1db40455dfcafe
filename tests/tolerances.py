"""Every tolerance the oracle tests use, in one place, with what it means.

fp32 results are held to flash-attention's rule: within RATIO times the error of the
same math in float32 (the listing, tests/oracle.py with dtype=float32) against the
float64 oracle, with a floor of a few units in the last place where the listing itself
is exact. 16-bit results: 2x (outputs) and 3x (gradients) the listing's error in that
dtype.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps

RATIO = 2.0  # ours / the listing's error, fp32 and 16-bit outputs, weights, statistics
GRAD_RATIO = 3.0  # gradients in 16-bit
OUT_FLOOR = 2e-5  # fp32 outputs: the listing's error floor (issue 19's rule)
WEIGHTS_FLOOR = 4 * EPS32  # fp32 weights and statistics in [0, 1]: four ulps of 1
STAT_FLOOR = 16 * EPS32  # fp32 entropy (nats) and sums over rows

ATOL = 2e-5  # fp32 outputs and weights against the oracle, at the suite's small sizes
GRAD_ATOL = 1e-4  # fp32 gradients against the oracle's autograd


def within_rule(
    ours: torch.Tensor,
    listing: torch.Tensor,
    truth: torch.Tensor,
    floor: float,
    ratio: float = RATIO,
) -> tuple[bool, float, float]:
    """(ours within ratio x the listing's error or the floor, our error, the listing's)."""
    mine = (ours.double() - truth).abs().max().item() if truth.numel() else 0.0
    theirs = (listing.double() - truth).abs().max().item() if truth.numel() else 0.0
    return mine <= max(ratio * theirs, floor), mine, theirs


def selection_atol(lse: torch.Tensor, raw: float = 0.0) -> float:
    """Reads of chosen keys or pairs cannot normalise their rows: p = exp(s - lse), whose
    error is that of the score, computed twice (once for the LSE, once for the read),
    plus the LSE's rounding: about eps x (|lse| + the largest |scale q . k| before any
    softcap, `raw`)."""
    top = float(lse.abs().max()) if lse.numel() else 0.0
    return 8 * EPS32 * max(2.0, top, raw)
