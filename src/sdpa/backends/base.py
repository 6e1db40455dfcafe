"""What every backend is: a name, the reasons it cannot run some inputs, and a forward."""

from __future__ import annotations

import torch

from sdpa.errors import NotSupportedError
from sdpa.inputs import Inputs

__all__ = ["Backend", "NotSupportedError"]


class Backend:
    """A way to compute attention. Subclasses set `name` and implement both methods.

    forward returns (output (B, Hq, L, Ev) in the input dtype, differentiable;
    lse (B, Hq, L) in the compute dtype, with 0 for rows that see no key).
    `AttentionWeights` rebuilds the weights from the LSE, unless `run` hands them over.
    """

    name: str = ""

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        """Plain sentences, one per reason this backend cannot run `inputs`; [] if it can."""
        raise NotImplementedError

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def path(self, inputs: Inputs) -> str:
        """How this backend computes `inputs`, in a few words (AttentionWeights.served_by,
        sdpa.explain)."""
        return self.summary

    summary: str = ""

    def run(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What `attention` calls: (output, lse, weights). A backend that computes the
        weights anyway returns them (B, Hq, L, S), detached, and may leave lse None;
        the others return forward's (output, lse) and None."""
        out, lse = self.forward(inputs)
        return out, lse, None

    def __repr__(self) -> str:
        return f"<sdpa backend {self.name!r}>"
