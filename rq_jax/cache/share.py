"""Loop KV sharing: formats that store some loops' K/V and let the others read them — `share` (Ouro's
decode-time sharing, the "0-bit residual" end of ResidualQuant's ladder) and `compress` (the Huginn
reference's memory-bounding cache strategies).

`share`: the loops of a group store one K/V per token and layer and all read it; nothing is stored for
the other loops, not even a residual. `source` says what is stored: the group's last loop's K/V
("last"), the mean over its loops ("mean"), or its first loop's ("first"). Ouro's paper (§5.4.2, Table
14) tests exactly these three over its 4 loops (`loops=4`): "last" and "mean" keep GSM8K within 0.3
points at 4× less KV memory, "first" collapses. On Huginn, `loops=4` shares within ResidualQuant's
groups of 4 steps (each group's own last step) and `loops=32` one K/V across every step.

`compress`: the reference's `HuginnDynamicCache` strategies that bound memory, in the reference's
slot arithmetic (core step index s = 2 + 4r + j for recurrence r, core layer j). "compress-s{N}" writes
step s into slot (s − 2) mod N + 2; with N a multiple of the core layers (`strategy="modulo"`,
`slots` = N / layers recurrences) recurrence r writes into slot r mod `slots`, overwriting, so a
stored token's slot j holds its last recurrence ≡ j, which recurrence r then reads. "compress-anchor"
(`strategy="anchor"`, `slots` = 8) keeps recurrences 0..7 and lets every later one share the 9th's
slot, which ends up holding the last recurrence. ("compress-r{N}", slot (s − 2) // N + 2, puts several
core layers' K/V into one slot; a layout with a slot per layer cannot hold that, and it is not offered.)

Both keep the one dataflow of `rq_jax.cache.base`: a call's own tokens attend to each other at every
loop with their full-precision K/V, so a prompt prefilled in one call is exact — the paper's prefill,
where "all four recurrent steps require their own KV caches" — and only what later calls read is
shared (a prompt split over calls reads its earlier chunks shared, as decoding does). The reference's
Huginn cache behaves the same way: a token's current step is always its own.

The stored K/V is kept by an *anchor* format of one loop: dense bfloat16 (`bits=16`, the default), or
`uniform` / `rotated` INTn with channel groups of `group_size` and FP8 metadata (`bits=4`, `rotation`
"identity" or "hadamard"); the anchor's attention (its kernels and their fallbacks) is the format's. A
dense bf16 anchor shared by Ouro's 4 loops is 16 / 4 = 4 bits per element; an INT4 g32 one 4.5 / 4.

State: per stored slot the anchor's one-loop slot pytree (leaves [G, N, B, K, S, ...]), a tuple over
the slots; calibration: the anchor's for one loop per group (rotations [G, N, K, D, D], or None),
shared by the slots.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import ClassVar, Mapping

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from rq_jax.cache import attention, base
from rq_jax.cache.dense import Dense
from rq_jax.cache.loop_quant import LoopQuant
from rq_jax.shapes import Lengths, NumNew, Queries, SegmentKV, SegmentPast, SlotKV, Visible

#: What a `share` group stores for all its loops: its last loop's K/V, the mean over its loops, its first's.
SOURCES = ("last", "mean", "first")
#: `compress`'s strategies: the reference's "compress-s{N}" (N a multiple of the core layers) and
#: "compress-anchor".
STRATEGIES = ("modulo", "anchor")
#: The loops one `compress` segment covers: every loop of a run (the reference's rules span all steps).
ALL_LOOPS = 2**16


@dataclasses.dataclass(frozen=True)
class _Stored(base.CacheFormat):
    """A format storing some loops of each group (`writers`) through a one-loop `anchor` format, every
    loop reading one stored slot (`slot_of`): the machinery and the anchor's policy fields `LoopShare`
    and `HuginnCompress` share.

    `bits` 16 with the identity rotation stores dense bfloat16; otherwise INT`bits` codes with channel
    groups of `group_size`, `meta_dtype` scales and offsets, after `rotation`. `attend_impl`: the
    anchor's decode-attention implementation (`rq_jax.cache.attention`)."""

    bits: int | tuple[int] = 16
    group_size: int = 32
    rotation: str = "identity"
    meta_dtype: str = "float8_e4m3fn"
    attend_impl: str = "auto"
    needs_data: bool = dataclasses.field(default=False, init=False)
    needs_calib: bool = dataclasses.field(default=False, init=False)
    anchor: base.CacheFormat = dataclasses.field(default=None, init=False, repr=False, compare=False)
    calib_head_axes: ClassVar[Mapping[str, int]] = LoopQuant.calib_head_axes
    reports_out_of_range: ClassVar[bool] = True

    def writers(self, size: int) -> tuple[tuple[int, ...], ...]:
        """Per stored slot of a group of `size` loops, the loops whose K/V it holds (several: their mean)."""
        raise NotImplementedError

    def slot_of(self, loop: int) -> int:
        """The stored slot group position `loop` reads."""
        raise NotImplementedError

    def __post_init__(self):
        """Check the anchor's policy; set `bits` (one int), `anchor` (dense bf16 at 16 bits unrotated, else
        `uniform` / `rotated` INT`bits`) and `needs_calib`."""
        widths = tuple(np.atleast_1d(self.bits).tolist())
        if len(widths) != 1:
            raise ValueError(f"{self.name}: bits {widths} must be one width (the stored K/V's)")
        object.__setattr__(self, "bits", int(widths[0]))
        attention.check_impl(self.name, self.attend_impl)
        if self.bits == 16 and self.rotation == "identity":
            anchor = Dense("bfloat16", attend_impl=self.attend_impl)
        else:
            anchor = LoopQuant(bits=(self.bits,), group_size=self.group_size, rotation=self.rotation, residual=False,
                               meta_dtype=self.meta_dtype, attend_impl=self.attend_impl,
                               name="uniform" if self.rotation == "identity" else "rotated")
        object.__setattr__(self, "anchor", anchor)
        object.__setattr__(self, "needs_calib", anchor.needs_calib)

    def _one(self, seg: base.Segment) -> base.Segment:
        """The anchor's segment: the same groups, one loop each."""
        return base.Segment(seg.start, seg.groups, 1)

    def stored(self, x: SegmentKV, slot: int) -> Float[Array, "g 1 n b k t d"]:
        """What stored slot `slot` of a group of loops [G, p, ...] holds: [G, 1, ...] (a mean in float32)."""
        loops = self.writers(x.shape[1])[slot]
        if len(loops) == 1:
            return x[:, loops[0] : loops[0] + 1]
        return jnp.mean(x[:, list(loops)].astype(jnp.float32), axis=1, keepdims=True)

    # ---- the CacheFormat protocol -------------------------------------------------------------------

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim):
        """The anchor's empty one-loop slot for every stored slot of the segment's groups (arrays of their
        own: a donated cache must not hold one buffer twice)."""
        return tuple(self.anchor.init(self._one(seg), num_layers, batch, max_len, num_kv_heads, head_dim)[0]
                     for _ in self.writers(seg.size))

    def write(self, state, k: SegmentKV, v: SegmentKV, lengths: Lengths, num_new: NumNew, calib,
              table: base.Table | None = None) -> base.Written:
        """Store every slot's K/V (`stored` of K/V [G, p, N, B, K, T, D]) through the anchor."""
        new, lost = [], base.nothing_lost(lengths)
        for j in range(len(self.writers(k.shape[1]))):
            written = self.anchor.write((state[j],), self.stored(k, j), self.stored(v, j), lengths, num_new, calib,
                                        table)
            new.append(written.state[0])
            lost = lost + written.out_of_range
        return base.Written(tuple(new), lost)

    def reconstruct(self, state, index, loop, lengths: Lengths, calib) -> tuple[SlotKV, SlotKV]:
        """Loop `loop`'s K/V: its slot's, decoded by the anchor ([B, K, S, D] each)."""
        return self.anchor.reconstruct((state[self.slot_of(loop)],), index, 0, lengths, calib)

    def attend(self, state, index, loop, q: Queries, lengths: Lengths, calib, visible: Visible | None = None,
               table: base.Table | None = None) -> base.Partial:
        """Attention to loop `loop`'s slot through the anchor's attention."""
        return self.anchor.attend((state[self.slot_of(loop)],), index, 0, q, lengths, calib, visible, table)

    def default_calib(self, seg, num_layers, num_kv_heads, head_dim):
        """The anchor's data-free calibration (rotations for a `rotated` anchor, else None)."""
        return self.anchor.default_calib(self._one(seg), num_layers, num_kv_heads, head_dim)

    def calibrate(self, seg, k: SegmentPast, v: SegmentPast, lengths: Lengths):
        """The anchor's calibration fitted on the K/V of the first stored slot."""
        return self.anchor.calibrate(self._one(seg), self.stored(k, 0), self.stored(v, 0), lengths)

    def calib_shapes(self, seg, num_layers, num_kv_heads, head_dim):
        """The anchor's calibration leaves for one loop per group."""
        return self.anchor.calib_shapes(self._one(seg), num_layers, num_kv_heads, head_dim)

    def fake_quant(self, k: SegmentKV, v: SegmentKV, calib) -> tuple[Array, Array]:
        """Every loop's read of the anchor's fake quantization of its slot (K/V [G, p, N, B, K, T, D]):
        gradients reach the loops the slots are made of."""
        slots = [self.anchor.fake_quant(self.stored(k, j), self.stored(v, j), calib)
                 for j in range(len(self.writers(k.shape[1])))]
        return tuple(jnp.concatenate([slots[self.slot_of(r)][i] for r in range(k.shape[1])], axis=1) for i in (0, 1))

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """The anchor's bits for one loop, once per stored slot, averaged over the loops."""
        slots = sum(seg.groups * len(self.writers(seg.size)) for seg in base.segments(num_loops, self.group_len))
        return self.anchor.bits_per_element(1, head_dim) * slots / num_loops

    def read_bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """Every loop reads one stored slot whole."""
        return self.anchor.read_bits_per_element(1, head_dim)


@base.register("share")
@dataclasses.dataclass(frozen=True)
class LoopShare(_Stored):
    """One stored K/V per group of `loops` loops, read by all of them (see the module docstring)."""

    source: str = "last"
    loops: int = 4
    name: str = dataclasses.field(default="share", init=False)

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"share: unknown source {self.source!r}: expected one of {SOURCES}")
        if self.loops < 1:
            raise ValueError(f"share: loops must be positive, got {self.loops}")
        super().__post_init__()

    @property
    def group_len(self) -> int:
        """Loops sharing one stored K/V."""
        return self.loops

    def writers(self, size: int) -> tuple[tuple[int, ...], ...]:
        """One slot: the group's last loop, its first, or all of them (their mean)."""
        return ({"last": (size - 1,), "first": (0,), "mean": tuple(range(size))}[self.source],)

    def slot_of(self, loop: int) -> int:
        """Every loop reads the one slot."""
        return 0

    def schedule_name(self, num_loops: int) -> str:
        """E.g. "share-last-b4-g32-hadamard-p4-L4"."""
        return f"share-{self.source}-b{self.bits}-g{self.group_size}-{self.rotation}-p{self.loops}-L{num_loops}"

    def describe(self) -> str:
        """E.g. "bf16, the last of 4 loops shared"."""
        return f"{self.anchor.describe()}, the {self.source} of {self.loops} loops shared"


@base.register("compress")
@dataclasses.dataclass(frozen=True)
class HuginnCompress(_Stored):
    """The Huginn reference's "compress-s{N}" (`strategy="modulo"`: `slots` recurrences, N = `slots` ×
    core layers) and "compress-anchor" (`strategy="anchor"`: the first `slots` recurrences kept, the
    reference's 8) over every loop of a run; the anchor as `LoopShare`'s (see the module docstring)."""

    strategy: str = "modulo"
    slots: int = 4
    name: str = dataclasses.field(default="compress", init=False)
    group_len: int = dataclasses.field(default=ALL_LOOPS, init=False)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"compress: unknown strategy {self.strategy!r}: expected one of {STRATEGIES}")
        if self.slots < 1:
            raise ValueError(f"compress: slots must be positive, got {self.slots}")
        super().__post_init__()

    def writers(self, size: int) -> tuple[tuple[int, ...], ...]:
        """Per slot, the last loop that writes it (the reference overwrites): for "modulo" slot j holds
        the last loop ≡ j (mod `slots`); for "anchor" the first `slots` loops hold themselves and one
        more slot the last loop."""
        if self.strategy == "modulo":
            return tuple((max(range(j, size, self.slots)),) for j in range(min(self.slots, size)))
        kept = tuple((r,) for r in range(min(self.slots, size)))
        return kept + (((size - 1,),) if size > self.slots else ())

    def slot_of(self, loop: int) -> int:
        """Recurrence `loop`'s slot: loop mod `slots` ("modulo"); min(loop, `slots`) ("anchor")."""
        return loop % self.slots if self.strategy == "modulo" else min(loop, self.slots)

    def schedule_name(self, num_loops: int) -> str:
        """E.g. "compress-modulo4-b16-g32-identity-L32"."""
        return f"compress-{self.strategy}{self.slots}-b{self.bits}-g{self.group_size}-{self.rotation}-L{num_loops}"

    def describe(self) -> str:
        """E.g. "bf16, 4 recurrences' slots reused modulo 4"."""
        how = {"modulo": f"{self.slots} recurrences' slots reused modulo {self.slots}",
               "anchor": f"recurrences 0..{self.slots - 1} kept, the rest sharing one slot"}[self.strategy]
        return f"{self.anchor.describe()}, {how}"
