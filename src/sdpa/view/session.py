"""What `sdpa view` shows: one model run with lazy capture, then rows and statistics.

A Session holds one lazy AttentionWeights (1, H, n, n) per layer and answers, in O(n)
memory each: a query's row for a head or the head average, and per-head statistics
(entropy per query, attention received per token) computed once from the lazy
weights. Nothing n x n is kept, except by `dense()` for the static export.

    s = text_session("How are you?")          # the bundled MiniLM; model_dir= for another
    s.row(layer=2, head=5, query=1)           # (n,) float32: w[0, 5, 1] of layer 2
    s.row(2, "mean", 1)                       # the head average
    s = unet_session()                        # the textbook passage's (1, 128, 64, 64) U-Net map
    s.row(0, 3, y * 64 + x)                   # what pixel (y, x) attends to, head 3

n: tokens (or pixels), H: heads of a layer.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sdpa.weights import AttentionWeights

MEAN = "mean"  # the head average, where a head index goes


class ViewError(ValueError):
    """A request `sdpa view` cannot honour; the message says what would work."""


@dataclass
class Session:
    """Attention of one input, ready to answer rows.

    kind: "text" (pieces are the tokens) or "pixels" (picture is (H, W, 3) in [0, 1]).
    weights: one lazy AttentionWeights (1, H_l, n, n) per layer.
    pieces: per token, (text shown, text between the previous token and this one,
        special); for pixels, empty.
    Statistics per layer, (H_l, n) float32 each, from the lazy weights: the entropy of
    each query row and the attention each token receives; computed on first use, or
    ahead by compute_statistics() (in a background thread while the server answers).
    """

    kind: str
    title: str
    weights: list[AttentionWeights]
    pieces: list[tuple[str, str, bool]] = field(default_factory=list)
    picture: torch.Tensor | None = None
    run_seconds: float = 0.0  # the model run
    run_peak_mib: float = 0.0  # this process's peak resident memory after the model run
    stats_seconds: float | None = None  # every layer's statistics, once all are done
    _stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for layer, w in enumerate(self.weights):
            if len(w.shape) != 4 or w.shape[0] != 1 or w.shape[2] != w.shape[3]:
                raise ViewError(
                    f"sdpa view shows self-attention of one input: layer {layer}'s weights "
                    f"are {tuple(w.shape)}, expected (1, heads, n, n)"
                )
        sizes = {w.shape[-1] for w in self.weights}
        if len(sizes) != 1:
            raise ViewError(
                f"sdpa view needs every attention call over the same n tokens, got lengths "
                f"{sorted(sizes)} (an encoder-decoder model?); use an encoder or a decoder"
            )
        self._locks = [threading.Lock() for _ in self.weights]  # one computation per layer

    @property
    def length(self) -> int:
        """n: tokens or pixels."""
        return self.weights[0].shape[-1]

    @property
    def heads(self) -> list[int]:
        """Heads per layer."""
        return [w.shape[1] for w in self.weights]

    def statistics(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(entropy, received), each (H, n) float32, of one layer; computed once."""
        done = self._stats.get(layer)
        if done is not None:
            return done
        with self._locks[layer]:  # a request for a layer being computed waits for it
            if layer not in self._stats:
                w = self.weights[layer]
                with torch.no_grad():
                    entropy = w.entropy()[0].float()  # (H, n)
                    received = w.sum(dim=-2)[0].float()  # (H, n)
                self._stats[layer] = entropy, received
            return self._stats[layer]

    def compute_statistics(self, stop: threading.Event | None = None) -> None:
        """Every layer's statistics, in order (until `stop` is set, checked between
        layers); records stats_seconds once all are done."""
        start = time.perf_counter()
        for layer in range(len(self.weights)):
            if stop is not None and stop.is_set():
                return
            self.statistics(layer)
        self.stats_seconds = time.perf_counter() - start

    def check(self, layer: int, head: int | str, query: int | None = None) -> None:
        """Raise ViewError unless layer, head (or "mean") and query are in range."""
        if not 0 <= layer < len(self.weights):
            raise ViewError(f"layer must be in 0..{len(self.weights) - 1}, got {layer}")
        heads = self.heads[layer]
        if head != MEAN and not (isinstance(head, int) and 0 <= head < heads):
            raise ViewError(f"head must be in 0..{heads - 1} or 'mean', got {head!r}")
        if query is not None and not 0 <= query < self.length:
            raise ViewError(f"query must be in 0..{self.length - 1}, got {query}")

    def row(self, layer: int, head: int | str, query: int) -> torch.Tensor:
        """(n,) float32: the weights of `query` over every token, for one head or the
        head average; computed from the LSE, one row per head."""
        self.check(layer, head, query)
        w = self.weights[layer]
        with torch.no_grad():
            if head == MEAN:
                return w[0, :, query].float().mean(0)  # (H, n) -> (n,)
            return w[0, head, query].float()  # (n,)

    def head_stats(self, layer: int, head: int | str) -> dict[str, list[float]]:
        """Per token: the entropy of its query row (nats) and the attention it receives
        (summed over the queries), for one head or averaged over the heads."""
        self.check(layer, head)
        entropy, received = self.statistics(layer)
        pick = (lambda t: t.mean(0)) if head == MEAN else (lambda t: t[head])
        return {"entropy": pick(entropy).tolist(), "received": pick(received).tolist()}

    def grid(self) -> dict:
        """One summary per head of the layers whose statistics are done (None for the
        others, which are still being computed): mean entropy, the token that receives
        most and how much."""
        rows = []
        for layer in range(len(self.weights)):
            done = self._stats.get(layer)
            if done is None:
                rows.append(None)
                continue
            ent, rec = done
            top = rec.argmax(-1)  # (H,)
            rows.append(
                [
                    {
                        "entropy": ent[h].mean().item(),
                        "top": int(top[h]),
                        "top_received": rec[h, top[h]].item(),
                    }
                    for h in range(ent.shape[0])
                ]
            )
        return {"grid": rows, "stats_s": self.stats_seconds}

    def info(self) -> dict:
        """What the page needs first (O(layers * heads + n)): the tokens or the picture,
        heads per layer, and the grid of head summaries done so far."""
        out = {
            "kind": self.kind,
            "title": self.title,
            "length": self.length,
            "heads": self.heads,
            "max_entropy": math.log(max(self.length, 2)),
            "model_s": self.run_seconds,
            **self.grid(),
        }
        if self.kind == "text":
            out["tokens"] = [p[0] for p in self.pieces]
            out["gaps"] = [p[1] for p in self.pieces]
            out["special"] = [i for i, p in enumerate(self.pieces) if p[2]]
        else:
            H, W, _ = self.picture.shape
            rgb = (self.picture * 255).round().to(torch.uint8)  # (H, W, 3)
            out["size"] = [H, W]
            out["picture"] = rgb.flatten().tolist()
        return out

    def dense_bytes(self) -> int:
        """Bytes of every layer's dense float32 weights."""
        return sum(4 * math.prod(w.shape) for w in self.weights)

    def dense(self) -> list[torch.Tensor]:
        """Every layer's dense weights (H, n, n), float32: for the static export only."""
        with torch.no_grad():
            return [w.full(max_bytes=None)[0].float() for w in self.weights]


def _peak_mib() -> float:
    """This process's peak resident memory so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def unet_session(size: int = 64) -> Session:
    """The textbook passage's U-Net case: SpatialSelfAttention (4 heads) over the feature map of the
    demo's picture, (1, 128, size, size); pixel (y, x) is query y * size + x."""
    from sdpa.examples.unet_attention import picture, setup

    block, x = setup(size)
    start = time.perf_counter()
    with torch.no_grad():
        w = block(x).weights  # (1, 4, size*size, size*size), lazy
    return Session(
        kind="pixels",
        title=f"U-Net feature map {tuple(x.shape)}: 4 heads over {size * size} pixels",
        weights=[w],
        picture=picture(size),
        run_seconds=time.perf_counter() - start,
        run_peak_mib=_peak_mib(),
    )


INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # what a tokenizer gives a model
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_limit(config: object) -> tuple[int | None, str]:
    """(the most tokens the model reads, the config field that says so); None: no limit."""
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None, ""


def _check_no_remote_code(folder: Path, trust_remote_code: bool) -> None:
    """Refuse a folder whose config names code shipped with it, unless trusted; a known
    model_type with an auto_map runs transformers' own code and is fine."""
    from transformers import CONFIG_MAPPING

    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ViewError(f"--model: cannot read {path}: {e}") from e
        if not isinstance(data, dict):
            raise ViewError(f"--model: {path} is not a JSON object")
        custom = data.get("auto_map")
        known = name == "config.json" and data.get("model_type") in CONFIG_MAPPING
        if custom and not known and (name == "config.json" or "AutoTokenizer" in custom):
            raise ViewError(
                f"--model folder {str(folder)!r} ships its own Python code ({name} auto_map "
                f"{custom}); sdpa view runs it only with --trust-remote-code"
            )


def _folder(model_dir: str | None, trust_remote_code: bool) -> tuple[str, str]:
    """(path, display name) of a checked local model folder; the bundled MiniLM for None."""
    from sdpa.examples import minilm

    path = minilm.model_path() if model_dir is None else model_dir  # also sets HF_HUB_OFFLINE
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ViewError(
            f"--model must be a local transformers model folder (with config.json), got "
            f"{str(path)!r}"
        )
    _check_no_remote_code(folder, trust_remote_code)
    return str(path), "all-MiniLM-L6-v2" if model_dir is None else folder.resolve().name


@contextlib.contextmanager
def _loading(path: str, what: str):
    """A loader's error as one ViewError (one line) naming --model and the folder. The
    loaders read files the user gave, and fail in their own ways: no weights (OSError), an
    unknown model type (ValueError, KeyError), a pickle, corrupt or truncated
    model.safetensors (safetensors' SafetensorError), a pickle that torch's weights-only
    loader refuses (UnpicklingError, over ten lines), a broken tokenizer.json (json's
    error); each is the folder's fault, so any Exception the loader raises is caught."""
    try:
        yield
    except ViewError:
        raise
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = lines[0][:300] if lines else "no message"  # torch's run over 10 lines
        raise ViewError(
            f"--model {path!r}: cannot load its {what}: {type(e).__name__}: {first}"
        ) from e


def load_tokenizer(model_dir: str | None, trust_remote_code: bool = False):
    """(tokenizer, config, path, name) of a local model folder, without its weights."""
    path, name = _folder(model_dir, trust_remote_code)
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # the command prints its own lines

    kw = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    with _loading(path, "config"):
        config = AutoConfig.from_pretrained(path, **kw)
    with _loading(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    return tokenizer, config, path, name


def load_model(path: str, config, trust_remote_code: bool = False):
    """The model of a checked folder, on sdpa's attention, in eval mode."""
    from transformers import AutoModel

    import sdpa.integrations.transformers as sdpa_hf

    implementation = sdpa_hf.register()  # ours: outside the loader's error net
    with _loading(path, "model"):
        return AutoModel.from_pretrained(
            path,
            config=config,
            attn_implementation=implementation,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
        ).eval()


def _pieces(tokenizer, text: str, encoding: dict) -> list[tuple[str, str, bool]]:
    """(shown text, gap before it, special) per token: spans of the original text where
    the tokenizer gives offsets, else the token strings separated by spaces."""
    ids = encoding["input_ids"]
    names = tokenizer.convert_ids_to_tokens(ids)
    special = set(tokenizer.all_special_ids)
    offsets = encoding.get("offset_mapping")
    out, end = [], 0
    for i, (tid, name) in enumerate(zip(ids, names, strict=True)):
        is_special = tid in special
        if offsets is not None and not is_special and offsets[i][1] > offsets[i][0]:
            a, b = offsets[i]
            gap = text[end:a] if a >= end else ""
            out.append((text[a:b], gap, False))
            end = max(end, b)
        else:
            out.append((str(name), " " if out else "", is_special))
    return out


def text_session(
    text: str, model_dir: str | None = None, *, trust_remote_code: bool = False
) -> Session:
    """Run a transformers model once on `text` with lazy capture (batch 1).

    Refuses empty text and text past the model's context (its limit named).
    """
    tokenizer, config, path, name = load_tokenizer(model_dir, trust_remote_code)
    limit, key = context_limit(config)
    try:
        encoding = tokenizer(text, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets
        encoding = tokenizer(text)
    ids = encoding["input_ids"]
    special = set(tokenizer.all_special_ids)
    if not text.strip() or all(i in special for i in ids):
        raise ViewError("the text is empty: give some words, e.g. sdpa view 'How are you?'")
    if limit is not None and len(ids) > limit:
        raise ViewError(
            f"the text has {len(ids)} tokens; {name} reads at most {limit} "
            f"(config.{key}): shorten it, or use a --model with a longer context"
        )
    model = load_model(path, config, trust_remote_code)
    named = inspect.signature(model.forward).parameters  # decoders take **kwargs too
    batch = {k: torch.tensor([v]) for k, v in encoding.items() if k in INPUTS and k in named}
    if "use_cache" in named:  # one forward pass: no cache to keep
        batch["use_cache"] = False
    import sdpa.integrations.transformers as sdpa_hf

    start = time.perf_counter()
    with torch.no_grad(), sdpa_hf.capture(model) as cap:
        model(**batch)
    seconds, peak = time.perf_counter() - start, _peak_mib()
    if not cap.weights:
        raise ViewError(f"{name} made no attention call through sdpa; nothing to show")
    return Session(
        kind="text",
        title=f"{name}: {len(ids)} tokens",
        weights=cap.weights,
        pieces=_pieces(tokenizer, text, encoding),
        run_seconds=seconds,
        run_peak_mib=peak,
    )
