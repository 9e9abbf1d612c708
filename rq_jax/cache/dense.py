"""The `dense` format: K/V stored as they are, in bfloat16 or float32."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import NamedTuple

import cpu_kernels
import jax.numpy as jnp
from jaxtyping import Array, Float
from pallas_kernels import dense_decode_attention
from pallas_kernels.tpu_dense_attention import tpu_dense_decode_attention

from rq_jax.cache import attention, base
from rq_jax.quant import ste
from rq_jax.shapes import Lengths, NumNew, Queries, SegmentKV, SlotKV, Visible


class DenseSlot(NamedTuple):
    """Stored keys and values, [G, N, B, K, S, D] each."""

    k: Float[Array, "g n b k s d"]
    v: Float[Array, "g n b k s d"]


@base.register("dense")
@dataclasses.dataclass(frozen=True)
class Dense(base.CacheFormat):
    """Full-precision storage; `dtype` is "bfloat16" or "float32". Every loop is its own group.
    `attend_impl`: the decode-attention op's implementation (`rq_jax.cache.attention`; "auto": the
    Pallas kernel on a GPU, the native kernel on a CPU)."""

    dtype: str = "bfloat16"
    attend_impl: str = "auto"
    name: str = dataclasses.field(default="dense", init=False)
    group_len: int = dataclasses.field(default=1, init=False)
    needs_calib: bool = dataclasses.field(default=False, init=False)
    needs_data: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dense cache dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        attention.check_impl(self.name, self.attend_impl)

    def init(self, seg, num_layers, batch, max_len, num_kv_heads, head_dim) -> tuple[DenseSlot]:
        """Zeroed [G, N, B, K, S, D] keys and values."""
        shape = (seg.groups, num_layers, batch, num_kv_heads, max_len, head_dim)
        return (DenseSlot(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)),)

    def write(self, state, k: SegmentKV, v: SegmentKV, lengths: Lengths, num_new: NumNew, calib,
              table: base.Table | None = None) -> base.Written:
        """Store new K/V [G, 1, N, B, K, T, D] at positions lengths[b] + t, t < num_new[b] (through `table`)."""
        new = base.scatter_tokens(state[0], DenseSlot(k[:, 0], v[:, 0]), lengths, num_new, table)
        return base.Written((new,), base.nothing_lost(lengths))

    def reconstruct(self, state, index, loop, lengths: Lengths, calib) -> tuple[SlotKV, SlotKV]:
        """The stored K, V of slot `index` as float32 [B, K, S, D] (positions s ≥ lengths[b] are 0 already)."""
        slot = base.at(state[loop], index)
        return slot.k.astype(jnp.float32), slot.v.astype(jnp.float32)

    def attend(self, state, index, loop, q: Queries, lengths: Lengths, calib, visible: Visible | None = None,
               table: base.Table | None = None) -> base.Partial:
        """Attention to slot `index`'s stored K/V (through `table`) by the decode-attention op (XLA's tiled
        attention under a `visible` mask, which the kernels do not take)."""
        if visible is not None:
            return base.tiled_attend(self, state, index, loop, q, lengths, calib, visible, table)
        return attention.DENSE(self.attend_impl, self, state[loop], index, q, lengths, calib, table, who=self.name)

    def fake_quant(self, k: SegmentKV, v: SegmentKV, calib) -> tuple[Array, Array]:
        """K/V rounded to the storage dtype (float32 values), gradients passed straight through."""
        def cast(x):
            x = x.astype(jnp.float32)
            return ste.straight_through(x, x.astype(self.dtype).astype(jnp.float32), jnp.ones((), jnp.float32))

        return cast(k), cast(v)

    def bits_per_element(self, num_loops: int, head_dim: int, context_len: int | None = None) -> Fraction:
        """16 or 32."""
        return Fraction(jnp.dtype(self.dtype).itemsize * 8)

    def describe(self) -> str:
        return {"bfloat16": "bf16", "float32": "f32"}[self.dtype]


@attention.DENSE.register("xla")
def _attend_xla(fmt: Dense, slot: DenseSlot, index: base.Index, q: Queries, lengths: Lengths,
                calib, table: base.Table | None = None) -> base.Partial:
    """XLA's tiled attention to the slot (`base.tiled_attend`)."""
    return base.tiled_attend(fmt, (slot,), index, 0, q, lengths, calib, table=table)


def _kernel_partial(kernel, slot: DenseSlot, index: base.Index, q: Queries,
                    lengths: Lengths, flat: bool = True, **kw) -> base.Partial:
    """The partial through a kernel of `pallas_kernels.dense_decode_attention`'s signature: queries as
    [B, K, T·H/K, D] rows, K/V over the [G·N] slots (flattened when `flat`, else stacked [G, N, ...] for a
    kernel that takes leading slot axes)."""
    b, t, h, d = q.shape
    kv_heads = slot.k.shape[3]
    per_kv = h // kv_heads
    rows = base.group_queries(q, kv_heads).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * per_kv, d)
    kv = [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) if flat else x for x in slot]
    acc, m, l = kernel(rows, *kv, lengths, index[0] * slot.k.shape[1] + index[1], **kw)

    def back(x):
        rest = x.shape[3:]
        return jnp.moveaxis(x.reshape(b, kv_heads, t, per_kv, *rest), 2, 1).reshape(b, t, h, *rest)
    return base.Partial(back(acc), back(m), back(l))


@attention.DENSE.register("native")
def _attend_native(fmt, slot, index, q, lengths, calib, table=None) -> base.Partial:
    """The native CPU kernel (`cpu_kernels.dense_decode_attention`, XLA FFI; partitioned over a mesh), rows
    through `table` when paged."""
    return _kernel_partial(cpu_kernels.dense_decode_attention, slot, index, q, lengths, flat=False,
                           **({} if table is None else {"block_table": table}))


@attention.DENSE.register("pallas")
def _attend_pallas(fmt, slot, index, q, lengths, calib, table=None) -> base.Partial:
    """The dense Pallas kernel (`pallas_kernels.dense_decode_attention`; interpret mode off a GPU), rows
    through `table` when paged."""
    return _kernel_partial(dense_decode_attention, slot, index, q, lengths, interpret=attention.target() != "cuda",
                           block_table=table)


@attention.DENSE.register("pallas-tpu")
def _attend_pallas_tpu(fmt, slot, index, q, lengths, calib, table=None) -> base.Partial:
    """The dense Mosaic kernel (`pallas_kernels.tpu_dense_attention`; TPU interpret mode off a TPU), rows
    through `table` when paged."""
    return _kernel_partial(tpu_dense_decode_attention, slot, index, q, lengths, interpret=attention.target() != "tpu",
                           block_table=table)
