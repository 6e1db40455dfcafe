"""`sdpa view` on an 8,000-token document, against bertviz's page for the same input.

A random-weight RoPE model (Llama: 4 layers, 8 query heads, 2 key/value heads, width
256, context 8192) built from its config, with MiniLM's tokenizer; nothing downloads.
The viewer runs as a user runs it (`python -m sdpa.view --file DOC --model DIR
--no-open`, its own process); Debian's Chromium, driven by Playwright, loads the page
and clicks tokens. Measured:

- page ready: from navigation to the page's tokens and grid painted and answering
  clicks, the first load right after the model run (the server starts then, and
  computes the per-head statistics layer by layer while it answers);
- row round trip: click to colours painted (the page's own clock), over several
  tokens and heads, and the head average;
- server memory: the server's peak resident memory (VmHWM) after the page and every
  row, minus its peak right after the model run (printed by the command);
- bertviz: its head_view page for the same model and tokens, built at shorter lengths
  (size in MB), and at 8,000 tokens either built or why it cannot be.

    HF_HUB_OFFLINE=1 python benchmarks/bench_view.py [--tokens 8000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from sdpa.benchmark import environment

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    *("--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run"),
    *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
]
WORDS = ["the", "river", "bank", "was", "quiet", "and", "we", "sat", "there", "watching"]
CONFIG = dict(layers=4, heads=8, kv_heads=2, hidden=256)


def model_folder(path: Path, layers: int, heads: int, kv_heads: int, hidden: int) -> Path:
    """A random-weight Llama saved with MiniLM's tokenizer (context 8192)."""
    import transformers

    from sdpa.examples import minilm

    config = transformers.LlamaConfig(
        vocab_size=30522, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=8192, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaModel(config).save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm.model_path())
    tokenizer.model_max_length = 8192
    tokenizer.save_pretrained(path)
    return path


def document(tokens: int) -> str:
    """Exactly `tokens` tokens for MiniLM's tokenizer, [CLS] and [SEP] included."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 2))


def peak_mib(pid: int) -> float:
    """A process's peak resident memory so far (VmHWM), MiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text)[1]) / 1024


def viewer(folder: Path, doc: Path, tokens: int, heads: int) -> dict:
    """Start `sdpa view`, load its page in Chromium, click rows; the figures."""
    from playwright.sync_api import sync_playwright

    cmd = [sys.executable, "-m", "sdpa.view", "--file", str(doc), "--model", str(folder),
           "--no-open"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split("serving ")[1].split()[0]
        pid = proc.pid
        run_peak = peak_mib(pid)
        loads, rows = [], []
        with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, args=FLAGS, headless=True,
                viewport={"width": 1200, "height": 800},
            )  # fmt: skip
            for _ in range(3):
                page = browser.new_page()
                external: list[str] = []
                page.on(
                    "request", lambda r, seen=external: r.url.startswith(url) or seen.append(r.url)
                )
                start = time.perf_counter()
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                loads.append(
                    {
                        "wall_s": time.perf_counter() - start,
                        "page_s": float(page.get_attribute("body", "data-ready-ms")) / 1000,
                    }
                )
                assert not external, external
                assert page.locator(".tok").count() == tokens
                picks = [(layer, head) for layer in (0, CONFIG["layers"] - 1)
                         for head in (0, heads - 1, "mean")]  # fmt: skip
                for k, (layer, head) in enumerate(picks):
                    page.click(f"#grid button[data-layer='{layer}'][data-head='{head}']")
                    query = 500 + 1237 * k % (tokens - 1000)
                    page.locator(".tok").nth(query).click()
                    page.wait_for_selector(f"body[data-shown='{layer}/{head}/{query}']",
                                           state="attached")  # fmt: skip
                    rows.append(float(page.get_attribute("body", "data-row-ms")))
                page.close()
            browser.close()
        while (grid := json.loads(urlopen(url + "grid").read()))["stats_s"] is None:
            time.sleep(0.2)  # the statistics of every layer, computed while serving
        served_peak = peak_mib(pid)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    run = re.search(r"model run ([\d.]+) s \(peak (\d+) MiB\)", err)
    return {
        "tokens": tokens,
        "model_run_s": float(run[1]),
        "statistics_s": grid["stats_s"],
        "peak_after_model_run_mib": float(run[2]),
        "peak_at_server_start_mib": run_peak,
        "peak_after_page_and_rows_mib": served_peak,
        "server_memory_over_model_run_mib": served_peak - float(run[2]),
        "page_ready_s": {
            "median_wall": statistics.median(x["wall_s"] for x in loads),
            "median_page_clock": statistics.median(x["page_s"] for x in loads),
            "all_wall": [round(x["wall_s"], 3) for x in loads],
        },
        "row_round_trip_ms": {
            "median": statistics.median(rows),
            "max": max(rows),
            "count": len(rows),
        },
    }


def bertviz_pages(folder: Path, lengths: list[int], tokens: int) -> dict:
    """bertviz's head_view page for the same model: built at `lengths`, and at `tokens`
    built or refused (the dense attentions it needs, against sdpa's 1 GiB budget)."""
    from bertviz import head_view

    from sdpa.errors import WeightsTooLargeError
    from sdpa.integrations.viewers import attentions
    from sdpa.view.session import text_session

    out = {}
    for n in [*lengths, tokens]:
        session = text_session(document(n), str(folder))
        names = [p[0] for p in session.pieces]
        start = time.perf_counter()
        try:
            dense = attentions(session.weights)
            html = head_view(dense, names, html_action="return").data
            out[n] = {"mb": len(html.encode()) / 1e6, "build_s": time.perf_counter() - start}
        except (WeightsTooLargeError, MemoryError) as e:
            out[n] = {"built": False, "why": str(e).split(";")[0]}
        del session
    built = [n for n in lengths if "mb" in out[n]]
    if built:  # the page holds every weight: it grows as n^2
        last = built[-1]
        out["estimate_mb_at_tokens"] = out[last]["mb"] * (tokens / last) ** 2
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--bertviz-lengths", default="128,256,512")
    parser.add_argument("--json", help="write {environment, results} here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp) / "model", **CONFIG)
        doc = Path(tmp) / "doc.txt"
        doc.write_text(document(args.tokens), encoding="utf-8")
        results = {
            "model": {"kind": "random-weight Llama (RoPE, GQA)", **CONFIG, "context": 8192},
            "sdpa_view": viewer(folder, doc, args.tokens, CONFIG["heads"]),
        }
        lengths = [int(n) for n in args.bertviz_lengths.split(",") if n]
        results["bertviz_head_view"] = bertviz_pages(folder, lengths, args.tokens)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"environment": environment(), "results": results},
                                              indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
