"""The exceptions sdpa raises, all of them `RuntimeError`s as well.

torch raises RuntimeError for a scaled_dot_product_attention call it cannot run, and
code written against torch catches exactly that to fall back to another path. sdpa's
errors keep their Python meaning (a bad value is a ValueError, a bad type a TypeError)
and are RuntimeErrors too, so both kinds of `except` work:

    SdpaValueError(ValueError, RuntimeError)     a bad argument value or shape
    SdpaTypeError(TypeError, RuntimeError)       an argument of the wrong type or dtype
    NotSupportedError(SdpaValueError)            no backend (or not the one asked) can run
    StaleWeightsError(RuntimeError)              q, k or the mask changed after the call
    WeightsTooLargeError(MemoryError, RuntimeError)  over the memory budget asked for

Lowest layer: imports nothing from sdpa.
"""

from __future__ import annotations


class SdpaValueError(ValueError, RuntimeError):
    """A bad argument value or shape; the message names the argument, what was seen and
    what would work."""


class SdpaTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype."""


class NotSupportedError(SdpaValueError):
    """No backend (or not the one asked for) can run these inputs; the message says why."""


class StaleWeightsError(RuntimeError):
    """q, k or the mask changed in place after the attention call."""


class WeightsTooLargeError(MemoryError, RuntimeError):
    """The dense weights would exceed the memory budget asked for."""
