"""sdpa.measure: peak memory in fresh processes, side by side (the demo's U-Net figures)."""

from __future__ import annotations

import subprocess

import pytest

from sdpa.measure import peak_mib_in_subprocess, peaks_mib_in_subprocesses

# A child that raises its own peak by about `mib` MiB (touched pages) and prints the rise.
CHILD = (
    "from sdpa.measure import peak_mib_of\n"
    "mib = {mib}\n"
    "print(peak_mib_of(lambda: bytearray(mib * 2**20)))\n"
)


def test_side_by_side_peaks_are_each_process_own():
    small, large = peaks_mib_in_subprocesses(
        [["-c", CHILD.format(mib=1)], ["-c", CHILD.format(mib=200)]]
    )
    assert 190 <= large <= 260, large  # the large child's own rise, not the sum of both
    assert small < 20, small
    assert peak_mib_in_subprocess(["-c", CHILD.format(mib=100)]) == pytest.approx(100, abs=30)


def test_a_failing_child_raises_with_its_error():
    with pytest.raises(subprocess.CalledProcessError) as info:
        peaks_mib_in_subprocesses(
            [["-c", CHILD.format(mib=1)], ["-c", "raise SystemExit('no figure')"]]
        )
    assert "no figure" in info.value.stderr
