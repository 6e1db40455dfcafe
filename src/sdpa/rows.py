"""The rows engine behind AttentionWeights: any selection of the weights, tile by tile.

For query row i, with s_ij = mod(scale * q_i . k_j) + bias_ij (sdpa.tile) and the row's
log-sum-exp from the kernel that ran the call,
    p_ij = exp(s_ij - lse_i)
so any row costs one GEMM and one exp, and nothing L x S is kept between calls. `Rows`
is a selection (batch elements, query heads, query rows, keys) of one call's weights;
the work is cut into tiles of at most `chunk_bytes` (sdpa.settings) of weights: whole
batch elements when they fit (a run of consecutive elements that read the same rows and
keys shares one tile: a batch of short rows costs one tile's ops), else row chunks of
one head, so no read allocates L x S.

Each tile is a driver's call of the tile rule. A `Source` gives the tiles of complete
rows (every key): scores, the window's mask, then `tile.finish` (torch's row-wise
softmax and log_softmax on CPU, the row max as the shift) into buffers it keeps; the
statistics, the KL and the reads' backward read those. The dense reads (`dense`) shift
by the LSE (`tile.rebuild` of the folded product, rows normalised by their own sum), or
by the row max for rows whose |lse| is past `exact_lse_limit` (the LSE of such a row
has lost digits in float32). A tile over a selection of keys (reads over the key dim,
pairs) cannot normalise its rows: p = exp(s - lse), and rows past the limit are read
whole (`needs_every_key`).

Key padding is skipped, not masked: a selection of complete rows carries each batch
element's key span (`key_spans`: the keys [lo, hi) holding every key its rows see), its
tiles cover only those keys (`Tile.keys`; the weights elsewhere are 0, placed by the
readers) and leave the mask out where it is all True there (`is_open`). Two calls read
on the same tiles (KL, score errors) share one span per element (`joint`). Padded
query rows a mask declares (`masks.padding(lengths, queries=True)`: rows that see no
key, `Rows.live`) are skipped the same way: their weights are 0 and never computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from sdpa import masks, settings, tile
from sdpa.inputs import Inputs, empty

ALL = slice(None)
# The reads run eagerly under torch.compile: their tile loops (a Python loop over tiles
# with a host read to pick the shift) are not graph material, and dynamo would hand the
# loop's indices to a resume function as symbolic ints.
_eager = torch.compiler.disable


class Rows(NamedTuple):
    """A selection of one call's weights: (len(batch), len(heads), n, m).

    inputs: the call (q (B, Hq, L, E), k (B, Hkv, S, E), mask, causal, scale, softcap,
    sinks); lse (B, Hq, L) of every row (sinks included). batch: the batch elements
    (indices into B); heads: the query heads (a range over Hq); rows: the query
    positions (a slice, or a (n,) tensor); keys: the key positions (a slice, or a (m,)
    tensor; ALL: every key, the rows then normalised exactly).
    """

    inputs: Inputs
    lse: torch.Tensor
    batch: range
    heads: range
    rows: slice | torch.Tensor = ALL
    keys: slice | torch.Tensor = ALL
    spans: tuple[masks.KeySpan, ...] | None = None  # per batch element (of B): see key_spans
    # per batch element (of B), the rows [first, stop) a caller reads where it reads every
    # row: the others it declares weightless (a loss's padded queries), read as 0 with
    # gradient 0 and never computed (`real_rows`)
    real: tuple[tuple[int, int], ...] | None = None
    # per batch element (of B), the rows [first, stop) outside which the mask lets a row
    # see no key (masks.query_spans): the tiles of every row cover only these, and a
    # tile's mask is left out (is_open) only where its rows lie inside
    live: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def every(cls, inputs: Inputs, lse: torch.Tensor) -> Rows:
        """Every row of every batch element and head, its key padding and declared query
        padding skipped (key_spans, query_spans)."""
        B, Hq = inputs.query.shape[:2]
        spans, live = key_spans(inputs), query_spans(inputs)
        return cls(inputs, lse, range(B), range(Hq), spans=spans, real=live, live=live)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B', H', n, m) of the selection."""
        L, S = self.inputs.query.shape[2], self.inputs.key.shape[2]
        return len(self.batch), len(self.heads), _count(self.rows, L), _count(self.keys, S)

    @property
    def complete(self) -> bool:
        """Whether the selection holds every key of its rows."""
        return isinstance(self.keys, slice) and self.keys == ALL

    @property
    def dtype(self) -> torch.dtype:
        return self.inputs.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.inputs.query.device


def _count(index: slice | torch.Tensor, n: int) -> int:
    return len(index) if isinstance(index, torch.Tensor) else len(range(*index.indices(n)))


# Key padding is looked for (a host read of B x S mask entries, tens of microseconds)
# only where a call's scores number at least this many: below it, there is little to skip.
SPAN_MIN_SCORES = 1 << 16


def key_spans(inputs: Inputs) -> tuple[masks.KeySpan, ...] | None:
    """The call's key spans (masks.key_spans: per batch element, the keys [lo, hi) that
    hold every key its rows see, and whether the mask is all True there), decided from
    shapes in O(1) first: None without a mask or below SPAN_MIN_SCORES. The tiles of
    complete rows then cover only those keys, and skip the mask where it is all True:
    the padded keys' weights are 0 and cost nothing."""
    if not _worth_a_look(inputs):
        return None
    return masks.key_spans(inputs.mask, inputs.query.shape[0], inputs.key.shape[2])


def _worth_a_look(inputs: Inputs) -> bool:
    """Whether a call's mask is worth reading for spans, from shapes in O(1): a mask, and
    at least SPAN_MIN_SCORES scores."""
    if inputs.mask is None:
        return False
    B, H, L, _ = inputs.query.shape
    return B * H * L * inputs.key.shape[2] >= SPAN_MIN_SCORES


def query_spans(inputs: Inputs) -> tuple[tuple[int, int], ...] | None:
    """The call's declared padded queries (masks.query_spans: per batch element, the rows
    [lo, hi) outside which a row sees no key), decided from shapes in O(1) first: None
    without a mask or below SPAN_MIN_SCORES."""
    if not _worth_a_look(inputs):
        return None
    return masks.query_spans(inputs.mask, inputs.query.shape[0], inputs.query.shape[2])


def _meet(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo = max(a[0], b[0])
    return lo, max(lo, min(a[1], b[1]))


def real_rows(r: Rows, keep: torch.Tensor | None) -> Rows:
    """r reading only the real query rows that keep (B, L) bool marks (a tokenizer's
    attention_mask on the CPU), each batch element's from its first to its last (within
    the rows r reads already): the other rows read as 0, with gradient 0, uncomputed.
    Only for a caller that gives the padded rows no weight (a loss that masks them
    out). None, or keep off the CPU (read it and the host would sync), keeps every row."""
    real = read_rows(r.real, keep)
    return r if real is r.real else r._replace(real=real)


def read_rows(
    real: tuple[tuple[int, int], ...] | None, keep: torch.Tensor | None
) -> tuple[tuple[int, int], ...] | None:
    """The rows a read computes per batch element (real_rows' rule): within `real` (None:
    every row), from the first to the last row keep (B, L) marks; `real` itself where
    keep is None or off the CPU."""
    if keep is None or not keep.is_cpu:
        return real
    B, L = keep.shape
    found = masks.key_spans(keep[:, None, None, :], B, L)  # (the span of the Trues)
    if found is None:
        return real
    spans = tuple((lo, hi) for lo, hi, _ in found)
    if real is not None:
        spans = tuple(_meet(a, b) for a, b in zip(real, spans, strict=True))
    return spans


def joint(a: Rows, b: Rows) -> tuple[Rows, Rows]:
    """Two selections read on the same tiles (KL, score errors: one side's tiles read with
    the other's), their key spans made one: per batch element the smallest span holding
    both (full on a side where its own span is that one and full). A side with no spans
    makes both read every key. Their rows are made one too (each side's `real`, the
    smallest span holding both; every row where a side has none): a row live on one
    side only reads as 0 on the other, which keeps its mask there (is_open)."""
    if a.real is None or b.real is None:
        a, b = a._replace(real=None), b._replace(real=None)
    else:
        real = tuple(
            (min(x[0], y[0]), max(x[1], y[1])) if x[1] > x[0] and y[1] > y[0] else
            (x if y[1] <= y[0] else y)
            for x, y in zip(a.real, b.real, strict=True)
        )  # fmt: skip
        a, b = a._replace(real=real), b._replace(real=real)
    if a.spans is None or b.spans is None:
        return a._replace(spans=None), b._replace(spans=None)
    both = [(min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a.spans, b.spans, strict=True)]

    def mine(own):
        return tuple(
            (lo, hi, s[2] and (s[0], s[1]) == (lo, hi))
            for (lo, hi), s in zip(both, own, strict=True)
        )

    return a._replace(spans=mine(a.spans)), b._replace(spans=mine(b.spans))


class Tile(NamedTuple):
    """One piece of work: batch elements `b` (a slice of B: consecutive elements that read
    the same rows and keys, at `at_b` in the output), query heads `heads` (at `at_h`),
    rows `rows` of the selection (positions `q_rows`), of complete rows the keys `keys`
    (ALL, or the elements' key span: every key their rows see; the weights at the others
    are 0). Its tensors are (nb, h, rows, keys), nb = len(at_b)."""

    at_b: slice
    b: slice
    at_h: slice
    heads: range
    at_r: slice
    q_rows: slice | torch.Tensor
    keys: slice = ALL

    @property
    def nb(self) -> int:
        """How many batch elements the tile holds."""
        return self.at_b.stop - self.at_b.start

    @property
    def elements(self) -> range:
        """The tile's batch elements (indices into B), in order."""
        return range(self.b.start, self.b.stop, self.b.step or 1)


def width(r: Rows, t: Tile) -> int:
    """How many keys tile t has."""
    return _count(t.keys, r.shape[3])


def is_open(r: Rows, t: Tile) -> bool:
    """Whether r's mask is all True over tile t's keys for each of its elements (their
    span is full: the mask is not applied there, and every row sees a key): where the
    mask declares padded queries, only for a tile whose rows are all live. Asked of each
    side of a joint read (the other side's tiles were grouped by the first side's)."""
    if r.spans is None or not r.complete:
        return False
    rows = t.q_rows
    if r.live is not None and not (isinstance(rows, slice) and rows.step in (None, 1)):
        return False
    for b in t.elements:
        if not r.spans[b][2]:
            return False
        if r.live is not None and not (r.live[b][0] <= rows.start and rows.stop <= r.live[b][1]):
            return False
    return True


def _head_blocks(r: Rows) -> list[tuple[int, range]]:
    """(offset in the selection, heads) blocks: the whole selection where it covers
    whole key-head groups with step 1 (their scores fold into one product), else one
    query head at a time."""
    g, heads = r.inputs.group, r.heads
    if heads.step == 1 and heads.start % g == 0 and heads.stop % g == 0:
        return [(0, heads)]
    return [(j, range(h, h + 1)) for j, h in enumerate(heads)]


def _sub_rows(rows: slice | torch.Tensor, L: int, r0: int, r1: int) -> slice | torch.Tensor:
    """Rows r0:r1 of a selection of query positions."""
    if isinstance(rows, torch.Tensor):
        return rows[r0:r1]
    start, _, step = rows.indices(L)
    return slice(start + r0 * step, start + r1 * step, step)


def _step(r: Rows, n: int, m: int, budget: int) -> tuple[int, int]:
    """(elements, rows) per tile over n rows and m keys of each batch element: whole
    batch elements (all selected heads and rows) where one fits in `budget` bytes or,
    for complete rows (the KL reads, statistics and backward a training step makes), in
    FOLD x `budget`, the budget taken at most the settings' chunk_bytes (a statistic's
    stretched budget folds no more): one tile's ops for every head (a dozen ops per
    tile whatever its size, each a parallel region that waits for every thread, which a
    busy machine stretches), and for as many elements as fit in 1 / RUN of that budget
    (at least one); else (0 elements) row chunks of one head within `budget`."""
    H = r.shape[1]
    fold = max(budget, FOLD * min(budget, settings.get().chunk_bytes)) if r.complete else budget
    whole = tile.chunk_rows(H, m, r.dtype, budget=fold) >= n
    cap = min(budget, settings.get().chunk_bytes)  # (elements within 1 / RUN of it)
    elements = tile.chunk_rows(H * n, m, r.dtype, copies=RUN, budget=cap) if whole else 0
    return elements, n if elements else tile.chunk_rows(1, m, r.dtype, budget=budget)


def _spans(r: Rows) -> list[tuple[tuple[int, int], slice]]:
    """((first, stop) of the rows, keys) of each selected batch element's tiles: every
    selected row, or the element's real rows (`Rows.real`, where the selection holds
    every row); its key span where the selection holds complete rows and the span
    leaves keys out, else ALL."""
    _, _, n, m = r.shape
    every = r.real is None or not (isinstance(r.rows, slice) and r.rows == ALL)
    rows = [(0, n)] * len(r.batch) if every else [r.real[b] for b in r.batch]
    if r.spans is None or not r.complete:
        return [(at, ALL) for at in rows]
    return [
        (at, ALL if hi - lo == m else slice(lo, hi))
        for at, (lo, hi, _) in zip(rows, (r.spans[b] for b in r.batch), strict=True)
    ]


# Consecutive batch elements that read alike share a tile within 1 / RUN of the budget
# (1 MiB at the default chunk_bytes): a batch of short rows then costs a few tiles' ops,
# not a dozen ops per element, while the tile's buffers stay in cache. Measured, a KL
# read's forward and backward, two threads, quiet, one tile per element against runs:
# (64, 12, 64, 64) 71.9 ms against 55.2 ms, (128, 12, 32, 32) 28.1 against 25.0,
# (32, 12, 128, 128) 81.4 against 81.4; runs in 4 MiB tiles were slower
# (16, 12, 128, 128) 46.2 against 49.2 ms, and in the 16 MiB of FOLD x the budget
# (8, 8, 256, 256) 54 against 85 ms: the score product of a tile past the cache ran
# 1.8x slower per byte.
RUN = 4


def _alike(r: Rows, a: int, b: int) -> bool:
    """Whether batch elements a and b (of B) read alike on a tile of both: the same key
    span and declared live rows (is_open, the mask's window)."""
    return (r.spans is None or r.spans[a] == r.spans[b]) and (
        r.live is None or r.live[a] == r.live[b]
    )


def tiles(r: Rows, budget: int) -> Iterator[Tile]:
    """Tiles of at most `budget` bytes of weights (`_step`): consecutive batch elements
    that read the same rows and keys, whole (all selected heads and rows), as many as
    fit; else row chunks of one head of one element; over each element's key span
    (`Rows.spans`) where the selection holds complete rows."""
    m = r.shape[3]
    L = r.inputs.query.shape[2]
    per_head = [(j, range(h, h + 1)) for j, h in enumerate(r.heads)]
    folded = None
    batch, spans = r.batch, _spans(r)
    at = 0
    while at < len(batch):
        (first, stop), keys = spans[at]
        nb = 1
        if stop <= first:  # (no live row: nothing to compute)
            at += 1
            continue
        elements, step = _step(r, stop - first, _count(keys, m), budget)
        if elements:
            folded = _head_blocks(r) if folded is None else folded
            while (
                nb < elements and at + nb < len(batch) and batch.step > 0
                and spans[at + nb] == spans[at] and _alike(r, batch[at], batch[at + nb])
            ):  # fmt: skip
                nb += 1
        b0 = batch[at]
        at_b, b = slice(at, at + nb), slice(b0, b0 + nb * batch.step, batch.step)
        for j, heads in folded if elements else per_head:
            for r0 in range(first, stop, step):
                r1 = min(stop, r0 + step)
                yield Tile(
                    at_b, b, slice(j, j + len(heads)), heads, slice(r0, r1),
                    _sub_rows(r.rows, L, r0, r1), keys,
                )  # fmt: skip
        at += nb


def _heads_slice(heads: range) -> slice:
    return slice(heads.start, heads.stop, heads.step)


def operands(r: Rows, t: Tile):
    """(q (nb, h, rows, E), k (nb, hkv, keys, E), lse (nb, h, rows), sinks (nb, h,
    rows|1) or None, window (nb|1, h|1, rows, keys) or None) of one tile."""
    i = r.inputs
    g = i.group
    hs = _heads_slice(t.heads)
    q = tile.cut(i.query[t.b, hs], 2, t.q_rows)
    kv0 = t.heads.start // g
    kv1 = kv0 + 1 if len(t.heads) == 1 else t.heads.stop // g
    keys = r.keys if t.keys == ALL else t.keys
    k = tile.cut(i.key[t.b, kv0:kv1], 2, keys)
    lse = tile.cut(r.lse[t.b, hs], 2, t.q_rows)
    sinks = _sinks_cut(i.sinks, t.b, hs, t.q_rows)
    if is_open(r, t):  # the mask is all True over the tile's keys
        return q, k, lse, sinks, None
    L, S = i.query.shape[2], i.key.shape[2]
    tensor, structured = masks.split(i.mask)
    if tensor is not None:
        tensor = tensor[t.b] if tensor.shape[0] > 1 else tensor
        tensor = tensor[:, hs] if tensor.shape[1] > 1 else tensor
    window = tile.window(tensor, L, S, t.q_rows, keys, q.device)
    if structured is not None:
        keep = tile.window(structured, L, S, t.q_rows, keys, q.device)  # (Bm, 1, rows, keys)
        window = masks.combine(window, keep[t.b] if keep.shape[0] > 1 else keep)
    return q, k, lse, sinks, window


def _shifted(
    r: Rows, t: Tile, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(shifted scores s - c of a tile (nb, h, rows, keys) written into `out` when given,
    the shift c (nb, h, rows, 1), the tile's sinks or None). c is the LSE, or the row max
    for complete rows whose LSE has lost digits (_inexact)."""
    q, k, lse, sinks, window = operands(r, t)
    scoring = tile.Scoring.of(r.inputs)
    if r.complete and _inexact(lse):  # the row max: the scores first
        s = tile.exclude(tile.scores(q, k, scoring, out=out), window)
        return (*tile.shift(s, lse, exact=True), sinks)
    shifted = tile.scores(q, k, scoring, out=out, minus=lse)  # s - lse in the product
    return tile.exclude(shifted, window), lse[..., None], sinks


def weights(
    r: Rows, t: Tile, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """p of a tile, (nb, h, rows, keys), written into `out` when given: rows normalised by
    their own sum where the selection holds every key (on CPU without sinks: torch's
    softmax of the scores, computed into `scratch`, a buffer of the tile's shape), else
    exp(s - lse)."""
    if r.complete and scratch is not None and r.inputs.sinks is None and r.device.type == "cpu":
        q, k, _, _, window = operands(r, t)
        s = tile.exclude(tile.scores(q, k, tile.Scoring.of(r.inputs), out=scratch), window)
        return tile.finish(s, lse=False, every_row_sees_a_key=window is None, out=out)[0]
    shifted, c, sinks = _shifted(r, t, out)
    if not r.complete:
        return tile.rebuild(shifted)  # exp(s - lse): the product subtracted the LSE
    e, total = tile.exponentiate(shifted, c, sinks)
    return e.div_(total)


def _inexact(lse: torch.Tensor) -> bool:
    """Whether complete rows with this LSE take the row max as their shift (|lse| past
    the settings' exact_lse_limit: its float32 value has lost digits). On CPU read from
    the LSE (one host read per tile, which pays: the folded product saves a pass over
    the tile); off CPU every tile does, decided without reading the device (no sync)."""
    if not lse.is_cpu:
        return True
    return bool((lse.abs() > settings.get().exact_lse_limit).any())


def needs_every_key(lse: torch.Tensor) -> bool:
    """Whether a selection of keys of rows with this LSE is read from their whole rows
    (see _inexact: a selection of keys cannot normalise them). On CPU read from the
    LSE. Off CPU never (reading the LSE would sync the host, and whole rows of a key
    column are L x S): there a selection of keys is exp(s - lse), within eps * |lse|
    of each weight (rows with |lse| past exact_lse_limit lose those digits; read their
    rows whole, w[..., i, :], to have them normalised exactly)."""
    if not lse.is_cpu:
        return False
    return bool((lse.abs() > settings.get().exact_lse_limit).any())


class Scratch:
    """One reusable buffer for a read's tiles or pieces (fresh pages fault on every
    allocation) of the selection r: `of(t)` views it as tile t's weights (nb, h, rows,
    keys), grown where t needs more than it holds. `for_tiles` sizes it once for the
    largest tile of `tiles(r, budget)`."""

    def __init__(self, r: Rows, size: int = 0):
        self.r = r
        self.t = torch.empty(size, dtype=r.dtype, device=r.device)

    @classmethod
    def for_tiles(cls, r: Rows, budget: int) -> Scratch:
        return cls(r, max((_size(r, t) for t in tiles(r, budget)), default=0))

    def of(self, t: Tile) -> torch.Tensor:
        shape = (t.nb, len(t.heads), t.at_r.stop - t.at_r.start, width(self.r, t))
        size = math.prod(shape)
        if self.t.numel() < size:
            self.t = torch.empty(size, dtype=self.t.dtype, device=self.t.device)
        return self.t[:size].view(shape)


def _size(r: Rows, t: Tile) -> int:
    """Entries of tile t's weights."""
    return t.nb * len(t.heads) * (t.at_r.stop - t.at_r.start) * width(r, t)


# Single-pass statistics over long rows take tiles of at least this many rows, within
# STRETCH times chunk_bytes: each tile costs a dozen ops whatever its size, and a GEMM of
# 64 rows runs far below one of 256. Measured at (1, 4, 16384, 32) fp32, two threads,
# against the fused forward: 4 MiB tiles (64 rows) read entropy at 1.65x, sum 1.41x and
# top-8 2.05x; 16 MiB (256 rows) 1.47x, 1.11x and 1.50x; at (1, 4, 4096, 32) 4 MiB is
# 256 rows already.
STAT_ROWS, STRETCH = 256, 4
# The heads of a batch element's complete rows fold into one tile within FOLD times
# chunk_bytes (_step): an 8 x 512 distillation step made 66,099 aten ops with per-head
# tiles, 26,095 with FOLD 4 (45,763 with 2). Selections of keys do not fold: a 16384-key
# read of 50 key columns of three heads went past 64 MiB of peak memory with them.
FOLD = 4


def stat_budget(r: Rows) -> int:
    """Bytes of one tile buffer for a single-pass statistic of the selection (sum over
    queries, entropy, top-k, amax, u @ w, max logits: the forward of a read, none of
    its backward): the settings' chunk_bytes, raised to hold STAT_ROWS rows of one head
    where the rows are long, at most STRETCH x chunk_bytes. A read's backward and the
    two-sided reads keep chunk_bytes."""
    budget = settings.get().chunk_bytes
    row = r.shape[3] * (torch.finfo(r.dtype).bits // 8)  # one head's row, bytes
    return min(STRETCH * budget, max(budget, STAT_ROWS * row))


# The entropy of rows whose LSE is exact (`_inexact` false) takes its tiles in blocks of
# keys: the LSE is every block's shift, so a row's two sums (its total and sum e t) add
# up across blocks and the row is still normalised by its own total at the end, while a
# block's scores, exponentials and sums stay in the cache between its passes, where a
# whole row of 16384 keys goes through memory on each. Row tiles of up to BLOCK_ROWS
# rows (of one head; a product of many rows runs far faster than one of few), blocks of
# at most chunk_bytes. Measured at (1, 4, 16384, 32) fp32, two threads, against the
# fused forward: blocks of 256 rows x 1024 keys 0.96x, 1024 x 1024 0.74x, 2048 x 512
# 0.70x (medians of 4); whole rows, 256 at a time, 1.6x. The attention received takes
# the same blocks, each exp(s - lse) summed over its rows, as a read of chosen keys is
# (a block cannot divide its rows by their totals): 0.77x the forward against 1.15x in
# whole rows of 256 (interleaved, medians of 4).
BLOCK_ROWS = 2048


def block_budget(r: Rows) -> int:
    """Bytes of the row tiles of a blocked statistic (`pieces`): BLOCK_ROWS rows of one
    head, every key (no buffer of this size is made: its pieces are)."""
    return max(stat_budget(r), BLOCK_ROWS * r.shape[3] * (torch.finfo(r.dtype).bits // 8))


def pieces(r: Rows, t: Tile) -> list[Tile]:
    """The pieces of tile t of complete rows (of `tiles(r, block_budget(r))`) that a
    single-pass statistic computes, in one of two ways: where its rows' LSE is exact
    (on CPU, every |lse| within exact_lse_limit), blocks of its keys of at most
    chunk_bytes of weights, in key order, shifted by the LSE; else chunks of its rows
    within stat_budget, every key, shifted by their max (_shifted)."""
    h, n, m = t.nb * len(t.heads), t.at_r.stop - t.at_r.start, width(r, t)
    per = tile.chunk_rows(h, n, r.dtype)  # keys of h x n rows (rows of h x n keys)
    if per >= m:  # (then the tile is within chunk_bytes)
        return [t]
    lse = tile.cut(r.lse[t.b, _heads_slice(t.heads)], 2, t.q_rows)
    if _inexact(lse):
        step = max(1, tile.chunk_rows(h, m, r.dtype, budget=stat_budget(r)))
        L = r.inputs.query.shape[2]
        return [
            t._replace(at_r=slice(t.at_r.start + i, t.at_r.start + j),
                       q_rows=_sub_rows(t.q_rows, L, i, j))
            for i, j in ((i, min(n, i + step)) for i in range(0, n, step))
        ]  # fmt: skip
    lo = 0 if t.keys == ALL else t.keys.start
    return [t._replace(keys=slice(k0, min(lo + m, k0 + per))) for k0 in range(lo, lo + m, per)]


def results(r: Rows, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A reader's output over the selection's rows: uninitialised where every row is
    computed, zeros where rows may be left out (Rows.real: they read as 0)."""
    new = torch.empty if r.real is None and r.live is None else torch.zeros
    return new(shape, dtype=r.dtype if dtype is None else dtype, device=r.device)


class Source:
    """The complete rows (every key) of a selection's tiles, one tile at a time, into
    buffers this source keeps (fresh pages fault on every allocation; a tile's results
    live until the next tile): `source.tile(t)` for t of `tiles(r, budget)`. both: its
    readers read p and logp of each tile; else one of them, which may then be computed
    in place of the scores."""

    def __init__(self, r: Rows, budget: int, both: bool = True):
        self.r, self.budget, self.both = r._replace(keys=ALL), budget, both
        self.scoring = tile.Scoring.of(r.inputs)
        # on CPU without sinks, torch's row-wise softmax and log_softmax of the scores
        self.lean = r.inputs.sinks is None and r.device.type == "cpu"
        # no mask: every row sees a key (known from the type), so nothing to repair and
        # the scores may be overwritten
        self.in_place = self.lean and r.inputs.mask is None
        self._buffers: dict[str, Scratch] = {}

    def buffer(self, name: str, t: Tile) -> torch.Tensor:
        """The buffer `name`, viewed as tile t's (nb, h, rows, S')."""
        if name not in self._buffers:
            self._buffers[name] = Scratch.for_tiles(self.r, self.budget)
        return self._buffers[name].of(t)

    def tile(self, t: Tile) -> TileRows:
        return TileRows(self, t)


class TileRows:
    """One tile of a Source: `where` (the Tile), q (nb, h, rows, E) and k (nb, hkv, S', E)
    (S' keys: the tile's, where.keys),
    `raw` the scores before the mask (softcap applied; (nb, h, rows, S')), the weights
    `p` and log-weights `logp` (nb, h, rows, S'), each computed when first read (rows
    normalised by their own sum, -inf log where a key is excluded), and the sink's share
    `p_sink` (nb, h, rows) or None. A reader may consume p or logp in place once it no
    longer needs them. A NaN row is NaN at every key (whole_rows)."""

    whole_rows = True

    def __init__(self, source: Source, t: Tile):
        r = source.r
        self.where, self._source = t, source
        # every row sees a key and the scores may be overwritten: no mask, or none here
        self._clear = source.lean and (source.in_place or is_open(r, t))
        self.q, self.k, lse, sinks, window = operands(r, t)
        self.S = r.inputs.key.shape[2]  # (every key of the call; k holds the tile's)
        self.raw = tile.scores(self.q, self.k, source.scoring, out=source.buffer("scores", t))
        capped = source.scoring.softcap is not None  # raw_grad reads the capped scores
        s = tile.exclude(self.raw.clone() if capped else self.raw, window)
        self._p = self._logp = None
        self.p_sink = None
        if source.lean:
            self._s = s
            return
        shifted, c = tile.shift(s, lse, exact=True)
        e, total = tile.exponentiate(shifted, c, sinks, keep=True, out=source.buffer("p", t))
        self._p = e.div_(total)
        self._shifted, self._total = shifted, total
        self.p_sink = tile.sink_weight(sinks, c, total)

    @property
    def scores(self) -> torch.Tensor:
        """The tile's scores after the mask, up to a shift per row (in the order of the
        weights), until p or logp is computed over them."""
        s = self._s if self._source.lean else self._shifted
        if s is None:
            raise RuntimeError("the scores of a Source tile were read after p over them")
        return s

    def _into(self, name: str) -> torch.Tensor:
        """Where the lean path writes p or logp: over the scores where the source allows
        it and this is the tile's last read of them, else the buffer `name`."""
        src = self._source
        last = not src.both or name == "logp"
        if self._clear and last:
            if self._s is None:
                raise RuntimeError("a Source made for one read was read twice (both=False)")
            out, self._s = self._s, None
            return out
        return src.buffer(name, self.where)

    @property
    def p(self) -> torch.Tensor:
        if self._p is None:
            s = self._s
            every = self._clear
            self._p = tile.finish(s, lse=False, every_row_sees_a_key=every, out=self._into("p"))[0]
        return self._p

    @property
    def logp(self) -> torch.Tensor:
        if self._logp is None:
            if not self._source.lean:
                self._logp = tile.log_weights(self._shifted, self._total)
                return self._logp
            if self._source.both:
                self.p  # noqa: B018 (p first: logp may then overwrite the scores)
            s, every = self._s, self._clear
            out = self._into("logp")
            self._logp = tile.finish(s, lse=False, log=True, every_row_sees_a_key=every, out=out)[0]
        return self._logp


class DenseSource:
    """A dense target (B|1, Hq|1, L, S) read as a Source: its tiles' p is the target's
    slice, logp its log."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def tile(self, t: Tile) -> DenseTile:
        hs = _heads_slice(t.heads)
        target = tile.cut(self.target[t.b, hs], 2, t.q_rows)
        return DenseTile(t, target if t.keys == ALL else target[..., t.keys])


class DenseTile(NamedTuple):
    where: Tile
    p: torch.Tensor
    whole_rows = False  # (a NaN may sit at any one key)

    @property
    def logp(self) -> torch.Tensor:
        return torch.log(self.p)


def each(r: Rows, both: bool = False, budget: int | None = None) -> Iterator[TileRows]:
    """The tiles of a selection of complete rows, `tiles(r, budget)` (default the
    settings' chunk_bytes) read through one Source (its buffers reused); both: the
    reader reads p and logp. The statistics and the reads' backward iterate this."""
    if empty(*r.shape):
        return
    budget = settings.get().chunk_bytes if budget is None else budget
    source = Source(r, budget, both)
    for t in tiles(r, budget):
        yield source.tile(t)


@_eager
def dense(r: Rows) -> torch.Tensor:
    """The weights of the selection, (B', H', n, m)."""
    if empty(*r.shape):
        return torch.zeros(r.shape, dtype=r.dtype, device=r.device)
    skips = (r.spans is not None and r.complete) or r.real is not None or r.live is not None
    out = (torch.zeros if skips else torch.empty)(r.shape, dtype=r.dtype, device=r.device)
    budget = settings.get().chunk_bytes
    buffer = Scratch.for_tiles(r, budget) if r.complete else None
    for t in tiles(r, budget):
        into = out[t.at_b, t.at_h, t.at_r]
        scr = None if buffer is None else buffer.of(t)
        if t.keys == ALL and into.is_contiguous():
            weights(r, t, into, scr)
        else:  # (the tile rule writes its out= buffers as contiguous ones; a key span
            # or some rows of several heads are not)
            into[..., t.keys] = weights(r, t, None, scr)
    return out


@_eager
def key_sums(r: Rows) -> torch.Tensor:
    """Sum over the selection's rows (all keys): the attention each key receives,
    (B', H', S), the pieces' partial sums added in float64 on CPU. One pass over each
    piece (`pieces`): a block of keys of rows whose LSE is exact is exp(s - lse) summed
    over its rows (a selection of keys: its rows are not divided by their own total,
    which a block cannot know); whole rows are normalised by their own sum."""
    B, H, _, m = r.shape
    wide = torch.float64 if r.device.type == "cpu" else r.dtype  # pieces' partial sums
    out = torch.zeros(B, H, m, dtype=wide, device=r.device)
    if empty(*r.shape):
        return out.to(r.dtype)
    r = r._replace(keys=ALL)
    scores = Scratch(r)
    for t in tiles(r, block_budget(r)):
        for piece in pieces(r, t):
            shifted, c, sinks = _shifted(r, piece, scores.of(piece))
            if piece.keys == t.keys:  # whole rows
                e, total = tile.exponentiate(shifted, c, sinks)
                p = e.div_(total)
            else:
                p = tile.rebuild(shifted)  # exp(s - lse): the product subtracted the LSE
            out[t.at_b, t.at_h, piece.keys] += p.sum(dim=-2)
    return out.to(r.dtype)


@_eager
def entropy(r: Rows, excluded: bool | None = None) -> torch.Tensor:
    """-sum_j p_ij ln p_ij per row, (B', H', n), in nats; 0 for rows that see no key. One
    pass over each piece (`pieces`): the scores shifted by the LSE in the product (or by
    the row max where it lost digits), their exponentials and two row sums, added up
    over a row's blocks of keys; the entropy of every row then at once
    (tile.entropy_of). excluded: whether a score may be -inf (default: with a mask, or
    off CPU); on CPU without a mask a -inf score (from an infinite q or k) shows as a
    NaN entropy, and the read is made again with excluded=True (one host read; a NaN
    row, NaN either way, costs that second read too)."""
    B, H, n, _ = r.shape
    if empty(*r.shape):
        return torch.zeros(B, H, n, dtype=r.dtype, device=r.device)
    check = excluded is None and r.device.type == "cpu" and r.inputs.mask is None
    if excluded is None:
        excluded = not check
    r = r._replace(keys=ALL)
    scores, exps = Scratch(r), Scratch(r)
    sums = torch.zeros(3, B, H, n, 1, dtype=r.dtype, device=r.device)  # sum e, sum e t, c
    for t in tiles(r, block_budget(r)):
        for piece in pieces(r, t):
            at = (t.at_b, t.at_h, piece.at_r)
            shifted, sums[2][at], _ = _shifted(r, piece, scores.of(piece))
            e = tile.exp(shifted, out=exps.of(piece))
            sums[0][at] += e.sum(dim=-1, keepdim=True)
            sums[1][at] += tile.weighted_scores(e, shifted, excluded)
    total, p_sink = tile.settled(sums[0], sums[2], _all_sinks(r))
    h = tile.entropy_of(total, sums[1], p_sink)[..., 0]
    if check and bool(torch.isnan(h).any()):  # a -inf score (or a NaN row): with clamps
        return entropy(r, excluded=True)
    return h


def _all_sinks(r: Rows) -> torch.Tensor | None:
    """The sinks of the selection's rows, (B', H', n|1), or None."""
    return _sinks_cut(r.inputs.sinks, list(r.batch), _heads_slice(r.heads), r.rows)


def _sinks_cut(sinks: torch.Tensor | None, batch, heads: slice, rows) -> torch.Tensor | None:
    """The sinks (B, H, L|1) of some batch elements, heads and query rows, detached (the
    sinks' own gradient is taken apart), or None."""
    if sinks is None:
        return None
    sinks = sinks.detach()[batch][:, heads]
    return sinks if sinks.shape[-1] == 1 else tile.cut(sinks, 2, rows)


@_eager
def topk(r: Rows, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest weights of each row and their key indices, each (B', H', n, k): the
    top k of each tile's shifted scores (tile.top_keys; torch.topk under a mask, whose
    -inf keys tie), then the tile's exponentials in place for the rows' normaliser, the
    k weights exp(t) / T of the row (normalised by its own sum, as p is)."""
    B, H, n, m = r.shape
    values = results(r, B, H, n, k)
    indices = results(r, B, H, n, k, dtype=torch.long)
    if empty(*r.shape):
        return values, indices
    if r.real is not None or r.live is not None:  # a row left out: weights all 0, whose
        # top k torch.topk picks among ties, as it does on the dense row
        indices[:] = torch.full((m,), -torch.inf, device=r.device).topk(k).indices
    r = r._replace(keys=ALL)
    if r.spans is not None and any(hi - lo < k for lo, hi, _ in r.spans):
        r = r._replace(spans=None)  # (k past a span: the padded keys' ties, as torch.topk's)
    budget = stat_budget(r)
    buffer = Scratch.for_tiles(r, budget)
    ties = r.inputs.mask is not None  # (a mask's -inf keys tie: torch.topk's choice)
    for t in tiles(r, budget):
        at = (t.at_b, t.at_h, t.at_r)
        shifted, c, sinks = _shifted(r, t, buffer.of(t))
        top, found = shifted.topk(k, dim=-1) if ties else tile.top_keys(shifted, k)
        indices[at] = found if t.keys == ALL else found.add_(t.keys.start)
        total = tile.exponentiate(shifted, c, sinks)[1]  # (in place: the scores are spent)
        values[at] = top.exp_().div_(total)
    return values, indices


@_eager
def amax(r: Rows) -> torch.Tensor:
    """Each row's largest weight, (B', H', n)."""
    B, H, n, _ = r.shape
    out = results(r, B, H, n)
    for tr in each(r, budget=stat_budget(r)):
        t = tr.where
        out[t.at_b, t.at_h, t.at_r] = tr.p.amax(dim=-1)
    return out


@_eager
def kl(r: Rows, other: Callable[[int, bool], Source | DenseSource], reverse: bool) -> torch.Tensor:
    """KL(Q || P) per row, (B', H', n), P the weights of `r` (every key), Q those of a
    fresh source other(budget, both) on the same tiles; with reverse, KL(P || Q). A key where the
    first argument is 0 adds 0; where only the second is, +inf."""
    B, H, n, _ = r.shape
    out = results(r, B, H, n)
    budget = settings.get().chunk_bytes
    mine, theirs = Source(r, budget, both=reverse), other(budget, not reverse)
    for t in tiles(r, budget):
        a, b = mine.tile(t), theirs.tile(t)
        first, second = (a, b) if reverse else (b, a)
        whole = first.whole_rows and second.whole_rows
        value = tile.kl_of(first.logp, second.logp, first.p, whole_rows=whole)
        out[t.at_b, t.at_h, t.at_r] = value
    return out


@_eager
def weighted_rows(r: Rows, u: torch.Tensor) -> torch.Tensor:
    """u^T P over the rows: u (B', H', F, n) -> (B', H', F, S), one tile at a time."""
    B, H, _, m = r.shape
    F = u.shape[2]
    out = torch.zeros(B, H, F, m, dtype=r.dtype, device=r.device)
    for tr in each(r, budget=stat_budget(r)):
        t = tr.where
        ut = u[t.at_b, t.at_h][..., t.at_r].to(r.dtype)  # (nb, h, F, rows)
        out[t.at_b, t.at_h, :, t.keys] += torch.matmul(ut, tr.p)  # p (nb, h, rows, S')
    return out


@_eager
def weighted_rows_grad(r: Rows, g: torch.Tensor) -> torch.Tensor:
    """d(u^T P)/du given the upstream g (B', H', F, S): g P^T, (B', H', F, n)."""
    B, H, n, _ = r.shape
    out = results(r, B, H, g.shape[2], n)
    for tr in each(r):
        t = tr.where
        gt = g[t.at_b, t.at_h, :, t.keys].to(r.dtype)  # (nb, h, F, S)
        out[t.at_b, t.at_h, :, t.at_r] = torch.matmul(gt, tr.p.mT)
    return out


@_eager
def max_logits(r: Rows) -> torch.Tensor:
    """Each row's largest raw score (scale and float mask, no softcap), (B', H', n):
    -inf where a row sees no key."""
    B, H, n, _ = r.shape
    out = results(r, B, H, n)
    raw = tile.Scoring(r.inputs.scale)  # before the softcap
    for t in tiles(r, stat_budget(r)):
        out[t.at_b, t.at_h, t.at_r] = masked_scores(r, t, raw).amax(dim=-1)
    return out


def masked_scores(r: Rows, t: Tile, scoring: tile.Scoring | None = None) -> torch.Tensor:
    """Tile t's scores after the mask, (nb, h, rows, keys): the tile rule's scores (the
    call's scale and softcap unless `scoring` says otherwise), -inf where the mask
    excludes a key, a float mask added. A fresh tensor."""
    q, k, _, _, window = operands(r, t)
    scoring = tile.Scoring.of(r.inputs) if scoring is None else scoring
    return tile.exclude(tile.scores(q, k, scoring), window)


def visible_scores(r: Rows, t: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, excluded) of tile t: its masked scores with 0 where the mask excludes a
    key (the pre-softmax scores as distillation compares them: TinyBERT's), and where
    that is (bool, (nb, h, rows, keys))."""
    s = masked_scores(r, t)
    excluded = s == -torch.inf
    return s.masked_fill_(excluded, 0.0), excluded


@_eager
def score_errors(r: Rows, other: Rows) -> torch.Tensor:
    """sum_j (s_ij - s'_ij)^2 per row, (B', H', n): s and s' the visible scores of the
    selection and of `other` (another call's rows of the same shape), tile by tile."""
    B, H, n, _ = r.shape
    out = torch.zeros(B, H, n, dtype=r.dtype, device=r.device)
    if empty(*r.shape):
        return out
    for t in tiles(r, settings.get().chunk_bytes):
        d = visible_scores(r, t)[0].sub_(visible_scores(other, t)[0].to(r.dtype))
        out[t.at_b, t.at_h, t.at_r] = d.square_().sum(dim=-1)
    return out


@_eager
def pairs(inputs: Inputs, lse: torch.Tensor, qi: torch.Tensor, kj: torch.Tensor) -> torch.Tensor:
    """The weights at P (query, key) pairs, (B, Hq, P): qi, kj (1|B, P) positions among
    the L queries and S keys, p = exp(s - lse) (a pair is a selection of one key)."""
    q, k = inputs.query, inputs.key
    B, H, L, E = q.shape
    Hkv, S, P = k.shape[1], k.shape[2], qi.shape[-1]
    q = q.gather(2, qi[:, None, :, None].expand(B, H, P, E))  # (B, H, P, E)
    k = k.gather(2, kj[:, None, :, None].expand(B, Hkv, P, E))  # (B, Hkv, P, E)
    s = tile.pair_scores(q, k, tile.Scoring.of(inputs))  # (B, H, P)
    s = tile.exclude(s, tile.window_pairs(inputs.mask, L, S, qi, kj))
    lse = lse.gather(2, qi[:, None].expand(B, H, P))  # (B, H, P)
    return tile.rebuild(s[..., None], lse)[..., 0]
