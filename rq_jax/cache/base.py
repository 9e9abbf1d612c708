"""The cache-format protocol, its one state layout, the format registry, and exact softmax partials.

Every format follows one dataflow: while a call's tokens run their loops, their K/V
stay full precision ("in flight"); each attention reads the stored past through `attend` and its own
tokens densely, and the two softmax partials are merged exactly. After the last loop, `write` encodes
the K/V of all loops at once. Prefill (T = prompt length), decode (T = 1) and a second prompt turn are
the same code path, and the current token is never read back from compressed storage.

Shapes: B batch · T new tokens · S cache length · L loops · N layers · H query heads · K kv heads ·
D head dim · G loop groups · p loops in a group.

The state layout, the same for every format. A format stores its loops in consecutive *groups* of
`group_len` loops (ResidualQuant: `len(bits)`, anchored on the group's last loop; the others: 1). A
stack of L loops is a tuple of *segments* (`segments`): G groups of the same size p — all the full
groups, then one shorter group when L is not a multiple of `group_len`. A segment's state is a tuple
over the p positions of a group of the format's slot pytree, every leaf laid out

    [G, N, B, K, S, ...]        token axis 4 (`TOKEN_AXIS`)

so the model scans over groups and layers and indexes a slot with `(group, layer)` (`Index`).
A format's calibration for a segment is a pytree with the same leading [G, N] axes (or None).

A paged cache holds the same leaves as a pool of pages, [G, N, NP, K, P, ...] (NP pages of P tokens; a
format's `init` with batch NP and max_len P), and a block table [B, N'] (int32) naming the page of each
row's logical page: row b's position s lies at offset s mod P of page table[b, s // P]. Every format's
`attend` and `write` take the table (None: the contiguous layout); attention then reads a row one page per
tile (`slot_tile`) and the write stores a row page by page (`scatter_tokens`).

Attention to the stored past is tiled (`tiled_partial`): a loop over static-size context tiles that
skips every tile past max(lengths), each tile read straight out of the stacked state (`slot_tile`),
decoded and folded into the running softmax `Partial` by the exact `merge`. Nothing of the cache's
length is ever decoded or scored at once, and a cache holding few tokens costs few tiles. The tile
(`context_tile`) holds a fixed number of float32 elements whatever the batch, so the temporaries of a
step are bounded by a constant, not by the context or the batch.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

import cpu_kernels
from pallas_kernels import tpu_write

from rq_jax.shapes import (Attended, GroupedQueries, HeadStats, Lengths, LoopKV, NumNew, PastMask, Queries,
                           Scores, SegmentKV, SegmentPast, SlotKV, Visible)


_NEG = -1e30  # finite "minus infinity": fully masked rows keep m finite and l = 0, never NaN.
TOKEN_AXIS = 4  # of every state leaf: [G, N, B, K, S, ...]
#: Float32 elements of one context tile's largest decoded operand (K or V [B, K, tile, D], or the scores
#: [B, T, H, tile]): 2**21 (8 MiB). Attention keeps a handful of such operands alive, so a step's
#: attention temporaries stay near 50 MiB at any batch and context; the tile is also ≥ `MIN_TILE`
#: tokens, so that a loop iteration does enough work to hide its overhead on a CPU (about 10 µs).
TILE_ELEMENTS = 2**21
MIN_TILE = 16
Index = tuple[int | Int[Array, ""], int | Int[Array, ""]]  # (group, layer) of a slot in a segment: ints or traced


class Segment(NamedTuple):
    """`groups` consecutive loop groups of `size` loops each, the first starting at loop `start`."""

    start: int
    groups: int
    size: int

    @property
    def num_loops(self) -> int:
        """Loops the segment covers, G·p."""
        return self.groups * self.size


def segments(num_loops: int, group_len: int) -> tuple[Segment, ...]:
    """The segments of `num_loops` loops in groups of `group_len`: the full groups, then the rest."""
    full, rest = divmod(num_loops, group_len)
    out = (Segment(0, full, group_len),) if full else ()
    return out + ((Segment(full * group_len, 1, rest),) if rest else ())


def split_loops(x: Array, seg: Segment) -> Array:
    """The segment's loops of a per-loop stack [L, ...], grouped: [G, p, ...]."""
    return x[seg.start : seg.start + seg.num_loops].reshape(seg.groups, seg.size, *x.shape[1:])


def at(tree: Any, index: Index) -> Any:
    """Every leaf of a [G, N, ...] stack (state or calibration) at slot `index`: [...]."""
    return jax.tree_util.tree_map(lambda x: x[index], tree)


class Partial(NamedTuple):
    """Unnormalised softmax-attention partial over a subset of keys.

    acc: [B, T, H, D] float32, Σ_s exp(score_s − m)·v_s.  m: [B, T, H] running max.  l: [B, T, H] Σ exp.
    """

    acc: Attended
    m: HeadStats
    l: HeadStats


def merge(a: Partial, b: Partial) -> Partial:
    """Exact log-sum-exp merge of two partials over disjoint key sets."""
    m = jnp.maximum(a.m, b.m)
    wa, wb = jnp.exp(a.m - m), jnp.exp(b.m - m)
    return Partial(a.acc * wa[..., None] + b.acc * wb[..., None], m, a.l * wa + b.l * wb)


def finalize(p: Partial) -> Attended:
    """Normalise a partial into attention output [B, T, H, D]; rows that saw no key give 0."""
    l = p.l[..., None]
    return jnp.where(l > 0, p.acc / jnp.where(l > 0, l, 1.0), 0.0)


def empty_partial(b: int, t: int, h: int, d: int) -> Partial:
    """The partial over no key: acc 0 [B, T, H, D], m = −∞ (finite), l = 0; `merge` leaves the other side
    unchanged."""
    return Partial(jnp.zeros((b, t, h, d), jnp.float32), jnp.full((b, t, h), _NEG, jnp.float32),
                   jnp.zeros((b, t, h), jnp.float32))


def softmax_partial(
    scores: Scores,
    mask: PastMask,
) -> tuple[Scores, HeadStats, HeadStats]:
    """Masked, max-shifted probabilities p = exp(s − m), with m and l = Σp, all float32 (float64 for
    float64 scores)."""
    mask = mask[:, :, None, :]
    scores = jnp.where(mask, scores.astype(jnp.promote_types(scores.dtype, jnp.float32)), _NEG)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(mask, jnp.exp(scores - m[..., None]), 0.0)
    return p, m, jnp.sum(p, axis=-1)


def group_queries(q: Queries, num_kv_heads: int) -> GroupedQueries:
    """Split H query heads into K groups of H // K sharing one kv head (GQA)."""
    b, t, h, d = q.shape
    return q.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def dense_partial(
    q: Queries,
    k: SlotKV,
    v: SlotKV,
    mask: PastMask,
) -> Partial:
    """Softmax partial of queries over explicit keys/values (GQA by head grouping), f32 accumulation
    (f64 for float64 queries: a float64 run stays float64).

    Scores are scaled by 1/sqrt(D). `mask[b, t, s]` says whether query t of row b may see key s.
    """
    b, t, h, d = q.shape
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
    qg = group_queries(q, k.shape[1])
    scores = jnp.einsum("btkgd,bksd->btkgs", qg, k, preferred_element_type=acc_dtype) * d**-0.5
    p, m, l = softmax_partial(scores.reshape(b, t, h, -1), mask)
    acc = jnp.einsum("btkgs,bksd->btkgd", p.reshape(b, t, k.shape[1], -1, p.shape[-1]), v.astype(acc_dtype))
    return Partial(acc.reshape(b, t, h, d), m, l)


def valid_tokens(lengths: Lengths, max_len: int) -> Visible:
    """Whether stored position s of row b holds a token: s < lengths[b]."""
    return jnp.arange(max_len)[None, :] < lengths[:, None]


def past_mask(lengths: Lengths, num_queries: int, max_len: int) -> PastMask:
    """Mask of stored positions s < lengths[b], the same for every query of the call."""
    valid = valid_tokens(lengths, max_len)
    return jnp.broadcast_to(valid[:, None, :], (lengths.shape[0], num_queries, max_len))


def context_tile(batch: int, num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_len: int) -> int:
    """Tokens per context tile: as many as keep a tile's decoded K or V [B, K, tile, D] and its scores
    [B, T, H, tile] within `TILE_ELEMENTS` float32 elements, a multiple of `MIN_TILE` and at least that;
    at most `max_len` (one tile then covers the whole cache)."""
    per_token = batch * max(num_kv_heads * head_dim, num_queries * num_heads)
    return min(max(TILE_ELEMENTS // per_token // MIN_TILE * MIN_TILE, MIN_TILE), max_len)


Table = Int[Array, "b pages"]  # a paged cache's block table: the pool page of each row's logical page


def tiling(leaf: Array, table: Table | None, batch: int, num_queries: int, num_heads: int,
           head_dim: int) -> tuple[int, int]:
    """(positions a row can hold, tokens per context tile) of a state leaf [G, N, B, K, S, ...]: S and
    `context_tile`'s, or for a paged pool [G, N, NP, K, P, ...] with `table` [B, N'], N'·P and one page."""
    if table is not None:
        return table.shape[1] * leaf.shape[TOKEN_AXIS], leaf.shape[TOKEN_AXIS]
    max_len = leaf.shape[TOKEN_AXIS]
    return max_len, context_tile(batch, num_queries, num_heads, leaf.shape[3], head_dim, max_len)


def slot_tile(tree: Any, index: Index, start: Int[Array, ""], size: int, table: Table | None = None) -> Any:
    """Tokens start .. start + size − 1 of slot `index` of every leaf [G, N, B, K, S, ...]: [B, K, size, ...].
    With `table` (a paged pool [G, N, NP, K, P, ...], size = P, start a multiple of P): each row's page
    table[b, start // P], gathered from the pool (entries past the pool are clipped into it: a tile's
    `valid` mask hides a page the row does not hold).

    The slice is taken on the leaves' bits (`bits_of`), behind an optimization barrier with `start`:
    XLA:CPU widens a bfloat16 or fp8 dynamic slice to float32, and inside a loop it would hoist that
    conversion of the whole stacked leaf out of the loop (a float32 copy of the cache); behind the
    barrier only the tile is converted. On the bits, a cache held as bits (`KVCache.as_bits`) is never
    made into a whole-leaf float array at all.
    """
    def one(x, start):
        if table is not None:
            pages = jnp.clip(table[:, start // size], 0, x.shape[2] - 1)
            return jnp.take(x[index[0], index[1]], pages, axis=0)
        at = (index[0], index[1], 0, 0, start) + (0,) * (x.ndim - 5)
        return jax.lax.dynamic_slice(x, at, (1, 1, *x.shape[2:4], size, *x.shape[5:]))[0, 0]

    return _read_on_bits(one, tree, start)


def slot_tokens(tree: Any, index: Index, positions: Int[Array, "m"]) -> Any:
    """Positions `positions` [M] (each inside the leaf) of slot `index` of every leaf [G, N, B, K, S, ...]:
    [B, K, M, ...]; on the bits behind the barrier of `slot_tile`, for the same reasons."""
    return _read_on_bits(lambda x, at: jnp.moveaxis(x[index[0], index[1], :, :, at], 0, 2), tree, positions)


def bits_of(x: Array) -> Array:
    """A floating array's bits as unsigned integers of its width (`jax.lax.bitcast_convert_type`); other
    arrays as they are."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def values_of(bits: Array, dtype) -> Array:
    """The inverse of `bits_of`: `bits` bitcast to `dtype` (as they are when already of it)."""
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def tree_bits(tree: Any) -> tuple[Any, Any]:
    """(every leaf of `tree` on its bits (`bits_of`), every leaf's dtype): `tree_values` undoes it."""
    return jax.tree_util.tree_map(bits_of, tree), jax.tree_util.tree_map(lambda x: x.dtype, tree)


def tree_values(bits: Any, dtypes: Any) -> Any:
    """The inverse of `tree_bits`: every leaf of `bits` back to its dtype in `dtypes` (`values_of`)."""
    return jax.tree_util.tree_map(values_of, bits, dtypes)


def _read_on_bits(read: Callable[[Array, Array], Array], tree: Any, where: Array) -> Any:
    """`read(leaf, where)` of every leaf of `tree`, run on its bits behind an optimization barrier with
    `where`, the result bitcast back to the leaf's dtype."""
    bits, dtypes = tree_bits(tree)
    bits, where = jax.lax.optimization_barrier((bits, where))
    return tree_values(jax.tree_util.tree_map(lambda b: read(b, where), bits), dtypes)


def tiled_partial(part: Callable[[Any, Int[Array, ""], Visible], Partial], stored: Any,
                  shape: tuple[int, int, int, int], lengths: Lengths, max_len: int, tile: int,
                  visible: Visible | None = None) -> Partial:
    """The partial over stored positions s < lengths[b] (and `visible[b, s]`), one context tile at a time.

    `part(stored, start, valid)` is the partial over positions start .. start + tile − 1 where `valid`
    [B, tile], its tile read out of `stored` (a pytree of the state leaves, e.g. through `slot_tile`);
    the tiles are merged in order by `merge`. `stored` enters the loop on its bits (`bits_of`) and is
    taken back to its dtypes inside each iteration, behind a barrier with the iteration's index: a
    conversion of a whole leaf that the loop does not change would otherwise be hoisted out of it and
    made (a copy of the cache), while inside, XLA folds it into the tile read's own (`slot_tile`).

    The loop has a static trip count, ⌈max_len / tile⌉ (so it can be differentiated), and skips
    (`lax.cond`) every tile at or past max(lengths): its cost follows the filled length, not `max_len`.
    The last tile of a cache that `tile` does not divide ends at max_len instead (`valid` hides the
    positions an earlier tile covered). shape: (B, T, H, D) of the output; needs tile ≤ max_len.
    """
    filled = jnp.max(lengths)
    bits, dtypes = tree_bits(stored)

    def body(acc, i):
        first = i * tile

        def fold(acc):
            start = jnp.minimum(first, max_len - tile)
            pos = start + jnp.arange(tile)
            valid = (pos >= first)[None, :] & (pos[None, :] < lengths[:, None])
            if visible is not None:
                valid = valid & jax.lax.dynamic_slice_in_dim(visible, start, tile, axis=1)
            held = jax.lax.optimization_barrier((bits, i))[0]
            return merge(acc, part(tree_values(held, dtypes), start, valid))

        return jax.lax.cond(first < filled, fold, lambda acc: acc, acc), None

    return jax.lax.scan(body, empty_partial(*shape), jnp.arange(-(-max_len // tile)))[0]


class Written(NamedTuple):
    """What `CacheFormat.write` returns: the new segment state, and per row the values it could not store
    faithfully (metadata outside its dtype's range, non-finite K/V), Int[b]."""

    state: tuple[Any, ...]
    out_of_range: Int[Array, "b"]


def nothing_lost(lengths: Lengths) -> Int[Array, "b"]:
    """`Written.out_of_range` of a format that stores every value it is given: zeros [B]."""
    return jnp.zeros_like(lengths)


class CacheFormat:
    """A KV storage format: a frozen, hashable policy object (a dataclass) whose methods are pure functions.

    This base class is the whole protocol: everything the rest of rq_jax asks a format, so that nothing
    outside `rq_jax.cache` tests a format's type, name or attributes. A format implements `init`,
    `write`, `reconstruct` and `bits_per_element`; the rest have defaults (attention through
    `reconstruct`, no calibration, no fake quantization, reads = stores). Its state follows this module's
    layout (a tuple over group positions of slot pytrees with leading [G, N]); `group_len` is its loops
    per group. `calib` is the format's static calibration (rotations, key means, codebooks) for one
    segment, passed alongside the cache and never stored in it: built once, outside jit, by
    `default_calib` (no data; raises ValueError when the format cannot run without data, `needs_data`)
    or fitted by `calibrate`. `needs_calib` says whether `attend`/`write`/`reconstruct` read one (None
    is accepted otherwise).

    A new format is one module subclassing this (as a frozen dataclass with `name`, `group_len`,
    `needs_calib`, `needs_data` fields) plus its registry line (`register`).
    """

    name: str
    group_len: int
    needs_calib: bool
    needs_data: bool
    #: The policy fields a calibration depends on, which an artifact records and checks (None: every
    #: dataclass field of the policy).
    schedule_fields: ClassVar[tuple[str, ...] | None] = None
    #: The kv-head axis of each calibration leaf, by leaf name (for sharding over kv heads); leaves not
    #: named are replicated.
    calib_head_axes: ClassVar[Mapping[str, int]] = MappingProxyType({})
    #: Whether the format stores K/V in a rotated basis whose rotations (and key means) `rq_jax.calibrate`
    #: can learn (OptR-H, OSCAR): its calibration is a `loop_quant.RotationCalib` (the `LoopQuant` family).
    learns_rotations: ClassVar[bool] = False
    #: Whether `write` counts values it could not store (`Written.out_of_range`); formats that store
    #: every value as given report zeros.
    reports_out_of_range: ClassVar[bool] = False
    #: Whether the format's state has one entry per stored position on every leaf's token axis, so that it can
    #: be held as a pool of pages (`kv.init_paged_cache`); kivi's per-row windows cannot, so its pages are
    #: whole rows (one page of max_len tokens per row).
    pageable: ClassVar[bool] = True
    #: What the format keeps in full precision before it quantizes anything, in a few words (kivi's window
    #: of recent tokens); "" for a format that quantizes every token it stores.
    full_precision_part: ClassVar[str] = ""

    # ---- storage ---------------------------------------------------------------------------------

    def init(self, seg: Segment, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int) -> tuple[Any, ...]:
        """An empty segment state: `seg.size` slot pytrees, leaves [G, N, B, K, S, ...]."""
        raise NotImplementedError

    def write(self, state: tuple[Any, ...], k: SegmentKV, v: SegmentKV, lengths: Lengths, num_new: NumNew,
              calib: Any, table: Table | None = None) -> Written:
        """Encode a segment's new tokens t < num_new[b] at positions lengths[b] + t (through the block table
        `table` of a paged cache): the new state and the values of those tokens it could not store
        faithfully, per row."""
        raise NotImplementedError

    def reconstruct(self, state: tuple[Any, ...], index: Index, loop: int, lengths: Lengths,
                    calib: Any) -> tuple[SlotKV, SlotKV]:
        """The stored K and V of a slot decoded to float32 (0 at s ≥ lengths[b]): the semantic reference."""
        raise NotImplementedError

    def attend(self, state: tuple[Any, ...], index: Index, loop: int, q: Queries,
               lengths: Lengths, calib: Any, visible: Visible | None = None, table: Table | None = None) -> Partial:
        """Partial attention to the stored tokens s < lengths[b] of slot `index`, group position `loop`,
        that `visible` [B, S] (None: all) shows, read through the block table `table` of a paged cache;
        equal to `reference_attend`. Default: `tiled_attend` (each context tile decoded by `reconstruct`,
        then dense attention), for a state whose every leaf has one entry per stored position on its token
        axis."""
        return tiled_attend(self, state, index, loop, q, lengths, calib, visible, table)

    # ---- calibration -----------------------------------------------------------------------------

    def default_calib(self, seg: Segment, num_layers: int, num_kv_heads: int, head_dim: int) -> Any:
        """The data-free calibration of a segment (leading [G, N]), or None when none is needed."""
        return None

    def calibrate(self, seg: Segment, k: SegmentPast, v: SegmentPast, lengths: Lengths) -> Any:
        """The calibration of a segment fitted on dense K/V (tokens s < lengths[b]); default: `default_calib`."""
        return self.default_calib(seg, k.shape[2], k.shape[4], k.shape[6])

    def calib_shapes(self, seg: Segment, num_layers: int, num_kv_heads: int, head_dim: int) -> Any:
        """Shapes (`jax.ShapeDtypeStruct`) of every leaf a calibration of this format may hold, optional
        ones included (a saved artifact is checked against them); None when the format reads none."""
        k = jax.ShapeDtypeStruct((seg.groups, seg.size, num_layers, 1, num_kv_heads, 1, head_dim), jnp.float32)
        return jax.eval_shape(lambda k: self.calibrate(seg, k, k, jnp.ones((1,), jnp.int32)), k)

    def schedule_name(self, num_loops: int) -> str:
        """The schedule a calibration is fitted for, as a folder name, e.g. "residual-b2.2.2.4-g32-L4"."""
        return f"{self.name}-L{num_loops}"

    # ---- training --------------------------------------------------------------------------------

    def fake_quant(self, k: SegmentKV, v: SegmentKV, calib: Any) -> tuple[Array, Array]:
        """What `write` then `reconstruct` give for a segment's K/V, float32, with straight-through
        gradients to k and v — for quantization-aware training. Raises NotImplementedError for a format
        without one."""
        raise NotImplementedError(f"the {self.name!r} cache format has no fake quantization for training")

    # ---- accounting ------------------------------------------------------------------------------

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Stored bits per cached K or V element (codes + metadata + α), by the toolbox's accounting; a
        format whose cost depends on the row's length (kivi) counts it at `context_len` tokens (None:
        the long-context limit)."""
        raise NotImplementedError

    def read_bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Bits a decode step reads per cached element, averaged over loops (references re-read
        included); default: what is stored."""
        return self.bits_per_element(num_loops, head_dim, context_len)

    def describe(self) -> str:
        """What the format stores, in a few words (tables)."""
        return self.name


def reference_attend(fmt: CacheFormat, state: tuple[Any, ...], index: Index, loop: int,
                     q: Queries, lengths: Lengths, calib: Any, visible: Visible | None = None) -> Partial:
    """"Decode the stored slot, then dense attention": the reference every format's `attend` must equal.
    `visible` further hides stored positions (e.g. steps a token skipped, `KVCache.steps`)."""
    k, v = fmt.reconstruct(state, index, loop, lengths, calib)
    mask = past_mask(lengths, q.shape[1], k.shape[2])
    return dense_partial(q, k, v, mask if visible is None else mask & visible[:, None, :])


def tiled_attend(fmt: CacheFormat, state: tuple[Any, ...], index: Index, loop: int, q: Queries,
                 lengths: Lengths, calib: Any, visible: Visible | None = None, table: Table | None = None) -> Partial:
    """`reference_attend` one context tile at a time (`tiled_partial`): every state leaf sliced on its
    token axis to a tile (`slot_tile`; a page of a paged cache through `table`), decoded by
    `fmt.reconstruct` as a one-slot cache of `tile` positions, then dense attention. For states whose
    leaves all have one entry per stored position."""
    b, t, h, d = q.shape
    max_len, tile = tiling(jax.tree_util.tree_leaves(state)[0], table, b, t, h, d)
    calib = jax.tree_util.tree_map(lambda x: x[index][None, None], calib)  # the slot's, as a [1, 1] stack

    def part(state, start, valid):
        window = jax.tree_util.tree_map(lambda x: x[None, None], slot_tile(state, index, start, tile, table))
        k, v = fmt.reconstruct(window, (0, 0), loop, jnp.clip(lengths - start, 0, tile), calib)
        return dense_partial(q, k, v, jnp.broadcast_to(valid[:, None, :], (b, t, tile)))

    return tiled_partial(part, state, (b, t, h, d), lengths, max_len, tile, visible)


FormatFactory = Callable[..., CacheFormat]
_REGISTRY: dict[str, FormatFactory] = {}


def register(name: str):
    """Decorator adding a format factory (a class or function taking policy keywords) under `name`."""

    def wrap(factory: FormatFactory) -> FormatFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def get_format(name: str, **policy) -> CacheFormat:
    """The format registered as `name`, built with `policy` keyword arguments.

    Raises ValueError for an unknown name or a keyword the format does not take.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown cache format {name!r}; available: {sorted(_REGISTRY)}")
    try:
        return _REGISTRY[name](**policy)
    except TypeError as err:
        raise ValueError(f"cache format {name!r} does not take {sorted(policy)}: {err}") from None


def available_formats() -> list[str]:
    """Names of the registered cache formats."""
    return sorted(_REGISTRY)


def policy_fields(name: str) -> frozenset[str]:
    """The policy keywords the format registered as `name` takes (its dataclass's init fields)."""
    fmt = get_format(name)
    return frozenset(f.name for f in dataclasses.fields(fmt) if f.init and f.name != "name")


def rows_of_pages(leaf: Array, table: Table) -> Array:
    """A pool leaf [G, N, NP, K, P, ...] as contiguous rows [G, N, B, K, N'·P, ...] through `table` [B, N']."""
    pages = jnp.take(leaf, jnp.clip(table, 0, leaf.shape[2] - 1), axis=2)  # [G, N, B, N', K, P, ...]
    pages = jnp.moveaxis(pages, 3, 4)  # [G, N, B, K, N', P, ...]
    return pages.reshape(*pages.shape[:4], -1, *pages.shape[6:])


def scatter_tokens(store: Any, new: Any, lengths: Lengths, num_new: NumNew, table: Table | None = None) -> Any:
    """Write every leaf of `new` into the same leaf of `store` along the token axis, in place.

    Leaves are laid out [G, N, B, K, S, ...] (`new` has T in place of S). Token t of row b goes to
    position lengths[b] + t when t < num_new[b]; the rest, and anything past S, are dropped — never
    wrapped around. With `table` the store is a paged pool [G, N, NP, K, P, ...] and each position is
    looked up in its row's pages.

    In a program lowered for a CPU a pool's leaves are written in one native call (`cpu_kernels.store_tokens`:
    a residual decode step's pool has 30 leaves, and a write loop per leaf cost XLA:CPU a thunk per row and
    leaf, ~0.45 ms of a 64-row step), else leaf by leaf (where the native kernels do not run: not built here,
    several devices), one read-merge-write per page a row's tokens touch (`_write_pages`). A contiguous store
    on a CPU is one read-merge-write of a T-token block per row (`_write_rows`; XLA:CPU widens a bfloat16 or
    fp8 scatter to float32, copying the whole leaf twice, while a dynamic-update-slice is done in place; the
    native store takes bits, and a contiguous cache may hold values, whose bitcast XLA:CPU copies). On a TPU a
    decode token (T = 1) into a token-minor leaf is the Mosaic store `pallas_kernels.tpu_write` (XLA:TPU's
    scatter copies most such leaves whole around the write); anything else, and other platforms, is one
    scatter (`_scatter`; `_write_pages` for a pool): on a TPU per-row blocks would be gathered by a transpose
    of the whole leaf. The choice follows the platform lowered for (`jax.lax.platform_dependent`), not the
    host's backend.
    """
    def write(old, val):
        if table is not None:
            return jax.lax.platform_dependent(old, val, lengths, num_new, table, tpu=_write_tpu, default=_write_pages)
        return jax.lax.platform_dependent(old, val, lengths, num_new, cpu=_write_rows, tpu=_write_tpu,
                                          default=_scatter)

    def each(store, new):
        return jax.tree_util.tree_map(write, store, new)

    def native(store, new):
        leaves, tree = jax.tree_util.tree_flatten(store)
        try:
            return tree.unflatten(cpu_kernels.store_tokens(leaves, tree.flatten_up_to(new), lengths, num_new, table))
        except NotImplementedError:
            return each(store, new)

    if table is None:
        return each(store, new)
    return jax.lax.platform_dependent(store, new, cpu=native, default=each)


def _write_pages(old: Array, val: Array, lengths: Lengths, num_new: NumNew, table: Table, bits: bool = True) -> Array:
    """`scatter_tokens` of one leaf into a paged pool [G, N, NP, K, P, ...]: per row, one read-merge-write
    of each page its new tokens touch (one for a single token, ⌈T/P⌉ + 1 for T), on the bits (`on_bits`;
    `bits` False: on the values, for XLA:TPU, which materialises a whole leaf's bitcast). A page past the
    row's table, or one the row's tokens miss, is written back as it was."""
    p, t, rows, cols = old.shape[TOKEN_AXIS], val.shape[TOKEN_AXIS], val.shape[2], table.shape[1]
    spans = 1 if t == 1 else -(-t // p) + 1
    trailing = (0,) * (old.ndim - TOKEN_AXIS - 1)

    def write(old, val):
        def body(i, stored):
            row, j = i // spans, i % spans
            first = lengths[row] // p + j  # the row's logical page
            page = jnp.clip(table[row, jnp.minimum(first, cols - 1)], 0, old.shape[2] - 1)
            at = (0, 0, page, 0, 0) + trailing
            held = jax.lax.dynamic_slice(stored, at, (*old.shape[:2], 1, *old.shape[3:]))
            tok = first * p + jnp.arange(p) - lengths[row]  # the call's token at each offset of the page
            take = (tok >= 0) & (tok < num_new[row]) & (first < cols)
            mine = jax.lax.dynamic_slice_in_dim(val, row, 1, axis=2)  # [G, N, 1, K, T, ...]
            placed = jnp.take(mine, jnp.clip(tok, 0, t - 1), axis=TOKEN_AXIS)
            shape = (1, 1, 1, 1, p) + (1,) * (old.ndim - TOKEN_AXIS - 1)
            return jax.lax.dynamic_update_slice(stored, jnp.where(take.reshape(shape), placed, held), at)

        return jax.lax.fori_loop(0, rows * spans, body, old)

    return on_bits(write, old, val) if bits else write(old, val.astype(old.dtype))


def with_gradient_of(reference: Callable[..., Any], fn: Callable[..., Any], *args) -> Any:
    """`fn(*args)`, differentiated as `reference(*args)` (a `jax.custom_vjp` whose backward pass is the
    reference's): for kernels XLA cannot differentiate (FFI calls), given a jnp reference of the same
    function. Leaves of `args` that are not arrays (formats, static indices) are held fixed."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    live = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def rebuild(values):
        out = list(leaves)
        for i, x in zip(live, values):
            out[i] = x
        return jax.tree_util.tree_unflatten(tree, out)

    @jax.custom_vjp
    def call(*values):
        return fn(*rebuild(values))

    def forward(*values):
        return call(*values), values

    def backward(values, cotangent):
        return jax.vjp(lambda *v: reference(*rebuild(v)), *values)[1](cotangent)

    call.defvjp(forward, backward)
    return call(*(leaves[i] for i in live))


def _scatter(old: Array, val: Array, lengths: Lengths, num_new: NumNew) -> Array:
    """`scatter_tokens` of one leaf as one scatter of single elements, every axis indexed: with the slot,
    row, head or channel axes left as window dims, XLA:TPU lays the whole leaf out with those axes minor
    (the token-minor codes and metadata padded to 128 lanes) and copies it there and back around the write."""
    t, s = val.shape[TOKEN_AXIS], old.shape[TOKEN_AXIS]
    steps = jnp.arange(t)[None, :]
    pos = jnp.where(steps < num_new[:, None], lengths[:, None] + steps, s)  # [B, T]; S is dropped
    index = jnp.meshgrid(*map(jnp.arange, val.shape), indexing="ij")
    index[TOKEN_AXIS] = jnp.broadcast_to(pos.reshape(pos.shape[0], 1, t, *(1,) * (val.ndim - TOKEN_AXIS - 1)),
                                         val.shape)
    return old.at[tuple(index)].set(val.astype(old.dtype), mode="drop")


def _write_tpu(old: Array, val: Array, lengths: Lengths, num_new: NumNew, table: Table | None = None) -> Array:
    """`scatter_tokens` of one leaf (a pool with `table`) lowered for a TPU: the Mosaic store of one token per
    row where it covers the leaf (`tpu_write.covers`), else `_scatter` (`_write_pages` for a pool)."""
    if tpu_write.covers(old.shape, val.shape[TOKEN_AXIS], TOKEN_AXIS, old.dtype):
        if table is None:
            return _scatter(old, val, lengths, num_new)
        return _write_pages(old, val, lengths, num_new, table, bits=False)
    return tpu_write.tpu_write_token(old, val, lengths, num_new, table, token_axis=TOKEN_AXIS)


def on_bits(update, old: Array, new: Array) -> Array:
    """`update(old, new)` (a scatter or dynamic-update-slice of `new` into `old`, `old`'s shape kept) run on
    a float leaf's bits, as unsigned integers of its width: XLA:CPU widens a bfloat16 or fp8 scatter to
    float32, which copies the whole leaf both ways. Other dtypes run as they are."""
    new = new.astype(old.dtype)
    if not jnp.issubdtype(old.dtype, jnp.floating):
        return update(old, new)
    return values_of(update(bits_of(old), bits_of(new)), old.dtype)


def _write_rows(old: Array, val: Array, lengths: Lengths, num_new: NumNew) -> Array:
    """`scatter_tokens` of one leaf as one dynamic-update-slice per row: row b's block of T positions
    from min(lengths[b], S − T), its new tokens merged into what the block held (read, for all rows at
    once, before the first write). All of it runs on the values' bits (`on_bits`): XLA:CPU widens float
    selects and reads, and a widened read inside the loop would copy the whole leaf."""
    s = old.shape[TOKEN_AXIS]
    t = min(val.shape[TOKEN_AXIS], s)  # tokens past S can never land
    start = jnp.minimum(lengths, s - t)  # [B]
    step = start[:, None] + jnp.arange(t)[None, :] - lengths[:, None]  # the call's token at each block position
    per_token = (1, 1, old.shape[2], 1, t) + (1,) * (old.ndim - TOKEN_AXIS - 1)
    keep = ((step < 0) | (step >= num_new[:, None])).reshape(per_token)
    trailing = (0,) * (old.ndim - TOKEN_AXIS - 1)

    def per_row(fn, x, offsets):
        """fn(row, offset) along the row axis (a gather of whole blocks, not one index per element)."""
        return jax.vmap(fn, in_axes=(2, 0), out_axes=2)(x, offsets)

    def write(old, val):
        held = per_row(lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, t, axis=TOKEN_AXIS - 1), old, start)
        # Block position j holds the call's token j − (lengths − start): the new tokens shifted right (one
        # token never shifts: its block starts at its own position, or it lands past S and is kept out).
        shifted = val if t == 1 else per_row(lambda x, i: jnp.roll(x, i, axis=TOKEN_AXIS - 1), val, lengths - start)
        merged = jnp.where(keep, held, shifted)

        def row(i, stored):
            block = jax.lax.dynamic_slice_in_dim(merged, i, 1, axis=2)
            return jax.lax.dynamic_update_slice(stored, block, (0, 0, i, 0, start[i]) + trailing)

        # A bfloat16 or fp8 dynamic-update-slice inside a loop is not done in place on XLA:CPU (a copy of the
        # whole leaf per row, quadratic in the rows), hence the bits. One row: a trip count XLA cannot prove
        # is 1, so the loop stays and the write stays in place (unrolled, XLA:CPU fuses the block's read
        # into the write and copies the whole leaf).
        rows = old.shape[2] if old.shape[2] > 1 else jnp.minimum(1, jnp.maximum(start[0], 1))
        return jax.lax.fori_loop(0, rows, row, old)

    return on_bits(write, old, jax.lax.slice_in_dim(val, 0, t, axis=TOKEN_AXIS))


def tree_nbytes(tree: Any) -> int:
    """Total bytes of every leaf of `tree`: arrays or `jax.ShapeDtypeStruct`s (nothing is allocated)."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def fake_quant_loops(fmt: CacheFormat, k: LoopKV, v: LoopKV, calib: tuple[Any, ...] | None) -> tuple[Array, Array]:
    """K/V of a loop stack [L, N, B, K, T, D] as `fmt` stores and reconstructs them (float32, straight-
    through gradients), segment by segment (`calib`: one entry per segment of `fmt`'s grouping of L)."""
    segs = segments(k.shape[0], fmt.group_len)
    calib = (None,) * len(segs) if calib is None and not fmt.needs_calib else calib
    if calib is None or len(calib) != len(segs):
        raise ValueError(f"the {fmt.name!r} format needs a calibration entry per loop segment ({len(segs)})")
    parts = [fmt.fake_quant(split_loops(k, seg), split_loops(v, seg), c) for seg, c in zip(segs, calib)]
    return tuple(jnp.concatenate([p[i].reshape(-1, *p[i].shape[2:]) for p in parts]) for i in (0, 1))
