"""`sdpa view --html`: one self-contained HTML file with the dense weights embedded.

The page and its script are the served ones, inlined; the weights travel as base64
float32 (exact), one (H, n, n) block per layer, so the file grows as layers * heads *
n^2. Past `max_bytes` it is refused, naming `sdpa view`, which serves any length.
"""

from __future__ import annotations

import array
import base64
import json
import sys
from pathlib import Path

from sdpa.view.server import asset
from sdpa.view.session import MEAN, Session, ViewError

MAX_HTML_BYTES = 16 * 2**20  # a file a browser opens in about a second


def html_bytes_needed(session: Session) -> int:
    """About the file's size: base64 of every dense weight (4/3 of 4 bytes each)."""
    return session.dense_bytes() * 4 // 3 + 200_000


def page(session: Session, max_bytes: int = MAX_HTML_BYTES) -> str:
    """The static page as one string; ViewError past max_bytes."""
    need = html_bytes_needed(session)
    if need > max_bytes:
        what = "--unet" if session.kind == "pixels" else "the same text"
        raise ViewError(
            f"--html would embed every weight: {need / 2**20:.0f} MiB for {len(session.weights)} "
            f"layer(s), {max(session.heads)} heads and n={session.length}, over the "
            f"{max_bytes / 2**20:.0f} MiB budget of a static file; run `sdpa view` with "
            f"{what} (no --html) instead: it serves rows on demand for any length"
        )
    session.compute_statistics()
    weights = [base64.b64encode(_float32_le(d)).decode("ascii") for d in session.dense()]
    stats = [
        [session.head_stats(layer, h) for h in [*range(heads), MEAN]]
        for layer, heads in enumerate(session.heads)
    ]
    data = {"info": session.info(), "weights": weights, "stats": stats}
    # "<" escaped so that no token text can close the script element
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    html = asset("index.html").decode("utf-8")
    css, js = asset("app.css").decode("utf-8"), asset("app.js").decode("utf-8")
    html = html.replace('<link rel="stylesheet" href="app.css">', f"<style>\n{css}</style>")
    script = f"<script>window.SDPA_DATA = {blob};</script>\n<script>\n{js}</script>"
    return html.replace('<script src="app.js"></script>', script)


def _float32_le(t) -> bytes:
    """The tensor's values as little-endian float32 bytes (the page reads them so)."""
    values = array.array("f", t.float().flatten().tolist())
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def write_html(session: Session, path: str | Path, max_bytes: int = MAX_HTML_BYTES) -> Path:
    """Write the static page to path (its folder must exist)."""
    text = page(session, max_bytes)
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path
