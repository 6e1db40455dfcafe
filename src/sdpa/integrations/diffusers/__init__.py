"""diffusers on sdpa: the same outputs at fused speed, and every attention call's
weights (lazy, nothing L x S kept) or replacement when asked.

    from sdpa.integrations import diffusers as sdpa_diffusers
    sdpa_diffusers.use_sdpa(pipe.unet)                      # processors replaced, by name
    with sdpa_diffusers.capture(pipe.unet, on_call=fn) as cap:
        pipe(prompt, callback_on_step_end=cap.on_step_end)  # fn(record) per call
    with sdpa_diffusers.edit(pipe.unet, fn):                # fn(info, q, k, v, mask)
        pipe(prompt)                                        #   -> output or None

Every sdpa processor computes q, k and v as the diffusers processor it replaces, then
calls `attend(info, q, k, v, mask)`: with no capture or edit open on the model, one
context-variable read and sdpa.attention's output (torch's fused kernel, as diffusers'
AttnProcessor2_0 / dispatch "native" use). A CallInfo says which call it is: its name
(the attn_processors key), kind ("self", "cross", "joint"), step, image-token grid and
where the text tokens are.

diffusers' attention-backend registry (`attention_backend`, `set_attention_backend`)
names a closed enum of backends and is reached only from the transformer processors;
sdpa plugs in one level up, as the processor, which is the route every model has
(UNets never reach the registry). A backend chosen there for a layer on sdpa is refused.
"""

from sdpa.integrations.diffusers.calls import (
    ACTIVE,
    CallInfo,
    CallRecord,
    Capture,
    Edit,
    ModelState,
    attend,
    default,
)
from sdpa.integrations.diffusers.models import (
    COVERED,
    REFUSED_BECAUSE,
    attention_modules,
    capture,
    edit,
    refusal_reason,
    restore,
    use_sdpa,
)
from sdpa.integrations.diffusers.processors import (
    SdpaAttnProcessor,
    SdpaFluxAttnProcessor,
    SdpaJointAttnProcessor,
)

__all__ = [
    "ACTIVE",
    "COVERED",
    "REFUSED_BECAUSE",
    "CallInfo",
    "CallRecord",
    "Capture",
    "Edit",
    "ModelState",
    "SdpaAttnProcessor",
    "SdpaFluxAttnProcessor",
    "SdpaJointAttnProcessor",
    "attend",
    "attention_modules",
    "capture",
    "default",
    "edit",
    "refusal_reason",
    "restore",
    "use_sdpa",
]
