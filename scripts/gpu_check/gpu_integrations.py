"""The integrations on a GPU, each against the same model's eager run on the same device.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python3 scripts/gpu_check/gpu_integrations.py [--json out.json]
    PYTHONPATH=src HF_HUB_OFFLINE=1 python3 scripts/gpu_check/gpu_integrations.py --dry-run   # CPU

Random-init models built from configs (nothing downloaded, nothing carried):
- bert: a MiniLM-shaped BERT (6 layers, 12 heads of 32, hidden 384) through
  sdpa.integrations.transformers.register(): last hidden states and attentions of a
  padded batch;
- llama: a tiny Llama (GQA: 4 query heads on 2 key/value heads): logits, attentions
  and a greedy generate of a left-padded batch;
- viewer: one `sdpa view` session of the BERT's capture, answered as the viewer's
  server answers (/row, /head), against eager's attentions;
- unet: one diffusers UNet step with capture, against diffusers' own processors.
All in bf16. The bf16 rule (FlashAttention's): ours may differ from the float32 eager
run by at most 2x what bf16 eager does, plus a small floor. A greedy run must give
eager's tokens; where it departs, the step must be a near-tie (eager's own top two
logits closer than 4x its bf16 error there), else it fails. Prints one line per check;
exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import traceback

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

DTYPE = torch.bfloat16


def bf16_rule(name: str, ours, eager, ref, floor: float) -> dict:
    """ours and eager (bf16 runs) against ref (the float32 eager run), as float64."""
    ours, eager, ref = (t.detach().double().cpu() for t in (ours, eager, ref))
    e_ours, e_eager = (ours - ref).abs().max().item(), (eager - ref).abs().max().item()
    return {
        "what": name,
        "ours_err": e_ours,
        "eager_err": e_eager,
        "ok": e_ours <= 2 * e_eager + floor,
    }


def _pair(model_class, config, device):
    """(ours bf16, eager bf16, eager float32): one random init, three copies."""
    import sdpa.integrations.transformers as sdpa_hf

    torch.manual_seed(0)  # each its own config: _from_config writes the implementation into it
    ours = model_class._from_config(copy.deepcopy(config), attn_implementation=sdpa_hf.register())
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager")
    if ours.config._attn_implementation == "eager":
        raise RuntimeError("the sdpa copy of the model came out on eager attention")
    eager.load_state_dict(ours.state_dict())
    ref = copy.deepcopy(eager)
    return (
        ours.to(device, DTYPE).eval(),
        eager.to(device, DTYPE).eval(),
        ref.to(device, torch.float32).eval(),
    )


def _bert(device):
    import transformers

    if device.type == "cpu":  # the dry run: a smaller BERT, same code paths
        shape = dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128
        )
    else:  # all-MiniLM-L6-v2's shape
        shape = dict(
            hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
        )
    vocab = 2000 if device.type == "cpu" else 30522
    config = transformers.BertConfig(vocab_size=vocab, max_position_embeddings=512, **shape)
    return _pair(transformers.BertModel, config, device)


def _bert_batch(device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 2000, (4, 37), generator=g)
    mask = torch.ones_like(ids)
    for b, n in enumerate((37, 30, 12, 5)):  # padded on the right, as BERT tokenizers do
        mask[b, n:] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def check_bert(device) -> list[dict]:
    ours, eager, ref = _bert(device)
    batch = _bert_batch(device)
    with torch.no_grad():
        o, e, r = (m(**batch, output_attentions=True) for m in (ours, eager, ref))
    valid = batch["attention_mask"].bool()  # (B, L): real tokens
    out = [
        bf16_rule(
            "bert last_hidden_state (real tokens)",
            o.last_hidden_state[valid],
            e.last_hidden_state[valid],
            r.last_hidden_state[valid],
            1e-2,
        )
    ]
    return out + _attention_rows("bert", o, e, r, valid)


def _attention_rows(model: str, o, e, r, valid) -> list:
    """The bf16 rule on the first and last layers' attentions of the real query rows
    (eager gives padded rows uniform weights, sdpa gives them 0)."""
    rows = valid[:, None, :, None]
    out = []
    for layer in (0, len(o.attentions) - 1):
        pick = lambda a: a[layer].masked_select(rows)  # noqa: E731, B023
        out.append(
            bf16_rule(
                f"{model} attentions layer {layer} (real rows)",
                pick(o.attentions),
                pick(e.attentions),
                pick(r.attentions),
                2e-3,
            )
        )
    return out


def _llama(device):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        initializer_range=0.2,  # peaked logits: fewer near-ties for greedy decoding
    )
    return _pair(transformers.LlamaForCausalLM, config, device)


def _greedy(ours, eager, ref, inputs, new: int) -> dict:
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a, b = ours.generate(**inputs, **gen), eager.generate(**inputs, **gen)
    if torch.equal(a, b):
        return {
            "what": f"llama greedy generate ({new} tokens, left-padded batch)",
            "ok": True,
            "detail": "tokens equal eager's",
        }
    # the first step where a row departs: a near-tie of eager's own logits, or a bug
    start = inputs["input_ids"].shape[1]
    row, t = next(
        (r, t) for t in range(start, a.shape[1]) for r in range(a.shape[0]) if a[r, t] != b[r, t]
    )
    prefix = {
        "input_ids": b[row : row + 1, :t],
        "attention_mask": inputs["attention_mask"][row : row + 1].new_ones(1, t),
    }
    prefix["attention_mask"][:, :start] = inputs["attention_mask"][row : row + 1]
    with torch.no_grad():
        le = eager(**prefix).logits[0, -1].double()
        lr = ref(**prefix).logits[0, -1].double()
    noise = (le - lr).abs().max().item()
    margin = (le[b[row, t]] - le[a[row, t]]).item()
    return {
        "what": f"llama greedy generate ({new} tokens, left-padded batch)",
        "ok": margin <= 4 * noise,
        "detail": f"row {row} departs at token {t - start}: eager's margin {margin:.3g} vs "
        f"its bf16 error {noise:.3g} ({'a near-tie' if margin <= 4 * noise else 'NOT a tie'})",
    }


def check_llama(device) -> list[dict]:
    ours, eager, ref = _llama(device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # the second prompt left-padded by 3
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    with torch.no_grad():
        o, e, r = (m(**inputs, output_attentions=True) for m in (ours, eager, ref))
    valid = inputs["attention_mask"].bool()
    out = [
        bf16_rule(
            "llama logits (real tokens)", o.logits[valid], e.logits[valid], r.logits[valid], 2e-2
        )
    ]
    out += _attention_rows("llama", o, e, r, valid)
    out.append(_greedy(ours, eager, ref, inputs, 12))
    return out


def check_viewer(device) -> list[dict]:
    """One viewer session of the BERT on `device`, answered through the server's
    endpoint function, against eager's attentions of the same input."""
    import sdpa.integrations.transformers as sdpa_hf
    from sdpa.view.server import answer
    from sdpa.view.session import Session

    ours, eager, ref = _bert(device)
    batch = {k: v[:1] for k, v in _bert_batch(device).items()}  # one text of 37 tokens
    with torch.no_grad(), sdpa_hf.capture(ours) as cap:
        ours(**batch)
    with torch.no_grad():
        e, r = (m(**batch, output_attentions=True).attentions for m in (eager, ref))
    ids = batch["input_ids"][0].tolist()
    session = Session(
        kind="text",
        title="MiniLM-shaped random BERT",
        weights=cap.weights,
        pieces=[(str(t), " ", False) for t in ids],
    )
    out = []
    layers, heads = ours.config.num_hidden_layers, ours.config.num_attention_heads
    for layer, head, query in ((0, 0, 0), (1, 1, 17), (layers - 1, heads - 1, 36)):
        got = torch.tensor(
            answer(session, "/row", f"layer={layer}&head={head}&query={query}")["weights"]
        )
        out.append(
            bf16_rule(
                f"viewer /row layer {layer} head {head} query {query}",
                got,
                e[layer][0, head, query],
                r[layer][0, head, query],
                2e-3,
            )
        )
    mid = layers // 2
    stats = answer(session, "/head", f"layer={mid}&head=mean")

    def head_stats(att):  # (1, H, n, n) -> mean over heads of entropy per query, received
        p = att[mid][0].double()
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (H, n)
        return entropy.mean(0), p.sum(-2).mean(0)

    (ee, er), (re, rr) = head_stats(e), head_stats(r)
    out.append(
        bf16_rule(
            f"viewer /head layer {mid} mean: entropy", torch.tensor(stats["entropy"]), ee, re, 2e-3
        )
    )
    out.append(
        bf16_rule(
            f"viewer /head layer {mid} mean: received",
            torch.tensor(stats["received"]),
            er,
            rr,
            2e-3,
        )
    )
    return out


def check_unet(device) -> list[dict]:
    try:
        import diffusers
    except ImportError as e:
        return [
            {
                "what": "diffusers UNet step with capture",
                "ok": None,
                "detail": f"skipped: diffusers is not installed here ({e}); carry its wheel "
                f"(bash scripts/gpu_check.sh --fetch-wheels, then carry .whl)",
            }
        ]
    import sdpa.integrations.diffusers as sd

    torch.manual_seed(0)
    base = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24,
        attention_head_dim=4,
        norm_num_groups=8,
    ).eval()
    ref = copy.deepcopy(base).to(device, torch.float32)
    eager = copy.deepcopy(base).to(device, DTYPE)  # diffusers' own processors
    ours = sd.use_sdpa(copy.deepcopy(base)).to(device, DTYPE)
    g = torch.Generator().manual_seed(1)
    keep = torch.ones(2, 7)
    keep[1, 4:] = 0  # the second prompt has 4 tokens
    h, w = (7, 5) if device.type == "cpu" else (15, 13)  # the dry run: a smaller latent
    kw = {
        "sample": torch.randn(2, 4, h, w, generator=g),
        "timestep": torch.tensor([10, 10]),
        "encoder_hidden_states": torch.randn(2, 7, 24, generator=g),
        "encoder_attention_mask": keep,
    }
    kw32 = {k: v.to(device) for k, v in kw.items()}
    kw16 = {
        k: v.to(device, DTYPE) if v.is_floating_point() else v.to(device) for k, v in kw.items()
    }
    seen = []
    with torch.no_grad():
        want, low = ref(**kw32).sample, eager(**kw16).sample
        with (
            sd.edit(ours, lambda info, q, k, v, mask: seen.append((q, k, mask))),
            sd.capture(ours, keep=True) as cap,
        ):
            got = ours(**kw16).sample
    out = [bf16_rule("unet step output (sdpa processors vs diffusers')", got, low, want, 1e-2)]
    calls = len(ours.attn_processors)
    out.append(
        {
            "what": "unet capture saw every attention call",
            "ok": cap.calls == calls and len(cap.records) == calls,
            "detail": f"{cap.calls} calls, {calls} processors",
        }
    )
    errs = []
    for record, (q, k, mask) in zip(cap.records, seen, strict=True):
        rows = [0, q.shape[-2] - 1]
        scale = q.shape[-1] ** -0.5 if record.info.scale is None else record.info.scale
        s = q[:, :, rows].double() @ k.double().mT * scale
        if mask is not None:
            m = mask.expand(*s.shape[:2], mask.shape[-2], s.shape[-1])
            m = m[:, :, rows] if m.shape[-2] > 1 else m
            s = s.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else s + m.double()
        got_rows = torch.stack([record.weights[:, :, r] for r in rows], dim=2)
        errs.append((got_rows.double() - s.softmax(-1)).abs().max().item())
    out.append(
        {
            "what": "unet captured weights (first and last rows of every call)",
            "ok": max(errs) <= 1e-4,
            "ours_err": max(errs),
            "detail": "vs softmax of the call's q, k in float64",
        }
    )
    return out


CHECKS = {"bert": check_bert, "llama": check_llama, "viewer": check_viewer, "unet": check_unet}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on CPU: runs, checks the script")
    parser.add_argument("--only", help="comma-separated checks: " + ",".join(CHECKS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_integrations.py needs a CUDA device here, or --dry-run")
    names = list(CHECKS) if not args.only else args.only.split(",")
    results = []
    for name in names:
        try:
            results += [{"check": name, **r} for r in CHECKS[name](device)]
        except Exception as e:  # one broken check must not hide the others
            results.append(
                {
                    "check": name,
                    "what": f"{name}: raised",
                    "ok": False,
                    "detail": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-2000:],
                }
            )
            print(results[-1]["traceback"], file=sys.stderr)
    for r in results:
        status = "skip" if r["ok"] is None else ("ok" if r["ok"] else "FAIL")
        nums = (
            (
                f"ours err {r['ours_err']:.2e}"
                + (f" eager {r['eager_err']:.2e}" if "eager_err" in r else "")
            )
            if "ours_err" in r
            else ""
        )
        print(f"{status:<4} {r['what']:<58} {nums} {r.get('detail', '')}".rstrip())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "checks": results}, f, indent=1)
    return 0 if all(r["ok"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
