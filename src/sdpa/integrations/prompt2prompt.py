"""Prompt-to-prompt edits (Hertz et al. 2022) as fused attention calls.

The batch holds a source prompt and target prompts (under classifier-free guidance, the
conditional half: [uncond x n, source, target 1, ...]). P2P rebuilds each target's
cross-attention map M_t (L image queries x S text tokens) from the source's M_s and
multiplies it by the target's values. Every edit it defines is linear in the map, so
with one matrix A_t (S x S) and one vector d_t (S) per target:

    M_t' = M_s A_t + M_t diag(d_t)
    M_t' V_t = attention(q_s, k_s, A_t V_t) + attention(q_t, k_t, d_t * V_t)

two fused calls (one where d_t = 0) instead of materialising M_s and M_t:

    word swap    A = P2P's replacement mapper (token j of the source -> token n of the
                 target; 1/k where a word of 1 token becomes k), d = 0
    refinement   A[mapper[n], n] = alpha[n] (the target token's aligned source token),
                 d = 1 - alpha (tokens with no source counterpart keep their own map)
    re-weighting A = diag(c), d = 0: column j of the map scaled by c_j, not renormalised
                 (P2P's AttentionReweight); composed with an edit: A diag(c), d * c.
                 Renormalised instead (renormalize=True): log c added to the source's
                 scores on key column j, softmax(s + log c) = c * exp(s) / sum(c * exp(s)).

A token's edit applies with its time weight a_n, 1 in its steps (P2P's
cross_replace_steps, per word with token_steps) and 0 elsewhere: A diag(a), d * a + 1 - a.
Self-attention replacement (P2P's self_replace_steps) gives each target the source's
self-attention map in layers with at most `self_max_tokens` queries (16 x 16 as P2P):
attention(q_s, k_s, V_t). Outside its steps an edit returns None, and the call runs unchanged.

    from sdpa.integrations import diffusers as sdpa_diffusers
    from sdpa.integrations import prompt2prompt as p2p

    prompts = ["a cat riding a bike", "a dog riding a bike"]
    fn = p2p.PromptToPrompt(p2p.swap(pipe.tokenizer, prompts), prompts=2,
                            cross_steps=40, self_steps=20)
    with sdpa_diffusers.edit(pipe.unet, fn) as session:
        pipe(prompts, callback_on_step_end=session.on_step_end)

Shapes: T targets, H heads, L queries (image tokens), S keys (text tokens), D, Dv.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.functional import attention

if TYPE_CHECKING:
    from sdpa.integrations.diffusers.calls import CallInfo


@dataclass(frozen=True)
class CrossEdit:
    """Each target's cross-attention map rebuilt from the source's:
    M_t' = softmax(s_s + log_weights_t) A_t + M_t diag(d_t).

    values: (T, S, S) A, source key j x target token n. own: (T, S) d, what each target
    token keeps of its own map. log_weights: (T, S) or None, added to the source's scores.
    """

    values: torch.Tensor
    own: torch.Tensor
    log_weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        T, S = self.own.shape
        if self.values.shape != (T, S, S):
            raise SdpaValueError(
                f"values must be (T, S, S) = {(T, S, S)} for own (T, S) = {(T, S)}, got "
                f"{tuple(self.values.shape)}"
            )
        if self.log_weights is not None and self.log_weights.shape != (T, S):
            raise SdpaValueError(
                f"log_weights must be (T, S) = {(T, S)}, got {tuple(self.log_weights.shape)}"
            )

    @property
    def targets(self) -> int:
        return self.own.shape[0]

    def reweighted(self, weights: torch.Tensor, renormalize: bool = False) -> CrossEdit:
        """This edit with column n of each target's new map scaled by weights (T|1, S)
        (P2P's AttentionReweight over a previous controller: A diag(c), d * c); with
        renormalize, log c added to the source's scores instead (only on an edit that is
        the source's map itself: A = I, d = 0)."""
        c = _weights(weights, self.own.shape)
        if not renormalize:
            return CrossEdit(self.values * c[:, None, :], self.own * c, self.log_weights)
        eye = torch.eye(c.shape[1], dtype=self.values.dtype).expand_as(self.values)
        if not (torch.equal(self.values, eye) and not self.own.any()):
            raise SdpaValueError(
                "renormalize=True re-weights the source's own map (values = identity, "
                "own = 0); over a swap or refinement use renormalize=False, as P2P does"
            )
        logs = c.log()
        if self.log_weights is not None:
            logs = logs + self.log_weights
        return CrossEdit(self.values, self.own, logs)

    def at(self, alpha: torch.Tensor) -> CrossEdit:
        """The edit applied with time weights alpha (T|1, S) in [0, 1] (P2P's
        cross_replace_alpha of one step): A diag(alpha), d * alpha + 1 - alpha."""
        a = _weights(alpha, self.own.shape)
        return CrossEdit(self.values * a[:, None, :], self.own * a + (1 - a), self.log_weights)


def _weights(w: torch.Tensor | Sequence, shape: tuple[int, int]) -> torch.Tensor:
    w = torch.as_tensor(w, dtype=torch.float32)
    w = w[None] if w.ndim == 1 else w
    if w.ndim != 2 or w.shape[1] != shape[1] or w.shape[0] not in (1, shape[0]):
        raise SdpaValueError(
            f"weights must be (S,) or (T|1, S) with T={shape[0]}, S={shape[1]}, got "
            f"{tuple(w.shape)}"
        )
    return w.expand(shape)


def identity(targets: int, tokens: int = 77) -> CrossEdit:
    """Every target takes the source's map as it is (the base of a re-weighting):
    A = I, d = 0."""
    eye = torch.eye(tokens).expand(targets, tokens, tokens)
    return CrossEdit(eye.clone(), torch.zeros(targets, tokens))


def reweight(
    weights: Mapping[int, float] | torch.Tensor,
    *,
    targets: int = 1,
    tokens: int = 77,
    base: CrossEdit | None = None,
    renormalize: bool = False,
) -> CrossEdit:
    """Re-weight token columns of the map: weights {token position: c} (every target) or
    a (T|1, S) tensor; over `base` (an edit) or the source's own map (P2P's equalizer,
    with prompts [p, p])."""
    base = identity(targets, tokens) if base is None else base
    if isinstance(weights, Mapping):
        c = torch.ones(base.own.shape[1])
        for j, value in weights.items():
            c[j] = float(value)
        weights = c
    return base.reweighted(weights, renormalize)


def from_mappers(mapper: torch.Tensor, alphas: torch.Tensor | None = None) -> CrossEdit:
    """A P2P mapper as an edit: a (T, S, S) float replacement mapper (word swap: target
    map = M_s @ mapper) or a (T, S) int refinement mapper with its alphas (T, S)
    (target token n <- source token mapper[n] with weight alpha[n]; the rest of the
    weight stays on the target's own map)."""
    if mapper.is_floating_point():
        if mapper.ndim != 3 or alphas is not None:
            raise SdpaValueError(
                f"a replacement mapper is (T, S, S) float with no alphas, got "
                f"{tuple(mapper.shape)} and alphas={alphas is not None}"
            )
        return CrossEdit(mapper.float(), torch.zeros(mapper.shape[0], mapper.shape[-1]))
    if alphas is None or mapper.ndim != 2 or alphas.shape != mapper.shape:
        raise SdpaValueError(
            f"a refinement mapper is (T, S) int with alphas (T, S), got "
            f"{tuple(mapper.shape)} and {None if alphas is None else tuple(alphas.shape)}"
        )
    if bool((alphas[mapper < 0] != 0).any()):
        raise SdpaValueError(
            "a refinement mapper's unaligned target tokens (mapper -1) must have alpha 0 (as "
            "P2P's get_refinement_mapper gives): they have no source map to take"
        )
    T, S = mapper.shape
    a = alphas.float() * (mapper >= 0)
    values = torch.zeros(T, S, S)
    values.scatter_(1, mapper.clamp(min=0)[:, None, :], a[:, None, :])  # A[t, mapper[t,n], n]
    return CrossEdit(values, 1 - alphas.float())


# -- mappers from a tokenizer (P2P's seq_aligner) -----------------------------------------


def _word_tokens(tokenizer, prompt: str) -> list[list[int]]:
    """The tokens of each space-separated word, checked to make up the prompt's tokens."""
    words = prompt.split(" ")
    per_word = [tokenizer(w, add_special_tokens=False).input_ids for w in words]
    whole = tokenizer(prompt, add_special_tokens=False).input_ids
    if [t for ws in per_word for t in ws] != whole:
        raise SdpaValueError(
            f"the words of {prompt!r} tokenized one by one differ from the prompt's tokens; "
            f"this tokenizer merges across spaces, so words cannot be aligned"
        )
    return per_word


def swap(tokenizer, prompts: Sequence[str], tokens: int = 77) -> CrossEdit:
    """Word swap (P2P's AttentionReplace): prompts[0] is the source, the others targets,
    each with as many space-separated words. A changed word whose tokens count the same
    maps token to token; one of k tokens spreads the source word's map as 1/k over each
    (P2P's ratio); the other tokens, the start, end and padding map in order."""
    source = _word_tokens(tokenizer, prompts[0])
    mappers = []
    for prompt in prompts[1:]:
        target = _word_tokens(tokenizer, prompt)
        if len(target) != len(source):
            raise SdpaValueError(
                f"a word swap needs prompts with as many words: {prompts[0]!r} has "
                f"{len(source)}, {prompt!r} has {len(target)}; use refine() for other edits"
            )
        m = torch.zeros(tokens, tokens)
        i = j = 1  # after the start token
        m[0, 0] = 1.0
        for ws, wt in zip(source, target, strict=True):
            src, tgt = list(range(i, i + len(ws))), list(range(j, j + len(wt)))
            if len(src) == len(tgt):
                m[src, tgt] = 1.0
            else:
                for n in tgt:
                    m[src, n] = 1.0 / len(tgt)
            i, j = i + len(ws), j + len(wt)
        if max(i, j) >= tokens:
            raise SdpaValueError(f"the prompts are longer than the {tokens} text tokens")
        rest = min(tokens - i, tokens - j)
        m[torch.arange(i, i + rest), torch.arange(j, j + rest)] = 1.0  # end, padding
        mappers.append(m)
    return from_mappers(torch.stack(mappers))


def _align(x: list[int], y: list[int]) -> list[int]:
    """For each token of y, the position of its aligned token in x, or -1: P2P's global
    alignment (gap 0, match 1, mismatch -1, ties to left, then up, then diagonal)."""
    n, m = len(x), len(y)
    score = [[0] * (m + 1) for _ in range(n + 1)]
    back = [[0] * (m + 1) for _ in range(n + 1)]
    for j in range(1, m + 1):
        back[0][j] = 1
    for i in range(1, n + 1):
        back[i][0] = 2
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            left, up = score[i][j - 1], score[i - 1][j]
            diag = score[i - 1][j - 1] + (1 if x[i - 1] == y[j - 1] else -1)
            score[i][j] = max(left, up, diag)
            back[i][j] = 1 if score[i][j] == left else 2 if score[i][j] == up else 3
    out = [-1] * m
    i, j = n, m
    while i > 0 or j > 0:
        if back[i][j] == 3:
            i, j = i - 1, j - 1
            out[j] = i
        elif back[i][j] == 1:
            j -= 1
        else:
            i -= 1
    return out


def refine(tokenizer, prompts: Sequence[str], tokens: int = 77) -> CrossEdit:
    """Refinement (P2P's AttentionRefine): prompts[0] is the source; each target token
    aligned to a source token (global alignment of the token sequences) takes that
    token's source map, a token with no counterpart (an added word) keeps its own;
    padding past the target's end takes the source's map at its own position."""
    x = tokenizer(prompts[0]).input_ids
    mappers, alphas = [], []
    for prompt in prompts[1:]:
        y = tokenizer(prompt).input_ids
        if max(len(x), len(y)) > tokens:
            raise SdpaValueError(f"the prompts are longer than the {tokens} text tokens")
        aligned = torch.tensor(_align(x, y), dtype=torch.long)
        mapper = torch.zeros(tokens, dtype=torch.long)
        alpha = torch.ones(tokens)
        mapper[: len(y)] = aligned
        alpha[: len(y)] = (aligned >= 0).float()
        mapper[len(y) :] = torch.arange(len(y), tokens)  # padding maps to itself, as P2P
        mappers.append(mapper)
        alphas.append(alpha)
    return from_mappers(torch.stack(mappers), torch.stack(alphas))


# -- applying an edit -----------------------------------------------------------------------


def _rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The mask for batch items `rows` (a mask with batch 1 or no batch dim broadcasts)."""
    if mask is None or mask.ndim < 4 or mask.shape[0] == 1:
        return mask
    return mask[rows]


def _with_log_weights(mask: torch.Tensor | None, logw: torch.Tensor) -> torch.Tensor:
    """mask (bool keep or float bias, broadcasting to (T, H, L, S)) plus log weights
    (T, 1, 1, S), as one float mask."""
    if mask is None:
        return logw
    if mask.dtype == torch.bool or not mask.is_floating_point():
        mask = torch.zeros((), dtype=logw.dtype, device=logw.device).masked_fill(
            mask == 0, float("-inf")
        )
    return mask + logw


def cross(q, k, v, mask, edit: CrossEdit, scale: float | None = None) -> torch.Tensor:
    """The targets' edited cross-attention output (T, H, L, Dv).

    q (1+T, H, L, D), k (1+T, H, S, D), v (1+T, H, S, Dv): the source then the T targets;
    mask None or broadcasting to (1+T, H, L, S); scale: the scores' (None: 1/sqrt(D))."""
    T = q.shape[0] - 1
    if T != edit.targets or k.shape[-2] != edit.own.shape[1]:
        raise SdpaValueError(
            f"the edit is for {edit.targets} targets and {edit.own.shape[1]} text tokens; the "
            f"call has {T} targets (batch {q.shape[0]} = source + targets) and "
            f"{k.shape[-2]} keys"
        )
    cd = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    A, d = edit.values.to(v.device, cd), edit.own.to(v.device, cd)
    v_t = v[1:].to(cd)  # (T, H, S, Dv)
    src_v = torch.einsum("tjn,thnd->thjd", A, v_t).to(v.dtype)  # (T, H, S, Dv): A_t V_t
    src_mask = _rows(mask, slice(0, 1))
    if edit.log_weights is not None:
        logw = edit.log_weights.to(v.device, torch.float32)[:, None, None, :]  # (T, 1, 1, S)
        src_mask = _with_log_weights(src_mask, logw)
    shape = (T, *q.shape[1:])
    out = attention(
        q[:1].expand(shape), k[:1].expand(T, *k.shape[1:]), src_v, src_mask, scale=scale
    ).output  # (T, H, L, Dv)
    if bool(d.any()):
        own_v = (v_t * d[:, None, :, None]).to(v.dtype)  # (T, H, S, Dv)
        out = out + attention(q[1:], k[1:], own_v, _rows(mask, slice(1, None)), scale=scale).output
    return out


def self_replace(q, k, v, mask, scale: float | None = None) -> torch.Tensor:
    """The targets' output with the source's self-attention map (T, H, L, Dv):
    attention(q_s, k_s, V_t) for q, k, v (1+T, H, L|S, D)."""
    T = q.shape[0] - 1
    src_mask = _rows(mask, slice(0, 1))
    return attention(
        q[:1].expand(T, *q.shape[1:]), k[:1].expand(T, *k.shape[1:]), v[1:], src_mask, scale=scale
    ).output


def _steps(steps: int | tuple[int, int] | None, name: str) -> range:
    if steps is None:
        return range(0)
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
        return range(steps)
    if (
        isinstance(steps, tuple)
        and len(steps) == 2
        and all(isinstance(s, int) and s >= 0 for s in steps)
    ):
        return range(*steps)
    raise SdpaTypeError(
        f"{name} must be N (the first N steps), (start, end) steps or None, got {steps!r}"
    )


class PromptToPrompt:
    """An edit function for `sdpa.integrations.diffusers.edit`: the prompt-to-prompt
    edit of a batch holding `prompts` prompts (the source first), under classifier-free
    guidance the last `prompts` items of a batch of 2 x prompts (P2P edits the
    conditional half only).

    cross_steps: N (the first N denoising steps) or (start, end): where `edit` rebuilds
        the targets' cross attention (P2P's cross_replace_steps = 0.8 of 50 steps is
        int(0.8 * 51) = 40). token_steps: {target token position: N or (start, end)},
        other steps for those tokens (P2P's cross_replace_steps dict, per word); in a
        step where only some tokens are edited, the edit applies with time weights
        (CrossEdit.at). self_steps: the same for self-attention replacement (None:
        never), in layers of at most self_max_tokens queries.
    """

    def __init__(
        self,
        edit: CrossEdit,
        *,
        prompts: int,
        cross_steps: int | tuple[int, int],
        token_steps: Mapping[int, int | tuple[int, int]] | None = None,
        self_steps: int | tuple[int, int] | None = None,
        self_max_tokens: int = 16 * 16,
    ) -> None:
        if not isinstance(edit, CrossEdit):
            raise SdpaTypeError(f"edit must be a CrossEdit (swap, refine...), got {edit!r}")
        if prompts != edit.targets + 1:
            raise SdpaValueError(
                f"prompts={prompts} but the edit has {edit.targets} targets (+1 source)"
            )
        self.edit = edit
        self.prompts = prompts
        self.cross_steps = _steps(cross_steps, "cross_steps")
        S = edit.own.shape[1]
        self.token_steps = {}
        for j, steps in (token_steps or {}).items():
            if not (isinstance(j, int) and 0 <= j < S):
                raise SdpaValueError(
                    f"token_steps keys must be token positions in [0, {S}), got {j!r}"
                )
            self.token_steps[j] = _steps(steps, f"token_steps[{j}]")
        self.self_steps = _steps(self_steps, "self_steps")
        self.self_max_tokens = self_max_tokens

    def __call__(self, info: CallInfo, q, k, v, mask) -> torch.Tensor | None:
        if info.kind == "joint":
            raise NotSupportedError(
                f"prompt-to-prompt edits UNet cross and self attention; {info.name!r} is a "
                f"joint (MMDiT / Flux) call, where text and image tokens share one map"
            )
        edit = self.edit
        if info.kind == "cross":
            alpha = torch.full((edit.own.shape[1],), float(info.step in self.cross_steps))
            for j, steps in self.token_steps.items():
                alpha[j] = float(info.step in steps)
            if not alpha.any():
                return None
            if not alpha.all():
                edit = edit.at(alpha)
        elif info.step not in self.self_steps or q.shape[-2] > self.self_max_tokens:
            return None
        B, n = q.shape[0], self.prompts
        if B not in (n, 2 * n):
            raise SdpaValueError(
                f"the batch of {info.name!r} is {B}; an edit of {n} prompts needs {n} (no "
                f"guidance) or {2 * n} (classifier-free guidance: unconditional, then "
                f"conditional)"
            )
        s = B - n  # the source: the first of the conditional half
        part = slice(s, B)
        args = (q[part], k[part], v[part], _rows(mask, part))
        if info.kind == "cross":
            edited = cross(*args, edit, info.scale)
        else:
            edited = self_replace(*args, info.scale)
        kept = attention(
            q[: s + 1], k[: s + 1], v[: s + 1], _rows(mask, slice(0, s + 1)), scale=info.scale
        )
        return torch.cat([kept.output, edited.to(q.dtype)], dim=0)  # (B, H, L, Dv)
