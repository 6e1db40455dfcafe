"""sdpa: scaled dot-product attention for PyTorch that is fast and shows its work."""

from importlib import metadata as _metadata

from sdpa import losses, masks, settings
from sdpa.errors import (
    NotSupportedError,
    SdpaTypeError,
    SdpaValueError,
    StaleWeightsError,
    WeightsTooLargeError,
)
from sdpa.functional import (
    AttentionResult,
    Explanation,
    attention,
    explain,
    frozen,
    scaled_dot_product_attention,
)
from sdpa.nn import MultiHeadAttention, PositionalEncoding, SpatialSelfAttention
from sdpa.weights import AttentionWeights

__all__ = [
    "AttentionResult",
    "AttentionWeights",
    "Explanation",
    "MultiHeadAttention",
    "NotSupportedError",
    "PositionalEncoding",
    "SdpaTypeError",
    "SdpaValueError",
    "SpatialSelfAttention",
    "StaleWeightsError",
    "WeightsTooLargeError",
    "attention",
    "explain",
    "frozen",
    "losses",
    "masks",
    "scaled_dot_product_attention",
    "settings",
]

try:  # the installed distribution's version: one number, pyproject.toml's
    __version__ = _metadata.version("sdpa")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"
