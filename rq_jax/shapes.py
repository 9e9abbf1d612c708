"""Named array types of the cache layout and the attention operands, one letter per axis package-wide.

Axes: b batch rows · t the call's new tokens · s cache positions (`max_len`) · l loops · n layers ·
h query heads · k kv heads · r query heads per kv head (h / k) · d head dim · g loop groups of a
segment · p loops in a group · e model width · v vocabulary · m gathered token positions.

An annotation names its axes, and jaxtyping binds each name to one size across a call's arguments
and result: a query laid out [B, H, T, D] passed where `Queries` is expected, or a segment's K/V with
two axes swapped, fails at the call that receives it instead of broadcasting into a wrong number. The
test suite runs with that check on for the whole package (pyproject's `--jaxtyping-packages`,
tests/shape_checker.py); under jit it runs once per trace.
"""

from jaxtyping import Array, Bool, Float, Int

# Per row of a batch.
Lengths = Int[Array, "b"]
"""[B] tokens stored per cache row (`KVCache.lengths`)."""
NumNew = Int[Array, "b"]
"""[B] real tokens of a call per row; the rest of its T are padding."""
Tokens = Int[Array, "b t"]
"""[B, T] token ids of a call."""
Positions = Int[Array, "b t"]
"""[B, T] absolute positions of a call's tokens."""

# Attention operands of one (loop, layer) slot.
Queries = Float[Array, "b t h d"]
"""[B, T, H, D] a call's queries, one per query head."""
GroupedQueries = Float[Array, "b t k r d"]
"""[B, T, K, R, D] queries grouped by the kv head they share (GQA, R = H / K)."""
NewKV = Float[Array, "b k t d"]
"""[B, K, T, D] keys or values of a call's own tokens."""
SlotKV = Float[Array, "b k s d"]
"""[B, K, S, D] a slot's stored keys or values, decoded."""
Scores = Float[Array, "b t h s"]
"""[B, T, H, S] attention logits of the queries over the stored positions."""
HeadStats = Float[Array, "b t h"]
"""[B, T, H] per-query softmax statistics: running max or sum of a partial."""
Attended = Float[Array, "b t h d"]
"""[B, T, H, D] attention output per query head."""
PastMask = Bool[Array, "b t s"]
"""[B, T, S] which stored positions each query sees."""
CallMask = Bool[Array, "b t t"]
"""[B, T, T] which of a call's own tokens each query sees."""
Visible = Bool[Array, "b s"]
"""[B, S] stored positions a slot's attention may read (valid, and not skipped by an early exit)."""

# The cache layout: every state leaf is [G, N, B, K, S, ...] (`rq_jax.cache.base`).
SegmentKV = Float[Array, "g p n b k t d"]
"""[G, p, N, B, K, T, D] a call's keys or values for every loop and layer of a segment, as written."""
SegmentPast = Float[Array, "g p n b k s d"]
"""[G, p, N, B, K, S, D] stored keys or values of every loop and layer of a segment, as calibrated."""
LoopKV = Float[Array, "l n b k t d"]
"""[L, N, B, K, T, D] a call's keys or values of every loop and layer."""
LoopPast = Float[Array, "l n b k s d"]
"""[L, N, B, K, S, D] stored keys or values of every loop and layer."""
