"""benchmarks/ab_bench.py is a check: a case more than --threshold worse (default 1.05)
or measured on one side only fails it, named; the benchmarks themselves are not run here
(each run is a fake of the ratios a benchmark's JSON gives)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ab(monkeypatch):
    """The script as a module, in sys.modules while it runs (its dataclass looks there)."""
    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "benchmarks/ab_bench.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ab_bench", module)
    spec.loader.exec_module(module)
    return module


def test_cases_of_both_sides_are_compared_by_their_medians(ab):
    runs = {"base": [{"a": 1.0}, {"a": 1.5}, {"a": 1.25}], "head": [{"a": 1.25}, {"a": 1.75}]}
    report = ab.compare(runs, threshold=1.05)
    assert report.cases["a"] == {"base": 1.25, "head": 1.5, "head/base": 1.2}
    assert report.worse == ["a"] and not report.ok


def test_own_times_are_compared_beside_the_ratios(ab):
    """Where the runs give our own median time, its head/base quotient is reported beside
    the ratios' ("own"), and the verdict stays the ratios': a peer that got faster on the
    head's side fails the case though our own time did not move."""
    S = ab.Sample
    runs = {"base": [{"a": S(1.0, 10.0)}, {"a": S(1.2, 12.0)}, {"a": S(1.1, 11.0)}],
            "head": [{"a": S(1.3, 11.0)}, {"a": S(1.3, 9.0)}]}  # fmt: skip
    report = ab.compare(runs, threshold=1.05)
    assert report.cases["a"]["own"] == pytest.approx(10.0 / 11.0)
    assert report.cases["a"]["head/base"] == pytest.approx(1.3 / 1.1)
    assert report.worse == ["a"]
    partial = {"base": [{"a": S(1.0, 10.0)}], "head": [{"a": S(1.0)}]}
    assert "own" not in ab.compare(partial, 1.05).cases["a"]


def test_the_threshold_is_a_bound_on_head_over_base(ab):
    fine = {"base": [{"a": 1.0}], "head": [{"a": 1.049}]}
    assert ab.compare(fine, 1.05).ok
    assert ab.compare({"base": [{"a": 1.0}], "head": [{"a": 1.051}]}, 1.05).worse == ["a"]
    assert ab.compare({"base": [{"a": 1.0}], "head": [{"a": 1.051}]}, 1.10).ok


def test_a_case_on_one_side_only_fails_and_is_listed(ab):
    runs = {"base": [{"a": 1.0, "old": 1.0}], "head": [{"a": 1.0, "new": 2.0}]}
    report = ab.compare(runs, 1.05)
    assert set(report.cases) == {"a"} and not report.worse
    assert report.one_sided == {"old": "not in 1 of 1 head runs", "new": "not in 1 of 1 base runs"}
    assert not report.ok
    flaky = {"base": [{"a": 1.0}, {"a": 1.0}], "head": [{"a": 1.0}, {}]}
    assert ab.compare(flaky, 1.05).one_sided == {"a": "not in 1 of 2 head runs"}


def _fake_runs(monkeypatch, ab, tmp_path, per_side):
    """main() with the worktree and the runs faked: per_side[side] is each run's ratios."""
    calls = []

    @contextlib.contextmanager
    def base_tree(commit):
        yield tmp_path

    def run(tree, bench, only, quick, reps=None):
        side = "base" if tree == tmp_path else "head"
        calls.append((side, bench))
        return per_side[side]

    monkeypatch.setattr(ab, "base_tree", base_tree)
    monkeypatch.setattr(ab, "_check_import", lambda tree: None)
    monkeypatch.setattr(ab, "_run", run)
    return calls


def test_main_exits_nonzero_on_a_worse_or_one_sided_case(ab, monkeypatch, tmp_path, capsys):
    same = {"case one": 0.5, "case two": 2.0}
    calls = _fake_runs(monkeypatch, ab, tmp_path, {"base": same, "head": same})
    out = tmp_path / "ab.json"
    assert ab.main(["--base", "HEAD", "--rounds", "2", "bench_x.py", "--json", str(out)]) == 0
    # A B, then B A; the default threshold is 5%
    assert calls == [("base", "bench_x"), ("head", "bench_x"), ("head", "bench_x"),
                     ("base", "bench_x")]  # fmt: skip
    assert json.loads(out.read_text())["threshold"] == 1.05
    capsys.readouterr()

    _fake_runs(monkeypatch, ab, tmp_path, {"base": same, "head": {**same, "case two": 2.2}})
    assert ab.main(["--base", "HEAD", "bench_x", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "case two" in printed and "WORSE" in printed and "1 worse than 1.05x" in printed
    assert json.loads(out.read_text())["worse"] == ["bench_x: case two"]

    _fake_runs(monkeypatch, ab, tmp_path, {"base": same, "head": {"case one": 0.5}})
    assert ab.main(["--base", "HEAD", "bench_x", "--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "case two" in printed and "ONE SIDE ONLY" in printed
    assert json.loads(out.read_text())["one_sided"] == {
        "bench_x: case two": "not in 3 of 3 head runs"
    }


def test_a_run_that_cannot_be_made_exits_2(ab, monkeypatch, tmp_path, capsys):
    @contextlib.contextmanager
    def base_tree(commit):
        yield tmp_path  # an empty folder: no benchmarks/, no src/

    monkeypatch.setattr(ab, "base_tree", base_tree)
    monkeypatch.setattr(ab, "_check_import", lambda tree: None)
    assert ab.main(["--base", "HEAD", "bench_core"]) == 2
    assert "benchmarks/bench_core.py does not exist" in capsys.readouterr().err


def test_a_failing_benchmark_does_not_stop_the_others(ab, monkeypatch, tmp_path, capsys):
    calls = _fake_runs(monkeypatch, ab, tmp_path, {"base": {"a": 1.0}, "head": {"a": 1.0}})
    faked = ab._run

    def run(tree, bench, only, quick, reps=None):
        if bench == "bench_broken":
            raise ab.RunError("bench_broken exited with status 1")
        return faked(tree, bench, only, quick, reps)

    monkeypatch.setattr(ab, "_run", run)
    out = tmp_path / "ab.json"
    assert (
        ab.main(["--base", "HEAD", "--rounds", "1", "bench_broken", "bench_x", "--json", str(out)])
        == 2
    )
    assert calls == [("base", "bench_x"), ("head", "bench_x")]  # compared after the failure
    assert json.loads(out.read_text())["failed"] == {
        "bench_broken": "bench_broken exited with status 1"
    }
    assert "no comparison for bench_broken" in capsys.readouterr().err


def test_the_ring_benchmark_rows_compare_to_the_whole_sequence(ab):
    """bench_ring writes (impl, mode, ranks, seconds): each ring row over the whole
    sequence's seconds in its mode; the whole-sequence rows are the peers, not cases."""
    rows = [
        {"impl": ab.WHOLE, "mode": "dense", "ranks": 1, "seconds": 10.0},
        {"impl": "ring_attention", "mode": "dense", "ranks": 1, "seconds": 11.0},
        {"impl": "ring_attention", "mode": "dense", "ranks": 4, "seconds": 12.5},
        {"impl": ab.WHOLE, "mode": "causal zigzag", "ranks": 1, "seconds": 5.0},
        {"impl": "ring_attention", "mode": "causal zigzag", "ranks": 2, "seconds": 4.0},
    ]
    got = {r["case"]: r["ratio"] for r in ab._ring_ratios(rows)}
    assert got == {"dense, 1 ranks": 1.1, "dense, 4 ranks": 1.25, "causal zigzag, 2 ranks": 0.8}
    own = {r["case"]: r["median_ms"] for r in ab._ring_ratios(rows)}
    assert own == {"dense, 1 ranks": 11e3, "dense, 4 ranks": 12.5e3, "causal zigzag, 2 ranks": 4e3}
    assert ab._ring_ratios([{"case": "x", "peer": "y", "ratio": 1.0}]) is None


def test_the_ring_benchmark_only_runs_the_selected_mode_and_ranks(ab):
    """--only on bench_ring becomes its own --modes / --ranks, from a mode or from a case
    id exactly as _ring_ratios writes it; anything else is refused before a run."""
    rows = [
        {"impl": ab.WHOLE, "mode": "causal zigzag", "ranks": 1, "seconds": 5.0},
        {"impl": "ring_attention", "mode": "causal zigzag", "ranks": 2, "seconds": 4.0},
    ]
    (case,) = (r["case"] for r in ab._ring_ratios(rows))
    assert ab._ring_selection(case) == ["--modes", "causal zigzag", "--ranks", "2"]
    assert ab._ring_selection("dense") == ["--modes", "dense"]
    for bad in ("dense, two ranks", "dense, 2", ", 2 ranks"):
        with pytest.raises(ab.RunError, match="a mode or a case id"):
            ab._ring_selection(bad)


def test_the_ring_benchmark_schemes_are_cases_of_their_own(ab):
    """bench_ring's other schemes at the same mode and ranks are cases apart (the ring's
    keep their ids), and --only on one of them selects its scheme."""
    rows = [
        {"impl": ab.WHOLE, "scheme": None, "mode": "dense", "ranks": 1, "seconds": 10.0},
        {"impl": "ring_attention", "scheme": "ring", "mode": "dense", "ranks": 8, "seconds": 12.0},
        {"impl": "ulysses_attention", "scheme": "ulysses", "mode": "dense", "ranks": 8,
         "seconds": 11.0},
        {"impl": "hybrid_attention", "scheme": "hybrid", "mode": "dense", "ranks": 8,
         "seconds": 13.0},
    ]  # fmt: skip
    got = {r["case"]: r["ratio"] for r in ab._ring_ratios(rows)}
    assert got == {"dense, 8 ranks": 1.2, "dense, 8 ranks, ulysses": 1.1,
                   "dense, 8 ranks, hybrid": 1.3}  # fmt: skip
    assert ab._ring_selection("dense, 8 ranks, hybrid") == [
        "--modes", "dense", "--ranks", "8", "--schemes", "hybrid"
    ]  # fmt: skip
    for bad in ("dense, 8 ranks, two words", "dense, , hybrid"):
        with pytest.raises(ab.RunError, match="a mode or a case id"):
            ab._ring_selection(bad)


def test_the_run_command_passes_only_quick_and_reps_on(ab):
    """What a run is started with: the benchmark's own --only, --quick and --reps, memory
    never measured; bench_ring takes a selection of its modes and refuses the others."""
    cmd = ab._command(Path("b.py"), "bench_train", "o.json", "kl 4096", False, 3)
    assert cmd[1:] == ["b.py", "--json", "o.json", "--no-memory", "--only", "kl 4096",
                       "--reps", "3"]  # fmt: skip
    assert ab._command(Path("b.py"), "bench_core", "o.json", None, True, None)[-1] == "--quick"
    ring = ab._command(Path("r.py"), ab.RING, "o.json", "dense", False, None)
    assert ring[1:] == ["r.py", "--json", "o.json", "--modes", "dense"]
    for quick, reps in ((True, None), (False, 3)):
        with pytest.raises(ab.RunError, match="takes no --quick or --reps"):
            ab._command(Path("r.py"), ab.RING, "o.json", None, quick, reps)
