"""The cache-format protocol, the format registry, and exact softmax partials.

Every format follows one dataflow (see DESIGN.md): while a call's tokens run their loops, their K/V
stay full precision ("in flight"); each attention reads the stored past through `attend` and its own
tokens densely, and the two softmax partials are merged exactly. After the last loop, `write` encodes
the K/V of all loops at once. Prefill (T = prompt length), decode (T = 1) and a second prompt turn are
the same code path, and the current token is never read back from compressed storage.

Shapes: B batch · T new tokens · S cache length · L loops · N layers · H query heads · K kv heads ·
D head dim. A format's state holds one slot per (loop, layer): arrays with leading axes [L, N].
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_NEG = -1e30  # finite "minus infinity": fully masked rows keep m finite and l = 0, never NaN.


class Partial(NamedTuple):
    """Unnormalised softmax-attention partial over a subset of keys.

    acc: [B, T, H, D] float32, Σ_s exp(score_s − m)·v_s.  m: [B, T, H] running max.  l: [B, T, H] Σ exp.
    """

    acc: Float[Array, "b t h d"]
    m: Float[Array, "b t h"]
    l: Float[Array, "b t h"]


def merge(a: Partial, b: Partial) -> Partial:
    """Exact log-sum-exp merge of two partials over disjoint key sets."""
    m = jnp.maximum(a.m, b.m)
    wa, wb = jnp.exp(a.m - m), jnp.exp(b.m - m)
    return Partial(a.acc * wa[..., None] + b.acc * wb[..., None], m, a.l * wa + b.l * wb)


def finalize(p: Partial) -> Float[Array, "b t h d"]:
    """Normalise a partial into attention output [B, T, H, D]; rows that saw no key give 0."""
    l = p.l[..., None]
    return jnp.where(l > 0, p.acc / jnp.where(l > 0, l, 1.0), 0.0)


def softmax_partial(
    scores: Float[Array, "b t h s"],
    mask: Bool[Array, "b t s"],
) -> tuple[Float[Array, "b t h s"], Float[Array, "b t h"], Float[Array, "b t h"]]:
    """Masked, max-shifted probabilities p = exp(s − m), with m and l = Σp, all float32."""
    mask = mask[:, :, None, :]
    scores = jnp.where(mask, scores.astype(jnp.float32), _NEG)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(mask, jnp.exp(scores - m[..., None]), 0.0)
    return p, m, jnp.sum(p, axis=-1)


def group_queries(q: Float[Array, "b t h d"], num_kv_heads: int) -> Float[Array, "b t k g d"]:
    """Split H query heads into K groups of H // K sharing one kv head (GQA)."""
    b, t, h, d = q.shape
    return q.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def dense_partial(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b k s d"],
    v: Float[Array, "b k s d"],
    mask: Bool[Array, "b t s"],
) -> Partial:
    """Softmax partial of queries over explicit keys/values (GQA by head grouping), f32 accumulation.

    Scores are scaled by 1/sqrt(D). `mask[b, t, s]` says whether query t of row b may see key s.
    """
    b, t, h, d = q.shape
    qg = group_queries(q, k.shape[1])
    scores = jnp.einsum("btkgd,bksd->btkgs", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    p, m, l = softmax_partial(scores.reshape(b, t, h, -1), mask)
    acc = jnp.einsum("btkgs,bksd->btkgd", p.reshape(b, t, k.shape[1], -1, p.shape[-1]), v.astype(jnp.float32))
    return Partial(acc.reshape(b, t, h, d), m, l)


def past_mask(lengths: Int[Array, "b"], num_queries: int, max_len: int) -> Bool[Array, "b t s"]:
    """Mask of stored positions s < lengths[b], the same for every query of the call."""
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]
    return jnp.broadcast_to(valid[:, None, :], (lengths.shape[0], num_queries, max_len))


class CacheFormat(Protocol):
    """A KV storage format: a frozen, hashable policy object whose methods are pure functions.

    `State` is the format's own pytree with one slot per (loop, layer). `calib` is the format's static
    calibration state (rotations, key means, codebooks) passed alongside the cache, never stored in it:
    `default_calib` builds it without data; formats with `needs_data` fit it on dense K/V with
    `calibrate` when none is given.
    """

    name: str
    needs_data: bool

    def init(self, num_loops: int, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int) -> Any:
        """An empty state for [num_loops, num_layers] slots of [batch, kv heads, max_len, head_dim]."""

    def default_calib(self, num_loops: int, num_layers: int, num_kv_heads: int, head_dim: int) -> Any:
        """Calibration state used when none is given (e.g. Hadamard rotations, zero means), or None."""

    def calibrate(self, k: Float[Array, "l n b k s d"], v: Float[Array, "l n b k s d"],
                  lengths: Int[Array, "b"]) -> Any:
        """Calibration state fitted on dense K/V (tokens s < lengths[b])."""

    def attend(self, state: Any, q: Float[Array, "b t h d"], loop: int, layer: int,
               lengths: Int[Array, "b"], calib: Any) -> Partial:
        """Partial attention of queries to the stored tokens s < lengths[b] of slot (loop, layer)."""

    def reconstruct(self, state: Any, loop: int, layer: int, calib: Any
                    ) -> tuple[Float[Array, "b k s d"], Float[Array, "b k s d"]]:
        """The stored K and V of slot (loop, layer) decoded to float32: the semantic reference."""

    def write(self, state: Any, k: Float[Array, "l n b k t d"], v: Float[Array, "l n b k t d"],
              lengths: Int[Array, "b"], num_new: Int[Array, "b"], calib: Any) -> Any:
        """Encode the new tokens t < num_new[b] of every slot at positions lengths[b] + t."""

    def nbytes(self, state: Any) -> int:
        """Bytes the state occupies, from its arrays' own sizes."""

    def bits_per_element(self, num_loops: int, head_dim: int) -> Fraction:
        """Stored bits per cached K or V element (codes + metadata + α), by the toolbox's accounting."""


def reference_attend(fmt: CacheFormat, state: Any, q: Float[Array, "b t h d"], loop: int, layer: int,
                     lengths: Int[Array, "b"], calib: Any) -> Partial:
    """"Decode the stored slot, then dense attention": the reference every format's `attend` must equal."""
    k, v = fmt.reconstruct(state, loop, layer, calib)
    return dense_partial(q, k, v, past_mask(lengths, q.shape[1], k.shape[2]))


_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator adding a format class to the registry under `name`."""

    def wrap(cls):
        _REGISTRY[name] = cls
        return cls

    return wrap


def get_format(name: str, **policy) -> CacheFormat:
    """The format registered as `name`, built with `policy` keyword arguments."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown cache format {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**policy)


def available_formats() -> list[str]:
    """Names of the registered cache formats."""
    return sorted(_REGISTRY)


def scatter_tokens(store: Any, new: Any, lengths: Int[Array, "b"], num_new: Int[Array, "b"], *,
                   token_axis: int) -> Any:
    """Write every leaf of `new` into the same leaf of `store` along the token axis.

    Leaves are laid out [..., B, K, S, ...] with S at `token_axis` and B two axes before it (`new` has T
    in place of S). Token t of row b goes to position lengths[b] + t when t < num_new[b]; the rest,
    and anything past S, are dropped — never wrapped around.
    """

    def one(old, val):
        b, t, s = val.shape[token_axis - 2], val.shape[token_axis], old.shape[token_axis]
        steps = jnp.arange(t)[None, :]
        pos = jnp.where(steps < num_new[:, None], lengths[:, None] + steps, s)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        index = (slice(None),) * (token_axis - 2) + (rows, slice(None), pos)
        # The two advanced indices are split by a slice, so their [B, T] dims lead the update.
        return old.at[index].set(jnp.moveaxis(val, (token_axis - 2, token_axis), (0, 1)).astype(old.dtype),
                                 mode="drop")

    return jax.tree_util.tree_map(one, store, new)


def tree_nbytes(tree: Any) -> int:
    """Total bytes of every array leaf in `tree`."""
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))
