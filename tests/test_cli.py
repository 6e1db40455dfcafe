"""The `sdpa` command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import subprocess
import sys


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "sdpa", *args], capture_output=True, text=True, timeout=120
    )


def test_demo_prints_every_heads_weights_for_the_phrase():
    r = run("demo")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any("x (4, 256)" in line and "8 heads of 32" in line for line in lines)
    heads = [i for i, line in enumerate(lines) if line.startswith("head ")]
    assert len(heads) == 8
    for i in heads:
        assert lines[i].split()[2:] == ["How", "are", "you", "?"]
        rows = [[float(x) for x in lines[i + j].split()[1:]] for j in range(1, 5)]
        assert all(abs(sum(row) - 1) < 3e-3 for row in rows)  # printed to 3 decimals
    listing_line = next(line for line in lines if "max |weights - p_attn|" in line)
    assert float(listing_line.split("= ")[1].split(",")[0]) < 1e-5


def test_help_and_bad_command():
    assert run("--help").returncode == 0
    r = run("nonsense")
    assert r.returncode != 0 and "invalid choice" in r.stderr
