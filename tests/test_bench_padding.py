"""benchmarks/bench_padding.py: its --quick run times the padded step (skipped, masked)
against the unpadded one, and each side's step is the attention part it says it is."""

from __future__ import annotations

import torch

from loader import load_file, quick_rows


def test_quick_run_times_both_cases(tmp_path):
    rows = quick_rows("benchmarks/bench_padding.py", tmp_path)
    cases = ["padded step 2x64", "padded step masked 2x64", "padded step queries 2x64"]
    assert [r["case"] for r in rows] == cases
    assert [r["impl"] for r in rows] == [
        "padding skipped",
        "padding masked",
        "padded queries declared",
    ]
    assert all(r["peer"] == "the batch without padding" and r["ratio"] > 0 for r in rows)


def test_skipped_and_masked_steps_give_the_same_gradients():
    """The two padded sides differ only in what they skip: the same gradients."""
    bench = load_file("benchmarks/bench_padding.py")
    grads = []
    for skip in (True, False):
        batch = bench.inputs(4, 40, padded=True)
        q, k, v = batch["x"][:3]
        captured: dict[str, torch.Tensor] = {}
        for t, name in ((q, "q"), (k, "k"), (v, "v")):  # (step clears .grad: hooks keep it)
            t.register_hook(lambda g, name=name, into=captured: into.__setitem__(name, g.clone()))
        bench.step(batch, skip)
        grads.append(captured)
    assert grads[0].keys() == {"q", "k", "v"}
    for name in ("q", "k", "v"):
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)
    assert bench.inputs(4, 40, padded=True)["keep"].float().mean() < 0.9  # (it is padded)


def test_declared_queries_give_the_real_rows_gradients():
    """Padded queries declared in the mask: the gradients of the real rows and keys are
    the key-padded step's (the padded rows' output and weights are 0, and no loss term
    reads them)."""
    bench = load_file("benchmarks/bench_padding.py")
    grads = []
    for queries in (False, True):
        batch = bench.inputs(4, 40, padded=True, queries=queries)
        x = batch["x"][:3]
        captured = {}
        for t, name in zip(x, "qkv", strict=True):
            t.register_hook(lambda g, name=name, into=captured: into.__setitem__(name, g.clone()))
        bench.step(batch)
        grads.append(captured)
    keep = bench.inputs(4, 40, padded=True)["keep"][:, None, :, None]  # (B, 1, L, 1)
    for name in "qkv":
        torch.testing.assert_close(
            grads[1][name] * keep, grads[0][name] * keep, atol=1e-6, rtol=1e-5
        )
    assert (grads[1]["q"] * ~keep == 0).all()  # (padded rows: no gradient)
