"""The `sdpa` command and the examples, run as a user runs them: in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                           cwd=ROOT)  # fmt: skip


def check_phrase(stdout: str) -> None:
    lines = stdout.splitlines()
    assert any("(1, 4, 256)" in line and "8 heads of 32" in line for line in lines)
    heads = [i for i, line in enumerate(lines) if line.startswith("head ")]
    assert len(heads) == 8
    for i in heads:
        assert lines[i].split()[2:] == ["How", "are", "you", "?"]
        rows = [[float(x) for x in lines[i + j].split()[1:]] for j in range(1, 5)]
        assert all(abs(sum(row) - 1) < 3e-3 for row in rows)  # printed to 3 decimals
    agree = re.search(r"listing agrees to ([0-9.e+-]+)", stdout)
    assert agree and float(agree.group(1)) < 1e-5


def check_unet(stdout: str, size: int) -> None:
    assert f"U-Net map (1, 128, {size}, {size}): 4 heads over {size * size} pixels" in stdout
    m = re.search(r"SpatialSelfAttention (\d+) ms, (\d+) MiB peak vs the listing's block "
                  r"(\d+) ms, (\d+) MiB", stdout)  # fmt: skip
    assert m and int(m.group(4)) > 0
    agree = re.search(r"listing agrees to ([0-9.e+-]+)", stdout)
    assert agree and float(agree.group(1)) < 1e-4


def test_demo_runs_both_walkthroughs():
    r = run("-m", "sdpa", "demo", "--size", "16")
    assert r.returncode == 0, r.stderr
    check_phrase(r.stdout)
    check_unet(r.stdout, 16)


def test_examples_run_as_scripts():
    r = run("examples/phrase.py")
    assert r.returncode == 0, r.stderr
    check_phrase(r.stdout)
    r = run("examples/unet_attention.py", "--size", "8")
    assert r.returncode == 0, r.stderr
    check_unet(r.stdout, 8)


def test_help_and_bad_command():
    assert run("-m", "sdpa", "--help").returncode == 0
    r = run("-m", "sdpa", "nonsense")
    assert r.returncode != 0 and "invalid choice" in r.stderr
