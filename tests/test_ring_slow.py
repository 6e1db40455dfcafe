"""Each sequence-parallel scheme at 8 gloo processes against single-process
sdpa.attention on the whole sequence, dense and causal zigzag: benchmarks/bench_ring.py's
--check, one test per scheme. Slow (8 processes on this machine's cores): skipped unless
selected, `pytest -m slow tests/test_ring_slow.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# imported by name, from its folder: the spawned ranks import it again to run their part
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_ring as bench

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scheme", bench.SCHEMES)
def test_every_rank_matches_the_whole_sequence_at_8_processes(scheme):
    result = bench.check(scheme, world=8)
    assert not bench.check_failures(result), result
