"""The listing's math in plain torch, with the documented edge semantics.

Materialises the (B, Hq, L, S) scores and runs the tile rule (sdpa.tile) on them whole:
excluded positions get -inf, rows that see no key give output 0 and LSE 0 (with sinks,
logaddexp(0, sink)), 16-bit inputs take their softmax in float32, softcap and sinks
(`sdpa.masks.ScoreMod`) as the tile rule applies them. Differentiable (in q, k, v, a
float mask and the sinks), and the only backend with dropout on CPU.
"""

from __future__ import annotations

import torch

from sdpa import tile
from sdpa.backends.base import Backend
from sdpa.inputs import Inputs


class Reference(Backend):
    name = "reference"
    summary = "the listing's math, the scores materialised"

    def path(self, inputs: Inputs) -> str:
        return self.summary + (", with dropout" if inputs.dropout_p > 0 else "")

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        return []

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = inputs.query, inputs.key, inputs.value
        window = tile.window(inputs.mask, q.shape[2], k.shape[2], device=q.device)  # (.., L, S)
        out, lse, _ = tile.attend(
            q, k, v, window, tile.Scoring.of(inputs), inputs.sinks, dropout_p=inputs.dropout_p
        )
        return out, lse  # (B, Hq, L, Ev), (B, Hq, L)
