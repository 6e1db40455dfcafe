"""Pictures of attention: per-head heatmaps, query rows side by side, pixel maps, and
benchmark curves. Needs matplotlib (the `plot` extra); draws off-screen (Agg)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("sdpa.plot needs matplotlib: pip install 'sdpa[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heads_grid(
    weights: torch.Tensor,
    queries: Sequence[str],
    keys: Sequence[str],
    title: str,
    path: Path,
    head_ids: Sequence[int] | None = None,
) -> Path:
    """Heatmaps of weights (H, L, S), one per head (named by head_ids), token labels on
    both axes (up to 48 tokens; past that the axes count positions)."""
    plt = _pyplot()
    H = weights.shape[0]
    head_ids = list(range(H)) if head_ids is None else list(head_ids)
    cols = min(H, 4 if H > 4 else H)
    rows = math.ceil(H / cols)
    labelled = max(len(queries), len(keys)) <= 48
    size = min(6.0, max(2.2, 0.28 * max(len(queries), len(keys))))  # inches per panel
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols + 1.2, size * rows + 0.8),
                             squeeze=False, constrained_layout=True)  # fmt: skip
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        image = ax.imshow(weights[h].float().cpu(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {head_ids[h]}", fontsize=9)
        if labelled:
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
            ax.set_yticks(range(len(queries)), queries, fontsize=7)
        if h % cols == 0:
            ax.set_ylabel("query", fontsize=8)
        if h >= H - cols:
            ax.set_xlabel("key", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def query_rows(panels: Sequence[tuple[str, Sequence[str], torch.Tensor]], path: Path) -> Path:
    """Side by side: for each (title, key tokens, weights (H, S)), one query's weights over
    the keys, every head a row. The shared colour scale tops out at the largest weight on
    a word (not on [CLS]/[SEP], where most attention parks)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6),
                             constrained_layout=True, squeeze=False)  # fmt: skip
    top = max(
        float(w[:, [j for j, t in enumerate(keys) if t not in ("[CLS]", "[SEP]")]].max())
        for _, keys, w in panels
    )
    image = None
    for ax, (title, keys, w) in zip(axes[0], panels, strict=True):
        image = ax.imshow(w.float().cpu(), cmap="magma", vmin=0.0, vmax=top, aspect="auto")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(keys)), keys, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(w.shape[0]), [f"head {h}" for h in range(w.shape[0])], fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.9, label="attention weight (clipped at the top)")
    return _save(fig, path)


def pixel_maps(
    image: torch.Tensor, maps: torch.Tensor, pixels: Sequence[tuple[int, int]], path: Path
) -> Path:
    """The picture (H, W, 3) in [0, 1] with the query pixels numbered, then each query
    pixel's attention map (H, W) (mean of heads) over a faded picture, its own colour bar."""
    plt = _pyplot()
    n = len(pixels)
    fig, axes = plt.subplots(1, n + 1, figsize=(3.3 * (n + 1), 3.3), constrained_layout=True)
    picture = image.cpu().numpy()
    axes[0].imshow(picture)
    axes[0].set_title("input picture, query pixels", fontsize=10)
    for i, (y, x) in enumerate(pixels, start=1):
        axes[0].plot(x, y, marker="o", markersize=8, markeredgecolor="white",
                     markerfacecolor="black")  # fmt: skip
        axes[0].annotate(str(i), (x, y), xytext=(4, 4), textcoords="offset points",
                         color="white", fontsize=9, weight="bold")  # fmt: skip
    for i, (ax, m, (y, x)) in enumerate(zip(axes[1:], maps, pixels, strict=True), start=1):
        ax.imshow(picture, alpha=0.35)
        shown = ax.imshow(m.float().cpu(), cmap="inferno", alpha=0.8, vmin=0.0)
        ax.plot(x, y, marker="o", markersize=9, markeredgecolor="cyan", markerfacecolor="none",
                markeredgewidth=2)  # fmt: skip
        ax.set_title(f"{i}: what pixel (y={y}, x={x}) attends to", fontsize=9)
        fig.colorbar(shown, ax=ax, shrink=0.75, pad=0.02)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("4-head self-attention over the pixels (mean of heads; colour bar: weight)",
                 fontsize=10)  # fmt: skip
    return _save(fig, path)


def bench_curves(results: Sequence[dict], path: Path) -> Path:
    """Log-log median time against sequence length, one line per implementation."""
    plt = _pyplot()
    times: dict[str, dict[int, list[float]]] = {}  # impl -> length -> medians
    for r in results:
        if r.get("length") is not None:
            times.setdefault(r["impl"], {}).setdefault(r["length"], []).append(r["median_ms"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2), constrained_layout=True)
    for impl, by_length in sorted(times.items()):
        xs = sorted(by_length)
        ys = [sum(by_length[x]) / len(by_length[x]) for x in xs]  # ours is timed per peer
        ax.plot(xs, ys, marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L = S")
    ax.set_ylabel("median time (ms)")
    ax.set_title("attention forward, (1, 4, L, 32) float32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def heat_maps(
    image: torch.Tensor,
    maps: torch.Tensor,
    labels: Sequence[str],
    path: Path,
    title: str | None = None,
) -> Path:
    """The picture (H, W, 3) in [0, 1], then each heat map (N, h, w) (a prompt word's
    cross-attention, a pixel's self-attention; any grid, resized bilinearly to H x W)
    over the faded picture, labelled, each with its own colour bar (maps summed over
    layers and steps have no common scale)."""
    from sdpa.errors import SdpaValueError

    if maps.ndim != 3 or len(labels) != maps.shape[0] or image.ndim != 3 or image.shape[-1] != 3:
        raise SdpaValueError(
            f"heat_maps takes image (H, W, 3), maps (N, h, w) and N labels, got image "
            f"{tuple(image.shape)}, maps {tuple(maps.shape)} and {len(labels)} labels"
        )
    plt = _pyplot()
    H, W = image.shape[:2]
    shown = torch.nn.functional.interpolate(
        maps[:, None].float().cpu(), size=(H, W), mode="bilinear", align_corners=False
    )[:, 0]  # (N, H, W)
    n = maps.shape[0]
    fig, axes = plt.subplots(1, n + 1, figsize=(3.0 * (n + 1), 3.2), constrained_layout=True)
    picture = image.float().cpu().clamp(0, 1).numpy()
    axes[0].imshow(picture)
    axes[0].set_title("image", fontsize=10)
    for ax, m, label in zip(axes[1:], shown, labels, strict=True):
        ax.imshow(picture, alpha=0.4)
        drawn = ax.imshow(m.numpy(), cmap="jet", alpha=0.55)  # its own min..max
        ax.set_title(label, fontsize=10)
        fig.colorbar(drawn, ax=ax, shrink=0.75, pad=0.02)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
