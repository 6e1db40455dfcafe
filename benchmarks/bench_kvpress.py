"""kvpress ObservedAttentionPress prefill: transformers' eager attention against sdpa's
lazy weights (`sdpa.integrations.kvpress.register()`), side by side.

Model: a Llama with random weights built from its config (hidden 256, 4 query heads of
64 on 2 key/value heads, 2 layers, MLP 512, vocabulary 1024), float32, batch 1, one
prefill of L = 8192 tokens (--quick: 2048) under ObservedAttentionPress(0.5), the H2O
score that needs every layer's attentions: eager materialises them, (1, 4, L, L) per
layer; ours hands the press the lazy handle, whose sum(2) (the attention each key
receives) comes from one more fused call with queries and keys swapped
(`AttentionWeights.sum` on CPU).

Time: interleaved (eager, ours, eager, ours, ...), medians, after a warm-up at L = 256.
Memory: each side in a fresh interpreter: model, inputs and the same warm-up, then the
baseline, then one prefill: the rise of the peak resident set (VmHWM); the median of
--memory-reps such runs (glibc's allocator keeps some freed blocks mapped, and the rise
of one run varies by a few tens of MiB). Kept cache: the key positions each layer keeps
(as ScorerPress picks them, from the recorded scores) compared per head as sets (topk
orders ties arbitrarily), then the kept keys and values in position order. Targets
(issue 14): ours <= 0.5x eager's time and <= 1/8 of eager's extra memory, with the same
kept cache.

    .venv-kvpress/bin/python benchmarks/bench_kvpress.py [--quick] [--reps N] [--json FILE]

Runs in .venv-kvpress (kvpress 0.5 pins transformers < 5.3), as `make bench` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from sdpa.benchmark import environment
from sdpa.measure import peak_mib_in_subprocess, peak_rss_kib

MODEL = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
)  # fmt: skip
RATIO = 0.5  # compression_ratio
LENGTH, QUICK_LENGTH, WARMUP_LENGTH = 8192, 2048, 256
TIME_TARGET, MEMORY_TARGET = 0.5, 1 / 8  # ours / eager
SIDES = {"eager": "transformers eager", "ours": "sdpa lazy weights (kvpress.register())"}


def setup(length: int):
    """The model, the context ids, and the attention implementation of each side."""
    import transformers

    import sdpa.integrations.kvpress as sdpa_kvpress

    impls = {"eager": "eager", "ours": sdpa_kvpress.register()}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    ids = torch.randint(
        0, MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1)
    )
    return model, ids, impls


def prefill(model, impl: str, ids: torch.Tensor, record: bool = False):
    """One prefill under ObservedAttentionPress(RATIO): the cache and, if asked, each
    layer's scores."""
    import transformers
    from kvpress import ObservedAttentionPress

    model.set_attn_implementation(impl)
    press = ObservedAttentionPress(compression_ratio=RATIO)
    scores = []
    if record:
        score = press.score

        def recording(*args):
            scores.append(score(*args))
            return scores[-1]

        press.score = recording
    cache = transformers.DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache, scores


def kept_cache(cache, scores) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each layer's kept positions (B, Hkv, n) sorted, and its kept keys and values in
    position order."""
    from kvpress.utils import compute_n_kept

    positions, kv = [], []
    for layer, s in zip(cache.layers, scores, strict=True):
        idx = s.topk(compute_n_kept(s.shape[-1], RATIO), dim=-1).indices  # as compress picks
        order = idx.argsort(dim=-1)[..., None].expand(*idx.shape, layer.keys.shape[-1])
        positions.append(idx.sort(dim=-1).values)
        kv.append((layer.keys.gather(2, order), layer.values.gather(2, order)))
    return positions, kv


def compare(a, b) -> dict:
    (pos_a, kv_a), (pos_b, kv_b) = a, b
    same = [bool(torch.equal(x, y)) for x, y in zip(pos_a, pos_b, strict=True)]
    shared = [
        float((x[..., None] == y[..., None, :]).any(-1).float().mean())
        for x, y in zip(pos_a, pos_b, strict=True)
    ]
    diff = [
        max(float((ka - kb).abs().max()), float((va - vb).abs().max()))
        for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True)
    ] if all(same) else None  # fmt: skip
    return {
        "kept_positions_equal": all(same),
        "kept_positions_equal_per_layer": same,
        "kept_positions_shared_fraction_per_layer": shared,
        "kept_kv_max_abs_diff_per_layer": diff,
        "kept_per_layer": list(pos_a[0].shape),
    }


def peak(side: str, length: int) -> None:
    """In a fresh interpreter: set up, warm up, baseline, one prefill; print MiB."""
    model, ids, impls = setup(length)
    prefill(model, impls[side], ids[:, :WARMUP_LENGTH])
    before = peak_rss_kib()
    prefill(model, impls[side], ids)
    print((peak_rss_kib() - before) / 1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"L = {QUICK_LENGTH}")
    parser.add_argument("--length", type=int, help="prefill length (default 8192)")
    parser.add_argument("--reps", type=int, default=3, help="timed prefills per side")
    parser.add_argument("--memory-reps", type=int, default=3, help="peak-memory runs per side")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    parser.add_argument("--json", help="write results and environment here")
    parser.add_argument("--peak", metavar="SIDE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    length = args.length or (QUICK_LENGTH if args.quick else LENGTH)
    if args.peak:
        peak(args.peak, length)
        return 0

    env = {
        **environment(),
        "transformers": _version("transformers"),
        "kvpress": _version("kvpress"),
    }
    print(f"environment: {env}")
    print(f"model: Llama {MODEL}, float32, batch 1, L = {length}, "
          f"ObservedAttentionPress(compression_ratio={RATIO})", flush=True)  # fmt: skip
    model, ids, impls = setup(length)
    for side in SIDES:  # warm-up
        prefill(model, impls[side], ids[:, :WARMUP_LENGTH])
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    kept = {}
    for rep in range(args.reps):
        for side in SIDES:
            start = time.perf_counter()
            cache, scores = prefill(model, impls[side], ids, record=True)
            times[side].append(time.perf_counter() - start)
            print(f"  rep {rep}: {side:5} {times[side][-1]:7.2f} s", flush=True)
            if rep == args.reps - 1:
                kept[side] = kept_cache(cache, scores)
            del cache, scores
    med = {side: statistics.median(t) for side, t in times.items()}
    cache_cmp = compare(kept["ours"], kept["eager"])
    peak_mib: dict[str, float | None] = {side: None for side in SIDES}
    peak_runs: dict[str, list[float]] = {side: [] for side in SIDES}
    if not args.no_memory:
        for _ in range(args.memory_reps):
            for side in SIDES:
                argv = [__file__, "--peak", side, "--length", str(length)]
                peak_runs[side].append(peak_mib_in_subprocess(argv, timeout=1800))
        peak_mib = {side: statistics.median(runs) for side, runs in peak_runs.items()}
    time_ratio = med["ours"] / med["eager"]
    memory_ratio = None if args.no_memory else peak_mib["ours"] / peak_mib["eager"]
    verdict = {
        "time": time_ratio <= TIME_TARGET,
        "memory": None if memory_ratio is None else memory_ratio <= MEMORY_TARGET,
        "kept_cache": cache_cmp["kept_positions_equal"],
    }
    for side in SIDES:
        mem = "" if peak_mib[side] is None else f"  +{peak_mib[side]:7.0f} MiB"
        print(f"{SIDES[side]:42} median {med[side]:7.2f} s{mem}")
    mem_line = "" if memory_ratio is None else (
        f", memory x{memory_ratio:.3f} (target <= {MEMORY_TARGET:.3f}: "
        f"{'met' if verdict['memory'] else 'MISSED'})"
    )  # fmt: skip
    print(f"ours / eager: time x{time_ratio:.3f} (target <= {TIME_TARGET}: "
          f"{'met' if verdict['time'] else 'MISSED'}){mem_line}")  # fmt: skip
    print(f"kept cache: positions equal {cache_cmp['kept_positions_equal']} "
          f"{cache_cmp['kept_positions_equal_per_layer']}, kept keys/values max |diff| "
          f"{cache_cmp['kept_kv_max_abs_diff_per_layer']}")  # fmt: skip
    if args.json:
        result = {
            "environment": env,
            "case": {"model": MODEL, "dtype": "float32", "batch": 1, "length": length,
                     "press": f"ObservedAttentionPress(compression_ratio={RATIO})",
                     "reps": args.reps, "warmup_length": WARMUP_LENGTH},
            "sides": {side: {"impl": SIDES[side], "median_s": med[side], "times_s": times[side],
                             "peak_mib": peak_mib[side], "peak_mib_runs": peak_runs[side]}
                      for side in SIDES},
            "time_ratio": time_ratio, "time_target": TIME_TARGET,
            "memory_ratio": memory_ratio, "memory_target": MEMORY_TARGET,
            "kept_cache": cache_cmp, "met": verdict,
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
