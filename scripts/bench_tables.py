"""The benchmark tables of the docs, generated from benchmarks/results/*.json.

    python scripts/bench_tables.py            # rewrite every table between its markers
    python scripts/bench_tables.py --check    # exit 1, naming each table that is stale

A table lives in README.md or a page of docs/ between two marker comments:

    <!-- bench:NAME -->
    (generated: the table and the line naming its results file)
    <!-- /bench:NAME -->

NAME is a key of TABLES. Nothing between the markers is typed by hand: an edit there,
or a results file that changed since, makes `--check` (and tests/test_docs.py) fail
until this script is run again. The comparison tables use `sdpa.benchmark.markdown`,
the ring and distillation tables their benchmark's own `markdown`, so each reads as its
benchmark writes it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- bench:([\w-]+) -->$", re.M)
END = "<!-- /bench:{} -->"

Table = Callable[[Path], str]  # results folder -> the Markdown between the markers


def _load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise FileNotFoundError(f"benchmark results {path} not found (the table needs it)")
    return json.loads(path.read_text())


def _source(name: str, env: dict) -> str:
    """The line under a table: where its figures come from, and on what."""
    said = {  # environment key -> how the line says it
        "date": lambda v: str(v)[:10], "cpu": str, "device": str, "torch": "torch {}".format,
        "cuda": "CUDA {}".format, "triton": "triton {}".format,
        "transformers": "transformers {}".format,
        "threads": "{} threads".format,
    }  # fmt: skip
    what = ", ".join(say(env[k]) for k, say in said.items() if env.get(k) is not None)
    return f"*From `benchmarks/results/{name}`" + (f": {what}.*" if what else ".*")


def _comparisons(results: Path, name: str, cases: list[str] | None) -> list[dict]:
    """The rows of `name` (ours and peer for each case), in the order of `cases`; a case
    id that the file does not hold is an error, not a shorter table."""
    rows = _load(results, name)["results"]
    if cases is None:
        return rows
    known = {r["case"] for r in rows}
    missing = [c for c in cases if c not in known]
    if missing:
        raise KeyError(f"{name} has no case {missing}; its cases: {sorted(known)}")
    return [r for c in cases for r in rows if r["case"] == c]


def comparisons(name: str, cases: list[str] | None = None) -> Table:
    """A table as `bench_*.py --markdown` prints it: every case of the file, or `cases`."""

    def table(results: Path) -> str:
        from sdpa.benchmark import markdown

        rows = _comparisons(results, name, cases)
        return markdown(rows) + "\n\n" + _source(name, _load(results, name)["environment"])

    return table


def _ratio(r: float) -> str:
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _mib(m: float | None) -> str:
    return "-" if m is None else f"{m:.0f}"


HEADLINE = [  # (results file, case id, what the row shows); the figures come from the file
    ("core.json", "unet float32 forward", "the passage's U-Net pixels (1, 4, 4096, 32): output"),
    ("core.json", "unet float32 weights", "the same, output and all 4096 x 4096 weights"),
    ("weights.json", "entropy", "(1, 4, 16384, 32), 4 GiB of weights: every row's entropy"),
    ("weights.json", "row", "the same: one query's row, every head"),
    ("masks.json", "window", "(1, 8, 4096, 64), sliding window of 512"),
    ("hf.json", "attentions", "all-MiniLM-L6-v2, 8 x 512 tokens: every layer's attentions"),
    ("diffusers.json", "unet maps vs materialising", "SD-1.5 UNet step with DAAM heat maps"),
]


def headline(results: Path) -> str:
    """The README's table: one line per claim, ours against the peer a user would use."""
    lines = [
        "| case | ours | peer | time ours / peer | peak MiB ours / peer |",
        "|---|---|---|---:|---:|",
    ]
    for name, case, what in HEADLINE:
        rows = _comparisons(results, name, [case])
        ours = next(r for r in rows if r["peer"] is not None)
        peer = next(r for r in rows if r["impl"] == ours["peer"])
        lines.append(
            f"| {what} | `{ours['impl']}` | `{ours['peer']}` | {_ratio(ours['ratio'])} "
            f"| {_mib(ours['peak_mib'])} / {_mib(peer['peak_mib'])} |"
        )
    kv = _load(results, "kvpress.json")
    eager, ours = kv["sides"]["eager"], kv["sides"]["ours"]
    lines.append(
        f"| kvpress `{kv['case']['press']}`, prefill of {kv['case']['length']} tokens "
        f"| `{ours['impl']}` | `{eager['impl']}` | {_ratio(kv['time_ratio'])} "
        f"| {_mib(ours['peak_mib'])} / {_mib(eager['peak_mib'])} |"
    )
    files = ", ".join(f"`{f}`" for f in sorted({n for n, _, _ in HEADLINE} | {"kvpress.json"}))
    return "\n".join(lines) + (
        f"\n\n*From {files} in `benchmarks/results/`; the full tables and how they were "
        "measured: [benchmarks](docs/guide/benchmarks.md).*"
    )


def kvpress(results: Path) -> str:
    kv = _load(results, "kvpress.json")
    sides, cmp = kv["sides"], kv["kept_cache"]
    same = "same positions" if cmp["kept_positions_equal"] else "positions differ"
    diffs = ", ".join(f"{d:.1g}" for d in cmp["kept_kv_max_abs_diff_per_layer"])
    lines = [
        "| impl | median time | extra memory | kept cache |",
        "|---|---:|---:|---|",
        f"| {sides['eager']['impl']} | {sides['eager']['median_s']:.2f} s "
        f"| +{sides['eager']['peak_mib']:.0f} MiB | - |",
        f"| {sides['ours']['impl']} | {sides['ours']['median_s']:.2f} s "
        f"({kv['time_ratio']:.3f}x, target <= {kv['time_target']}) "
        f"| +{sides['ours']['peak_mib']:.0f} MiB ({kv['memory_ratio']:.3f}x, target <= "
        f"{kv['memory_target']}) | {same}; kept keys/values differ by at most {diffs} per layer |",
    ]
    return "\n".join(lines) + "\n\n" + _source("kvpress.json", kv["environment"])


def _benchmark(name: str):
    """benchmarks/NAME.py loaded as a module, for its own markdown()."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def distill(results: Path) -> str:
    data = _load(results, "distill.json")
    table = _benchmark("bench_distill").markdown(data["results"])
    return table + "\n\n" + _source("distill.json", data["environment"])


def ring(name: str) -> Table:
    """bench_ring's table of results/`name` (ring.json: the ring alone; ring_schemes.json:
    the ring, Ulysses and the hybrid)."""

    def table(results: Path) -> str:
        data = _load(results, name)
        rows = _benchmark("bench_ring").markdown(data["results"])
        return rows + "\n\n" + _source(name, data["environment"])

    return table


def view(results: Path) -> str:
    data = _load(results, "view.json")
    ours, viz = data["results"]["sdpa_view"], data["results"]["bertviz_head_view"]
    page, row = ours["page_ready_s"], ours["row_round_trip_ms"]
    built = {int(n): v for n, v in viz.items() if n.isdigit() and v.get("built", True)}
    never = {int(n): v for n, v in viz.items() if n.isdigit() and not v.get("built", True)}
    sizes = ", ".join(f"{v['mb']:.0f} MB at {n} tokens" for n, v in sorted(built.items()))
    longest = max(built)
    tokens, model = ours["tokens"], data["results"]["model"]
    dense = 4 * model["layers"] * model["heads"] * tokens**2 / 2**30  # float32 bytes, GiB
    cannot = f"the dense attentions alone are {dense:.1f} GiB" if never else "-"
    lines = [
        "| | sdpa view | bertviz head_view, same model and tokens |",
        "|---|---|---|",
        f"| model run, {tokens} tokens | {ours['model_run_s']:.1f} s | (the same) |",
        f"| page ready after the model run | {page['all_wall'][0]:.2f} s first load, "
        f"{page['median_wall']:.2f} s median of {len(page['all_wall'])} | cannot be built "
        f"at {tokens} tokens: {cannot} |",
        f"| one row, click to colours painted | {row['median']:.0f} ms median, "
        f"{row['max']:.0f} ms worst of {row['count']} | (all rows are in the page) |",
        f"| page size | the tokens, then one row of JSON per click | {sizes} (built in "
        f"{built[longest]['build_s']:.0f} s); about {viz['estimate_mb_at_tokens'] / 1e3:.0f} GB"
        f" at {tokens} |",
        f"| server memory | {ours['server_memory_over_model_run_mib']:.0f} MiB over the model "
        f"run's own peak | |",
        f"| per-head statistics of every layer, in the background | "
        f"{ours['statistics_s']:.0f} s | |",
    ]
    return "\n".join(lines) + "\n\n" + _source("view.json", data["environment"])


def model_zoo(results: Path) -> str:
    data = _load(results, "model_zoo.json")
    s = data["summary"]
    lines = [
        "| architectures | applicable | match eager | attentions missing (reviewed) "
        "| never call the attention interface | cannot apply (reviewed) |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {s['architectures']} | {s['applicable']} | {s['match']} | {s['attentions missing']} "
        f"| {s['not routed']} | {s['cannot apply']} |",
    ]
    others = {k: v for k, v in s.items() if k in ("mismatch", "refused", "error") and v}
    if others:
        lines.append("")
        lines.append("Also: " + ", ".join(f"{k} {v}" for k, v in others.items()) + ".")
    env = {**data["environment"], "threads": None}
    return "\n".join(lines) + "\n\n" + _source("model_zoo.json", env)


def gpu_forward(results: Path) -> str:
    data = _load(results, "gpu_bench_h200.json")
    lines = [
        "| shape | mask | ours ms | torch ms | flex ms | ours / torch | ours / flex |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["forward"]:
        flex = r.get("flex")
        flex_ms, vs_flex = ("-", "-") if not flex else (f"{flex:.3f}", f"{r['ours'] / flex:.3f}")
        lines.append(
            f"| {r['shape']} | {r['mask']} | {r['ours']:.3f} | {r['torch']:.3f} | {flex_ms} "
            f"| {r['ours'] / r['torch']:.3f} | {vs_flex} |"
        )
    return "\n".join(lines) + "\n\n" + _source("gpu_bench_h200.json", data["env"])


def gpu_statistics(results: Path) -> str:
    data = _load(results, "gpu_bench_h200.json")
    lines = ["| what | mask | ms | / our forward |", "|---|---|---:|---:|"]
    for r in data["statistics"]:
        lines.append(f"| {r['what']} | {r['mask']} | {r['ms']:.3f} | {r['vs_ours_forward']:.2f} |")
    return "\n".join(lines) + "\n\n" + _source("gpu_bench_h200.json", data["env"])


SMALL_SHAPES = ["weights (1, 8, 4, 32)", "weights sweep L=16", "weights (1, 8, 64, 32)",
                "weights (4, 12, 128, 64)", "weights (1, 8, 256, 32)", "weights sweep L=512",
                "weights (1, 8, 1024, 32)", "weights sweep L=4096", "mha weights L=4",
                "mha weights L=256", "mha weights L=4096", "output (1, 8, 4, 32)"]  # fmt: skip
DECODE = ["decode float32 B=1 S=128 none", "decode float32 B=1 S=128 bool",
          "decode float32 B=1 S=1024 none", "decode float32 B=1 S=1024 bool",
          "decode float32 B=1 S=8192 bool", "decode float32 B=8 S=1024 bool",
          "hf fn attentions float32 B=1 S=1024", "decode bfloat16 B=1 S=1024 none",
          "hf fn attentions bfloat16 B=8 S=8192"]  # fmt: skip
GENERATION = ["minilm 8x32 attentions", "minilm 8x128 attentions", "generate B=1",
              "generate B=1 attentions", "generate B=1 capture", "generate B=8",
              "generate B=8 attentions", "generate B=8 capture"]  # fmt: skip

TABLES: dict[str, Table] = {
    "headline": headline,
    "core": comparisons("core.json"),
    "weights": comparisons("weights.json"),
    "masks": comparisons("masks.json"),
    "hf": comparisons("hf.json"),
    "modules": comparisons("modules.json"),
    "score-mods": comparisons("score_mods.json"),
    "diffusers": comparisons("diffusers.json"),
    "small-shapes": comparisons("decode.json", SMALL_SHAPES),
    "decode": comparisons("decode.json", DECODE),
    "generation": comparisons("decode.json", GENERATION),
    "train": comparisons("train.json"),
    "train-1024": comparisons("train_1024.json"),
    "train-16384": comparisons("train_16384.json"),
    "interp": comparisons("interp.json"),
    "interp-8192": comparisons("interp_8192.json"),
    "interp-diagonals": comparisons("interp_diagonals.json"),
    "distill": distill,
    "rollout": comparisons("rollout.json"),
    "kvpress": kvpress,
    "ring": ring("ring.json"),
    "ring-schemes": ring("ring_schemes.json"),
    "view": view,
    "model-zoo": model_zoo,
    "gpu-forward": gpu_forward,
    "gpu-statistics": gpu_statistics,
}


def regions(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of each generated region: the text between a table's markers."""
    found = []
    for m in MARKER.finditer(text):
        name, end = m.group(1), END.format(m.group(1))
        close = text.find("\n" + end, m.end())
        if close < 0:
            raise ValueError(f"<!-- bench:{name} --> has no closing {end}")
        found.append((name, m.end(), close + 1))
    return found


def render(text: str, results: Path = RESULTS) -> str:
    """`text` with every generated region rewritten from `results`."""
    out, last = [], 0
    for name, start, end in regions(text):
        if name not in TABLES:
            raise KeyError(f"no table named {name!r}; the tables: {sorted(TABLES)}")
        out += [text[last:start], "\n\n", TABLES[name](results), "\n\n"]
        last = end
    return "".join(out) + text[last:]


def pages(root: Path = ROOT) -> list[Path]:
    """The Markdown files that may hold tables: README.md and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def stale(files: list[Path], results: Path = RESULTS) -> list[str]:
    """'FILE: table NAME' for each region that differs from what `results` gives."""
    found = []
    for path in files:
        text = path.read_text()
        fresh = render(text, results)
        if fresh == text:
            continue
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for (name, s, e), (_, fs, fe) in zip(regions(text), regions(fresh), strict=True):
            if text[s:e] != fresh[fs:fe]:
                found.append(f"{where}: table {name}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/")
    args = parser.parse_args(argv)
    files = args.files or pages()
    if args.check:
        old = stale(files, args.results)
        for line in old:
            print(f"stale: {line} (run python scripts/bench_tables.py)", file=sys.stderr)
        return 1 if old else 0
    for path in files:
        text = path.read_text()
        fresh = render(text, args.results)
        if fresh != text:
            path.write_text(fresh)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
