"""sdpa: scaled dot-product attention for PyTorch that is fast and shows its work."""

from sdpa import masks
from sdpa.errors import (
    NotSupportedError,
    SdpaTypeError,
    SdpaValueError,
    StaleWeightsError,
    WeightsTooLargeError,
)
from sdpa.functional import AttentionResult, attention, scaled_dot_product_attention
from sdpa.nn import MultiHeadAttention, PositionalEncoding, SpatialSelfAttention
from sdpa.weights import AttentionWeights

__all__ = [
    "AttentionResult",
    "AttentionWeights",
    "MultiHeadAttention",
    "NotSupportedError",
    "PositionalEncoding",
    "SdpaTypeError",
    "SdpaValueError",
    "SpatialSelfAttention",
    "StaleWeightsError",
    "WeightsTooLargeError",
    "attention",
    "masks",
    "scaled_dot_product_attention",
]
__version__ = "0.1.0"
