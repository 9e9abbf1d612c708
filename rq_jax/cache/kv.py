"""The model-level KV cache: a typed pytree, how to build an empty one, and its bytes.

A `KVCache` holds the looped layers' K/V (`looped`: one state per segment of the format's loop
groups, see `rq_jax.cache.base`) and, for Huginn, the plain prelude/coda layers' (`plain`: one loop,
layers prelude then coda), plus the number of tokens stored per row. The formats are static fields,
so a jitted function retraces only when they change. Its calibration (`rq_jax.cache.calib`) is
passed alongside it; a model call reads and writes it through a `rq_jax.cache.context.CacheContext`.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

from rq_jax.cache import base
from rq_jax.cache.dense import Dense
from rq_jax.config import ModelConfig
from rq_jax.shapes import Lengths

Group = Literal["looped", "plain"]
KV = tuple[Array, Array]


@struct.dataclass
class KVCache:
    """Stored K/V of every (loop, layer) slot; `lengths[b]` tokens are valid in row b.

    `overflow[b]` is set when a call gave row b more tokens than fit (possible only inside a compiled
    program, where the call cannot raise): the tokens past `max_len` were dropped, `lengths` stops at
    `max_len`, and every public entry that takes a cache — an un-jitted model call, `check_overflow` —
    raises. (The Sampler builds its own cache and checks room before it starts.)

    `out_of_range[b]` counts, over every write to row b, the metadata values its format's metadata
    dtype could not hold (FP8 saturating at 448 or flushing to zero) plus non-finite K/V entries —
    as the formats' `write` reports them (`rq_jax.cache.base.Written`: the `LoopQuant` family counts; the
    others store every value). Generation and eval print it; see `LoopQuant.super_scale` for the remedy.

    `steps[b, s]` (only in a cache built with `track_steps=True`, else None) is how many loops the
    token at position s computed: Huginn's adaptive exit stops a token early, and such a cache hides
    its skipped steps — attention at loop t sees only the positions with steps > t, the reference's
    default ("full") cache lookup. Without it, skipped steps read the token's last computed K/V
    (`latest-m4`); see `rq_jax.nn.huginn.AdaptiveExit.lookup`.

    `bit_dtypes` is None while the K/V state holds its values; after `as_bits` it names every state
    leaf's dtype and the floating leaves hold their bits (see `as_bits`).

    `block_table` [B, N] (a paged cache, `init_paged_cache`; else None) names the pool page of each row's
    logical page: the state's leaves are a pool of pages [G, N, NP, K, P, ...] shared by every row, and
    row b's position s lies in page block_table[b, s // P]; `max_len` is N·P. The rows (B) are a step's
    requests: the server sets `lengths` and `block_table` for each step and keeps the pool.
    """

    __no_type_check__ = True  # jax rebuilds this pytree with placeholder leaves: the suite's checker skips its fields

    looped: tuple[Any, ...]
    plain: tuple[Any, ...] | None
    lengths: Lengths
    overflow: Bool[Array, "b"]
    out_of_range: Int[Array, "b"]
    steps: Int[Array, "b s"] | None
    fmt: base.CacheFormat = struct.field(pytree_node=False)
    plain_fmt: base.CacheFormat = struct.field(pytree_node=False)
    num_loops: int = struct.field(pytree_node=False)
    max_len: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)
    bit_dtypes: tuple[str, ...] | None = struct.field(pytree_node=False, default=None)
    block_table: Int[Array, "b pages"] | None = None

    @property
    def page_size(self) -> int | None:
        """Tokens per page of a paged cache (None: contiguous rows)."""
        if self.block_table is None:
            return None
        return jax.tree_util.tree_leaves(self.looped)[0].shape[base.TOKEN_AXIS]

    def as_bits(self) -> "KVCache":
        """This cache with every floating leaf of its K/V state (`looped`, `plain`) held as its bits,
        unsigned integers of the same width (`as_values` undoes it exactly; a no-op when already so).

        Hold a cache so wherever it crosses a compiled program's boundary (a donated argument, a loop
        carry): a model call takes its state to values where it reads it (`CacheContext.attend`, through
        `values`) and writes it (`CacheContext.finish`), and back to bits at its end; XLA folds each such
        bitcast into the reads' and writes' own (`base.slot_tile`, `base.on_bits`), and the rows a call
        writes are updated in place. Held as values, XLA:CPU's fusion emitters make each
        write's bitcast a copy of the whole narrow-float leaf, on every call."""
        if self.bit_dtypes is not None:
            return self
        state = (self.looped, self.plain)
        dtypes = tuple(str(x.dtype) for x in jax.tree_util.tree_leaves(state))
        looped, plain = jax.tree_util.tree_map(base.bits_of, state)
        return self.replace(looped=looped, plain=plain, bit_dtypes=dtypes)

    def held(self, platform: str | None = None) -> "KVCache":
        """This cache as a program compiled for `platform` (default: the host's backend) should carry it
        across its boundary: as its bits (`as_bits`), except on a TPU, where XLA:TPU materialises the bits'
        bitcast to values for the Mosaic kernels (a copy of every leaf, every call) and writes values in
        place (`pallas_kernels.tpu_write`)."""
        return self if (platform or jax.default_backend()) == "tpu" else self.as_bits()

    def as_values(self) -> "KVCache":
        """The cache with its K/V state holding values again (see `as_bits`; a no-op when it does)."""
        return self.replace(looped=self.values("looped"), plain=self.values("plain"), bit_dtypes=None)

    def values(self, group: Group) -> tuple[Any, ...] | None:
        """`stack(group)` holding values: a cache held as bits bitcast back leaf by leaf. Inside a
        compiled program take it where it is read or written (not before a loop that reads it), so
        that XLA folds these bitcasts into the reads' and writes' own (`base.slot_tile`, `base.on_bits`)."""
        stack = self.stack(group)
        if self.bit_dtypes is None or stack is None:
            return stack
        first = 0 if group == "looped" else len(jax.tree_util.tree_leaves(self.looped))
        leaves, tree = jax.tree_util.tree_flatten(stack)
        dtypes = self.bit_dtypes[first : first + len(leaves)]
        return jax.tree_util.tree_unflatten(tree, [base.values_of(x, d) for x, d in zip(leaves, dtypes)])

    def schedule(self, group: Group) -> tuple[base.CacheFormat, tuple[base.Segment, ...]]:
        """The format and loop segments of the looped or plain layers."""
        if group == "looped":
            return self.fmt, base.segments(self.num_loops, self.fmt.group_len)
        return self.plain_fmt, base.segments(1, self.plain_fmt.group_len)

    def stack(self, group: Group) -> tuple[Any, ...] | None:
        """The stored state of the looped or plain layers (None: the model has no plain layers)."""
        return self.looped if group == "looped" else self.plain

    def slot_dims(self, group: Group) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of a stack, read off its first leaf [G, N, B, K, S, ...]."""
        leaf = jax.tree_util.tree_leaves(self.stack(group))[0]
        return leaf.shape[1], leaf.shape[3], self.head_dim

    def locate(self, group: Group, loop: int, layer: int) -> tuple[int, base.Index, int]:
        """(segment, (group, layer) index, position in group) of slot (loop, layer)."""
        for i, seg in enumerate(self.schedule(group)[1]):
            if seg.start <= loop < seg.start + seg.num_loops:
                g, r = divmod(loop - seg.start, seg.size)
                return i, (g, layer), r
        raise ValueError(f"loop {loop} outside 0..{self.num_loops - 1}")

    def read(self, group: Group, loop: int, layer: int, calib: Any = None) -> KV:
        """The stored K and V of slot (loop, layer) decoded to float32 [B, K, S, D] (0 past each row; a paged
        cache's rows gathered from their pages);
        `calib` is the cache's `rq_jax.cache.calib.CacheCalib` (None for formats that read none)."""
        fmt = self.schedule(group)[0]
        seg, index, r = self.locate(group, loop, layer)
        calib = None if calib is None else calib.part(group)
        state = self.values(group)[seg]
        if self.block_table is not None:  # each row's pages in its order: a contiguous view of the rows
            state = jax.tree_util.tree_map(lambda x: base.rows_of_pages(x, self.block_table), state)
        return fmt.reconstruct(state, index, r, self.lengths, None if calib is None else calib[seg])

    def dense_kv(self, group: Group = "looped") -> KV:
        """K and V [L, N, B, K, S, D] of a dense cache's looped (L = num_loops) or plain (L = 1) layers."""
        fmt = self.schedule(group)[0]
        if not isinstance(fmt, Dense):
            raise ValueError(f"dense_kv needs a dense cache, this one stores {group} layers as {fmt.name!r}")
        ((slot,),) = self.values(group)
        return slot.k, slot.v


def cache_nbytes(cache: KVCache) -> int:
    """Bytes of the stored K/V and metadata of a cache, allocated or abstract (`jax.eval_shape`), from
    its arrays themselves (the per-row counters `lengths`, `overflow`, `out_of_range`, `steps` excluded)."""
    return base.tree_nbytes((cache.looped, cache.plain))


@dataclasses.dataclass(frozen=True)
class CacheBytes:
    """The byte figures of a cache of `batch` rows of `max_len` positions, every one from its arrays
    (`cache_bytes`): the looped and plain layers' stored K/V and metadata, those of dense bf16 K/V of
    the same slots, and what one decode step's attention reads from the full cache."""

    looped: int  # bytes of the looped layers' state (`KVCache.looped`)
    plain: int  # bytes of Huginn's plain layers' state (`KVCache.plain`; 0 without plain layers)
    dense_looped: int  # bytes of the same looped slots held as dense bf16 K/V
    dense_plain: int
    read: int  # bytes one decode step's attention reads, every slot at every position
    tokens: int  # positions held: batch × max_len

    @property
    def total(self) -> int:
        """Bytes of the whole cache (`cache_nbytes`)."""
        return self.looped + self.plain

    @property
    def dense(self) -> int:
        """Bytes of a dense bf16 cache of the same rows, positions and loops."""
        return self.dense_looped + self.dense_plain

    @property
    def per_token(self) -> float:
        """Bytes per position of a row, all layers."""
        return self.total / self.tokens

    @property
    def bits_per_element(self) -> Fraction:
        """Stored bits per cached K or V element of the looped layers (codes, metadata, α and any
        full-precision part, at the arrays' size): 16 × the bytes over dense bf16's."""
        return Fraction(16 * self.looped, self.dense_looped)

    @property
    def mean_bits_per_element(self) -> Fraction:
        """Stored bits per cached K or V element over every slot, plain layers included."""
        return Fraction(16 * self.total, self.dense)

    @property
    def read_bits_per_element(self) -> Fraction:
        """Bits a decode step reads per cached K or V element, over every slot."""
        return Fraction(16 * self.read, self.dense)


def cache_bytes(config: ModelConfig, fmt: base.CacheFormat, max_len: int, *, batch: int = 1,
                num_loops: int | None = None, plain_fmt: base.CacheFormat | None = None) -> CacheBytes:
    """The byte figures of `init_cache(config, batch, max_len, fmt, num_loops=..., plain_fmt=...)`, from
    the arrays' shapes (`jax.eval_shape`: nothing is allocated), beside a dense bf16 cache's.

    Leaves are [G, N, B, K, S, ...] (B = batch, S = max_len); the per-row counters are not counted. The
    bytes read are the stored bytes of each stack times the format's re-read factor
    (`read_bits_per_element` / `bits_per_element` at `max_len` tokens: a residual loop re-reads its
    anchor, a shared slot is read by every loop of its group): looped slots with `fmt` over `num_loops`,
    Huginn's plain slots with `plain_fmt` (default `fmt`) as a one-loop group. Every byte and bits per
    element figure in rq_jax comes from here (or, for a cache in hand, `cache_nbytes`)."""
    num_loops = config.num_loops if num_loops is None else num_loops
    plain_fmt = plain_fmt or fmt

    def shapes(f: base.CacheFormat, plain_f: base.CacheFormat) -> KVCache:
        return jax.eval_shape(lambda: init_cache(config, batch, max_len, f, num_loops=num_loops, plain_fmt=plain_f))

    def reread(f: base.CacheFormat, loops: int) -> Fraction:
        d = config.head_dim
        return Fraction(f.read_bits_per_element(loops, d, max_len)) / f.bits_per_element(loops, d, max_len)

    dense_fmt = Dense("bfloat16")
    stored, dense = shapes(fmt, plain_fmt), shapes(dense_fmt, dense_fmt)
    looped, plain = base.tree_nbytes(stored.looped), base.tree_nbytes(stored.plain)
    read = looped * reread(fmt, num_loops) + (plain * reread(plain_fmt, 1) if plain else 0)
    return CacheBytes(looped, plain, base.tree_nbytes(dense.looped), base.tree_nbytes(dense.plain), int(read),
                      batch * max_len)


def init_cache(config: ModelConfig, batch: int, max_len: int, fmt: base.CacheFormat | None = None, *,
               num_loops: int | None = None, plain_fmt: base.CacheFormat | None = None,
               track_steps: bool = False) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` tokens, run with `num_loops` loops.

    `fmt` stores the looped layers (default dense bf16); `plain_fmt` Huginn's prelude/coda (default
    `fmt`). `track_steps` records each token's computed loops and hides the skipped ones from later
    tokens (`KVCache.steps`). Raises ValueError if `max_len` exceeds the model's maximum position.
    """
    fmt = fmt or Dense()
    plain_fmt = plain_fmt or fmt
    num_loops = config.num_loops if num_loops is None else num_loops
    if max_len > config.max_position_embeddings:
        raise ValueError(f"cache max_len {max_len} exceeds the model's max positions "
                         f"{config.max_position_embeddings}")
    if batch <= 0 or max_len <= 0 or num_loops <= 0:
        raise ValueError(f"batch ({batch}), max_len ({max_len}) and num_loops ({num_loops}) must be positive")
    dims = (batch, max_len, config.num_kv_heads, config.head_dim)
    looped = tuple(fmt.init(seg, config.num_layers, *dims) for seg in base.segments(num_loops, fmt.group_len))
    plain = None
    if config.num_plain_layers:
        plain = tuple(plain_fmt.init(seg, config.num_plain_layers, *dims)
                      for seg in base.segments(1, plain_fmt.group_len))
    steps = jnp.zeros((batch, max_len), jnp.int32) if track_steps else None
    return KVCache(looped, plain, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
                   jnp.zeros((batch,), jnp.int32), steps, fmt, plain_fmt, num_loops, max_len, config.head_dim)


def init_paged_cache(config: ModelConfig, rows: int, pages: int, page_size: int, pages_per_row: int,
                     fmt: base.CacheFormat | None = None, *, num_loops: int | None = None,
                     plain_fmt: base.CacheFormat | None = None) -> KVCache:
    """An empty paged cache: a pool of `pages` pages of `page_size` tokens (every loop and layer), and
    `rows` rows of up to `pages_per_row` pages each, their block tables zero (the server fills in each
    step's rows, lengths and tables: `KVCache.block_table`). A format whose state cannot be paged (kivi)
    takes whole rows as pages (`pages_per_row` 1); rows longer than the model's positions raise ValueError."""
    fmt = fmt or Dense()
    plain_fmt = plain_fmt or fmt
    for f in {fmt, plain_fmt}:
        if not f.pageable and pages_per_row != 1:
            raise ValueError(f"the {f.name!r} cache format pages whole rows only (its state is not one entry per "
                             f"stored position: see its module), not {pages_per_row} pages a row")
    if min(rows, pages, page_size, pages_per_row) <= 0:
        raise ValueError(f"rows ({rows}), pages ({pages}), page_size ({page_size}) and pages_per_row "
                         f"({pages_per_row}) must be positive")
    max_len = pages_per_row * page_size
    if max_len > config.max_position_embeddings:
        raise ValueError(f"rows of {pages_per_row} pages of {page_size} tokens ({max_len}) exceed the model's max "
                         f"positions {config.max_position_embeddings}")
    pool = init_cache(config, pages, page_size, fmt, num_loops=num_loops, plain_fmt=plain_fmt)
    return pool.replace(lengths=jnp.zeros((rows,), jnp.int32), overflow=jnp.zeros((rows,), bool),
                        out_of_range=jnp.zeros((rows,), jnp.int32), max_len=max_len,
                        block_table=jnp.zeros((rows, pages_per_row), jnp.int32))


def check_overflow(cache: KVCache) -> None:
    """Raise ValueError if a compiled call overflowed `cache` (see `KVCache.overflow`); host-side."""
    rows = np.flatnonzero(np.asarray(cache.overflow))
    if rows.size:
        raise ValueError(f"cache rows {rows.tolist()} overflowed in an earlier compiled call: tokens past the "
                         f"cache's max_len {cache.max_len} were dropped; build a larger cache")
