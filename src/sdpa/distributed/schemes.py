"""Sequence parallelism's three schemes, one call signature and one code path:

- ring_attention: the ring over one group; key/value shards travel (R - 1 per rank).
- ulysses_attention: DeepSpeed-Ulysses over one group; all-to-alls trade sequence
  shards for head shares, each rank attends over the whole sequence for H / U heads,
  and the outputs go back (q, k, v, outputs: (U - 1) / U of each shard per rank).
- hybrid_attention: Ulysses inside one group (U ranks), the ring across another (R),
  as USP: heads split U ways, the ring over R chunks of U shards each.

Every scheme is Ulysses over a group (of one rank for the ring) around a ring (of one
rank for Ulysses): the group's all-to-all, then the ring over the chunks, then the
all-to-all back. The sequence is cut across the U * R ranks in the order (ring rank,
Ulysses rank): the shard of Ulysses rank u in ring rank j is shard j * U + u.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdpa import masks
from sdpa.distributed import heads, local_masks
from sdpa.distributed.comm import (
    Ring,
    RingError,
    check_agreement,
    mask_digest,
    raise_failed,
    require_initialized,
    valid_timeout,
)
from sdpa.distributed.layout import Run, check_layout, cut, describe
from sdpa.distributed.local_masks import KeyPadding
from sdpa.distributed.ring import RingFunction, make_setup
from sdpa.distributed.weights import RingWeights
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.functional import AttentionResult
from sdpa.inputs import check_structured, normalize

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for its peers before raising
HINT = (
    "Every rank passes its shard with the same dtype, mask, causal, scale and layout, and "
    "the same dims but the sequence's (dim -2)"
)


def _check_call(query, key, value, mask, scale, layout, timeout, call: str):
    """This rank's own checks: (normalised inputs, the header every rank must agree on)."""
    if not valid_timeout(timeout):
        raise SdpaValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(mask, masks.ScoreMod):
        raise NotSupportedError(
            f"{call} does not run softcap or attention sinks yet, got {mask!r}; "
            f"use sdpa.attention on the gathered sequence"
        )
    if not (mask is None or isinstance(mask, masks.Mask | torch.Tensor | KeyPadding)):
        raise SdpaTypeError(
            f"{call} takes a structured mask (sdpa.masks: padding, documents, causal, "
            f"sliding_window and their combinations, which every rank evaluates at its own "
            f"positions), a tensor of this rank's rows over every key, or "
            f"sdpa.distributed.key_padding(keep) of this rank's keys; got "
            f"{type(mask).__name__}"
        )
    layout = check_layout(layout)
    inputs = normalize(query, key, value, None, scale=scale)
    local, described = local_masks.NONE, mask_digest(mask)
    if isinstance(mask, torch.Tensor | KeyPadding):
        n, m = query.shape[-2], key.shape[-2]
        local, described = local_masks.check(mask, inputs.lead, n, m, query.device)

    def outer(t):  # a shape without the sequence dim: the ranks' shards may differ there
        return [*t.shape[:-2], t.shape[-1]]

    header = {
        "query": outer(query),
        "key": outer(key),
        "value": outer(value),
        "dtype": str(query.dtype),
        "device": query.device.type,
        "scale": inputs.scale,
        "layout": describe(layout),
        "mask": described,
    }
    return (inputs, local), header


def _check_whole(inputs, mask, causal: bool, L: int, S: int, has_heads: bool) -> None:
    """Checks of the whole sequence, made alike on every rank once the sizes are known
    (so they raise everywhere or nowhere)."""
    if causal and L != S:
        raise SdpaValueError(
            f"causal=True needs as many queries as keys over the whole sequence, got L={L} "
            f"queries and S={S} keys"
        )
    if mask is not None:  # the same rule as sdpa.attention's, at the whole sequence's size
        batch = inputs.lead[:-1] if has_heads else inputs.lead
        check_structured(mask, batch, L, S)


def _agree(group: Ring, ring: Ring, check, device, call: str):
    """Headers within the Ulysses group, then across the ring (each carrying its
    group's sizes and ranks); a rank's own failure, or any rank's, reaches every rank
    of both before anyone raises. Returns (the ring's headers, the group's, inputs)."""
    error, inputs = None, None
    try:
        inputs, header = check()
    except (TypeError, ValueError) as e:
        error, header = e, {"error": f"{type(e).__name__}: {e}"}
    within = group.headers(header, device, call)
    failed = next((f"rank {r}: {h['error']}" for r, h in enumerate(within) if "error" in h), None)
    if error is None and failed is None:
        shared = {k: v for k, v in header.items() if k != "sizes"}
        across = {**shared, "sizes": [h["sizes"] for h in within], "ranks": group.ranks,
                  "member": group.rank}  # fmt: skip
    else:
        across = {"error": f"in a Ulysses group, {failed}" if error is None else header["error"]}
    headers = ring.headers(across, device, call)
    if error is not None:
        raise error
    raise_failed(within, group.rank)
    raise_failed(headers, ring.rank)
    places = [h["member"] for h in headers]
    if len(set(places)) > 1:
        raise RingError(
            f"rank {ring.rank}: the ring group joins ranks of different places in their "
            f"Ulysses groups ({places}); each ring group holds the ranks of one place, so "
            f"that they hold the same heads"
        )
    for hs, me in ((within, group.rank), (headers, ring.rank)):
        check_agreement(
            [{k: v for k, v in h.items() if k not in ("sizes", "ranks", "member")} for h in hs],
            me,
            call,
            HINT,
        )
    return headers, within, inputs


def _joined(members: list[list[Run]]) -> list[Run]:
    """The runs of the members' shards concatenated in order (adjacent ones merged)."""
    out: list[Run] = []
    offset = 0
    for runs in members:
        for r in runs:
            last = out[-1] if out else None
            if (
                last
                and last.start + last.length == r.start
                and last.local + last.length == offset + r.local
            ):
                out[-1] = Run(last.local, last.start, last.length + r.length)
            else:
                out.append(Run(offset + r.local, r.start, r.length))
        offset += sum(r.length for r in runs)
    return out


def _sharded(
    query, key, value, mask, causal, scale, layout, group: Ring, ring: Ring, timeout, call
):
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")

    def check():
        inputs, header = _check_call(query, key, value, mask, scale, layout, timeout, call)
        return inputs, {**header, "causal": bool(causal), "sizes": [query.shape[-2], key.shape[-2]]}

    headers, within, (inputs, local) = _agree(group, ring, check, device, call)
    U, R = group.world, ring.world
    sizes = [s for h in headers for s in h["sizes"]]  # every shard's (n, m), in sequence order
    q_runs = cut(layout, [n for n, _ in sizes], "query shards")  # the U * R shards'
    k_runs = cut(layout, [m for _, m in sizes], "key shards")
    L, S = sum(n for n, _ in sizes), sum(m for _, m in sizes)
    has_heads = max(t.ndim for t in (query, key, value)) >= 4
    structured = mask if isinstance(mask, masks.Mask) else None
    _check_whole(inputs, structured, causal, L, S, has_heads)
    local_masks.check_keys(local, S)
    q, k, v = inputs.query, inputs.key, inputs.value  # (B, Hq, n, E), (B, Hkv, m, E|Ev)
    repeat = heads.kv_repeats(q.shape[1], k.shape[1], U)
    if repeat > 1:  # key/value heads that do not divide by U: whole GQA groups per member
        k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
    n_of, m_of = [h["sizes"][0] for h in within], [h["sizes"][1] for h in within]
    qh = heads.to_heads(group, q, n_of, "q")  # (B, Hq / U, the group's rows, E)
    kh, vh = (heads.to_heads(group, t, m_of, "kv") for t in (k, v))
    rows, keys = _masks_to_heads(group, local, has_heads, q.shape, S, n_of, m_of)
    chunks = [slice(j * U, (j + 1) * U) for j in range(R)]
    setup = make_setup(
        ring, [_joined(q_runs[c]) for c in chunks], [_joined(k_runs[c]) for c in chunks],
        structured, bool(causal), inputs.scale, L, S, q.device,
    )  # fmt: skip
    out, lse = RingFunction.apply(qh, kh, vh, rows, keys, setup)  # (B, Hq/U, N, Ev), (B, Hq/U, N)
    out = heads.to_sequence(group, out, n_of, "out")  # (B, Hq, n, Ev)
    lse = heads.to_sequence(group, lse[..., None], n_of, "lse")[..., 0]  # (B, Hq, n)
    out = out.reshape(*inputs.lead, q.shape[2], v.shape[-1])  # (..., n, Ev)
    rule = masks.TOP_LEFT if causal else None
    if structured is not None:
        rule = structured if rule is None else structured & rule
    if U == 1 or R == 1:
        readers = ring if U == 1 else group
    else:  # every shard's rank in sequence order, point to point on the default group
        readers = Ring(None, ring.timeout, [r for h in headers for r in h["ranks"]])
    weights = RingWeights(
        readers, query, key, lse, inputs.lead, rule, inputs.scale, q_runs, k_runs, local
    )
    return AttentionResult(out, weights)


def _masks_to_heads(group: Ring, local, has_heads: bool, q_shape, S: int, n_of, m_of):
    """A call's tensor masks as the ring takes them: rows (Bm, Hm, n|1, S) and key
    padding (B, m) of this rank; under Ulysses (U > 1) every row of the group at this
    rank's heads, (Bm, Hq / U, N, S), and every key's padding, (B, M)."""
    rows, keys = local.rows4(has_heads), local.keys
    U = group.world
    if U > 1 and rows is not None:
        rows = rows.expand(rows.shape[0], q_shape[1], q_shape[2], S)
        bits = rows.dtype == torch.bool  # sent as bytes
        rows = heads.to_heads(group, rows.view(torch.uint8) if bits else rows, n_of, "mask")
        rows = rows.view(torch.bool) if bits else rows
    if U > 1 and keys is not None:  # (B, U, m, 1) -> (B, 1, M, 1)
        keys = keys.view(torch.uint8)[:, None, :, None].expand(-1, U, -1, -1)
        keys = heads.to_heads(group, keys, m_of, "mask")[:, 0, :, 0].view(torch.bool)
    return rows, keys


def _alone(timeout: float) -> Ring:
    """A group of this rank alone: the ring of Ulysses, the group of the ring."""
    require_initialized()  # (before dist.get_rank, which would fail without saying how)
    return Ring(None, timeout, [dist.get_rank()])


def _timeout(timeout: object) -> float:
    return timeout if valid_timeout(timeout) else DEFAULT_TIMEOUT  # (refused in the check)


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: masks.Mask | torch.Tensor | KeyPadding | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout="contiguous",
    group=None,
    timeout: float = DEFAULT_TIMEOUT,
) -> AttentionResult:
    """Attention over a sequence sharded along dim -2 across the ranks of `group`.

    Shapes, per rank: query (..., n, E), key (..., m, E), value (..., m, Ev) -> output
    (..., n, Ev), this rank's rows of what `sdpa.attention` gives on the whole sequence
    (L queries, S keys: the sums of the ranks' n and m); weights: lazy (..., n, S)
    (RingWeights). Leading dims as in `sdpa.attention` (heads at dim -3 of 4-D inputs,
    GQA when key/value heads divide query heads). Shards may differ in size, zero
    included.

    layout: how the sequence was cut: "contiguous" (shards of any size), "zigzag"
    (equal shards, balancing causal work) or `per_document(lengths)`; see
    sdpa.distributed.shard. mask: a structured mask (sdpa.masks) over the whole
    sequence's positions; or a tensor of this rank's rows over every key (bool/int:
    nonzero takes part; float: added to the scores, its gradient returned), broadcasting
    to (..., n, S); or `key_padding(keep)`, (B, m) of this rank's keys, which travels with
    the key/value shards. causal: query i sees keys j <= i (global positions). A
    collective: every rank of `group` calls it, and backward through the output is a
    collective too. Every wait ends after `timeout` seconds with RingTimeoutError;
    ranks that disagree, or a rank whose arguments are invalid, make every rank raise.
    """
    t = _timeout(timeout)
    return _sharded(query, key, value, mask, causal, scale, layout, _alone(t), Ring(group, t),
                    timeout, "ring_attention")  # fmt: skip


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: masks.Mask | torch.Tensor | KeyPadding | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout="contiguous",
    group=None,
    timeout: float = DEFAULT_TIMEOUT,
) -> AttentionResult:
    """ring_attention's call and results by DeepSpeed-Ulysses: all-to-alls over `group`
    give each rank the whole sequence for Hq / U of the query heads (U the group's
    size; Hq must divide by U), attention runs there, and the outputs go back. Key/value
    heads that do not divide by U are repeated to lcm(Hkv, U) heads first (each rank
    then holds whole GQA groups); the result is the same. Sends (U - 1) / U of each of
    q, k, v and the output per rank instead of the ring's R - 1 key/value shards."""
    t = _timeout(timeout)
    return _sharded(query, key, value, mask, causal, scale, layout, Ring(group, t), _alone(t),
                    timeout, "ulysses_attention")  # fmt: skip


def hybrid_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: masks.Mask | torch.Tensor | KeyPadding | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout="contiguous",
    ulysses_group,
    ring_group,
    timeout: float = DEFAULT_TIMEOUT,
) -> AttentionResult:
    """ring_attention's call and results by Ulysses inside `ulysses_group` (U ranks, a
    node) and the ring across `ring_group` (R ranks, one of each Ulysses group, all of
    the same place in theirs): USP's hybrid. The sequence is cut across the U * R ranks
    in the order (ring rank, Ulysses rank): rank u of the Ulysses group at ring place j
    holds shard j * U + u. The weights' reads run over all U * R ranks."""
    if ulysses_group is None or ring_group is None:
        raise SdpaValueError(
            "hybrid_attention needs ulysses_group and ring_group (process groups: every rank "
            "is in one of each); for one group use ring_attention or ulysses_attention"
        )
    t = _timeout(timeout)
    return _sharded(query, key, value, mask, causal, scale, layout, Ring(ulysses_group, t),
                    Ring(ring_group, t), timeout, "hybrid_attention")  # fmt: skip


__all__ = [
    "DEFAULT_TIMEOUT",
    "RingError",
    "hybrid_attention",
    "ring_attention",
    "ulysses_attention",
]
