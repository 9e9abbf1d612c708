"""Batched generation: one jitted prefill, then a `jax.lax.while_loop` decode with no Python per token.

Prompts of different lengths are right-padded; each row's positions and masks follow its own length.
The compiled functions are cached on the `Sampler`, so later calls with the same shapes do not retrace.
Given a `jax.sharding.Mesh`, the same programs run sharded (`rq_jax.sharding`): params split over
`model`, prompts and cache rows over `data`, the cache's kv heads over `model`; the generated tokens
come back replicated, so every process can read them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from rq_jax import setup, sharding
from rq_jax.cache.base import CacheFormat, policy_fields
from rq_jax.cache.dense import Dense
from rq_jax.cache.calib import CacheCalib, fit_calib
from rq_jax.cache.kv import KVCache, cache_bytes, cache_nbytes, init_cache
from rq_jax.compilation import CompileClock
from rq_jax.nn.common import ModelOutput
from rq_jax.shapes import NumNew, Tokens


#: Tokens per model call of a long prompt's prefill (`prefill`): at Ouro-1.4B's width one chunk's
#: in-flight float32 K/V of 4 loops × 2 layers is 0.25 GiB, and its MLP activations 44 MiB.
PREFILL_CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    #: A prompt longer than this runs through the model `prefill_chunk` tokens at a time (`prefill`), so
    #: the prefill's memory follows the chunk, not the prompt; None: one call, whatever its length.
    prefill_chunk: int | None = PREFILL_CHUNK

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be ≥ 1 or None, got {self.prefill_chunk}")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:  # NaN top_p fails the comparison too
            raise ValueError(f"need top_k ≥ 0 and 0 < top_p ≤ 1, got top_k={self.top_k}, top_p={self.top_p}")


def restrict_logits(logits: Float[Array, "b v"], temperature, top_k, top_p) -> Float[Array, "b v"]:
    """float32 logits / temperature, restricted by top-k then top-p (the rest -inf): what a sampled token
    is drawn from. Each parameter is a Python number, the same for every row (a filter it turns off,
    top_k 0 or top_p 1, is not traced), or an array of one value per row [B] (traced: temperature > 0,
    top_k 0 and top_p 1 off)."""
    def per_row(x):
        return x if isinstance(x, (int, float)) else jnp.asarray(x)[:, None]

    temperature, top_k, top_p = per_row(temperature), per_row(top_k), per_row(top_p)
    logits = logits.astype(jnp.float32) / temperature
    if not isinstance(top_k, int):
        kth = jnp.take_along_axis(-jnp.sort(-logits, axis=-1), jnp.clip(top_k - 1, 0, logits.shape[-1] - 1), axis=-1)
        logits = jnp.where((top_k > 0) & (logits < kth), -jnp.inf, logits)
    elif top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    traced_p = not isinstance(top_p, (int, float))
    if traced_p or top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p  # always keeps the top token
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        if traced_p:
            keep = keep | (top_p >= 1)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def choose_tokens(logits: Float[Array, "b v"], rng: jax.Array, cfg: SamplingConfig) -> Int[Array, "b"]:
    """Greedy argmax, or a sample from softmax(logits / T) restricted by top-k then top-p."""
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = restrict_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def decode_step(model, tokens: Int[Array, "b"], cache: KVCache, *, calib: CacheCalib | None = None,
                rng: jax.Array | None = None, active: Bool[Array, "b"] | None = None, **model_kwargs):
    """One decode step: row b feeds tokens[b] at position cache.lengths[b] (rows not `active` feed
    nothing and keep their cache), reading its past through the cache. Returns the model's output:
    logits [B, V] of the fed tokens and the updated cache. The one step the Sampler, the eval loops,
    the serving engine and the benchmarks share."""
    num_new = jnp.ones(tokens.shape, jnp.int32) if active is None else active.astype(jnp.int32)
    return model(tokens[:, None], cache, num_new=num_new, rng=rng, last_only=True, calib=calib, **model_kwargs)


def prefill(model, tokens: Tokens, cache: KVCache, *, num_new: NumNew,
            chunk: int | None = PREFILL_CHUNK, rng: jax.Array | None = None, **model_kwargs):
    """A prompt's prefill into `cache`: the model's output with logits [B, V] at each row's last real
    token (of the first num_new[b] tokens [B, T]) and the cache holding the prompt.

    A prompt of at most `chunk` tokens (or `chunk` None) is one model call. A longer one runs `chunk`
    tokens per call in a `jax.lax.scan`, each call reading the chunks before it from the cache, as a
    second prompt turn does: the memory follows the chunk, not the prompt (its in-flight K/V, its
    activations and the write's temporaries), and the cache is carried as it came (pass it `KVCache.held`
    for the platform: on its bits where XLA writes those in place). So a quantized format's later chunks
    read the earlier ones as the format stores them — the logits differ from one call's by the format's
    error, as decode's do — and a float32 dense cache gives one call's logits to float rounding. Huginn's
    random initial state is drawn per chunk (`rng` folded with the chunk's index); extras are only a single
    call's.
    """
    b, t = tokens.shape
    if chunk is None or t <= chunk:
        return model(tokens, cache, num_new=num_new, rng=rng, last_only=True, **model_kwargs)
    count = -(-t // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, count * chunk - t)))

    def one(carry, i):
        cache, logits = carry
        part = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)
        here = jnp.clip(num_new - i * chunk, 0, chunk)
        out = model(part, cache, num_new=here, rng=None if rng is None else jax.random.fold_in(rng, i),
                    last_only=True, **model_kwargs)
        ends_here = (here > 0) & (num_new <= (i + 1) * chunk)
        return (out.cache, jnp.where(ends_here[:, None], out.logits, logits)), None

    logits = jnp.zeros((b, model.config.vocab_size), jnp.float32)
    (cache, logits), _ = jax.lax.scan(one, (cache, logits), jnp.arange(count))
    return ModelOutput(logits, cache, {})


@struct.dataclass
class DecodeState:
    """Carry of the decode loop."""

    __no_type_check__ = True  # jax rebuilds this pytree with placeholder leaves: the suite's checker skips its fields

    tokens: Int[Array, "b n"]
    logits: Float[Array, "b n v"] | None
    num_generated: Int[Array, "b"]
    done: Bool[Array, "b"]
    cache: KVCache
    rng: jax.Array
    step: Int[Array, ""]
    steps: Int[Array, "b n"] | None  # core steps of the call that produced each token (adaptive exit)


class Generation(NamedTuple):
    """Generated tokens [B, N] (pad after a row stops), how many per row, optional logits [B, N, V],
    the final cache, and wall seconds: `prefill_seconds` and `decode_seconds` of running the programs
    (prefill includes fitting the calibration on the prompt when a format needs it), and
    `compile_seconds` spent tracing and compiling them (or loading them from the persistent compile
    cache) — nonzero on the first call with a new shape only.

    With adaptive exit (Huginn with `decode_kwargs=dict(adaptive=AdaptiveExit(...))`, whose model
    calls report `steps_used`): `steps` [B, N] holds the core steps of the call that produced each
    generated token (the reference's per-token compute steps: column 0 is the prompt's — its joint exit
    step with `exit_in_prefill`, else every step; 0 past a row's end), and `mean_steps` averages them
    over the tokens produced by decode steps (None when none ran, i.e. max_new_tokens 1). Both None
    without adaptive exit.
    """

    tokens: np.ndarray
    num_generated: np.ndarray
    logits: np.ndarray | None
    cache: KVCache
    prefill_seconds: float
    decode_seconds: float
    mean_steps: float | None = None
    steps: np.ndarray | None = None
    compile_seconds: float = 0.0

    def cache_report(self, config, calibration: str | None = None) -> list[str]:
        """Lines on the final cache: its bytes against dense bf16 and its bits per element (metadata
        included, `cache_bytes`), and what a newcomer would otherwise misread: allocation against used
        positions, `calibration` (where a fitted one came from), a full-precision part that holds every
        token, codebooks fitted on the prompt, values the format could not store."""
        c, fmt = self.cache, self.cache.fmt
        row = cache_bytes(config, fmt, c.max_len, batch=c.lengths.shape[0], num_loops=c.num_loops,
                          plain_fmt=c.plain_fmt)
        lines = [f"KV cache ({fmt.name}: {fmt.describe()}): looped layers at {float(row.bits_per_element):.4g} "
                 f"bits/element, metadata included; {row.total:,} bytes for {c.max_len} positions (dense bf16 would "
                 f"take {row.dense:,}: {row.total / row.dense:.1%})",
                 f"  {c.max_len} positions are allocated (prompt + --max-new-tokens); this run stored "
                 f"{int(sharding.to_host(c.lengths).max())}"]
        if calibration:
            lines.append(f"  calibration: fitted, from --calibration {calibration} (in place of the defaults named "
                         "above)")
        if fmt.full_precision_part and fmt.bits_per_element(c.num_loops, config.head_dim, c.max_len) >= 16:
            lines.append(f"  at {c.max_len} positions every token sits in the format's full-precision part "
                         f"({fmt.full_precision_part}), so nothing is quantized yet")
        if fmt.needs_data:
            lines.append(f"  {fmt.name} fits its codebooks on this prompt's K/V before decoding (prefill includes the "
                         "fit, and a short prompt gives rough codebooks)")
        if fmt.reports_out_of_range:
            lost = int(sharding.to_host(c.out_of_range).sum())
            hint = lost and "super_scale" in policy_fields(fmt.name) and not fmt.super_scale
            lines.append(f"values the cache could not store (metadata outside its dtype's range, non-finite K/V): "
                         f"{lost:,}" + ("  (try --super-scale)" if hint else ""))
        return lines

    def __repr__(self) -> str:
        b, n = self.tokens.shape
        extra = "" if self.mean_steps is None else f", mean_steps={self.mean_steps:.2f}"
        return (f"Generation(tokens [{b}, {n}], num_generated={self.num_generated.tolist()}, "
                f"{self.cache.fmt.name} cache of {self.cache.max_len} positions "
                f"({cache_nbytes(self.cache):,} bytes), prefill {self.prefill_seconds:.3f} s, "
                f"decode {self.decode_seconds:.3f} s, compile {self.compile_seconds:.1f} s{extra})")


class Sampler:
    """Generate from a model with a cache of format `fmt` (default dense bf16).

    `plain_fmt` stores Huginn's prelude/coda (default `fmt`). `calib` is the formats' calibration; when
    None, formats that need data are fitted on each batch's prompts (a dense prefill first), the others
    use their `default_calib`, built once here and passed to the compiled steps as an argument.
    `model_kwargs` go to every model call (e.g. `num_loops`, `exit` for Ouro; `num_loops`,
    `init_scale` for Huginn); `decode_kwargs` are added to (and override) them in decode
    steps only, e.g. `decode_kwargs=dict(adaptive=AdaptiveExit("kl"))` for Huginn's early exit. The
    prompt's prefill takes the same rule when its `exit_in_prefill` is set (the default: the whole
    prompt exits jointly, as in the reference's default) and runs every step otherwise. Each call gets
    its own PRNG stream from the seed.

    `mesh` (a `jax.sharding.Mesh` with axes `data` and/or `model`, e.g. `rq_jax.sharding.parse_mesh`)
    runs generation sharded: params by `sharding.param_specs`, the cache by `sharding.cache_specs`
    (built in place), calibration by `sharding.calib_specs`; greedy tokens are those of one device.
    """

    def __init__(self, model, cfg: SamplingConfig, fmt: CacheFormat | None = None, *,
                 plain_fmt: CacheFormat | None = None, return_logits: bool = False,
                 calib: CacheCalib | None = None, decode_kwargs: dict | None = None, mesh: Mesh | None = None,
                 **model_kwargs):
        self.mesh = mesh
        self.model_config = model.config
        self.cfg, self.return_logits = cfg, return_logits
        self.fmt = fmt or Dense()
        self.plain_fmt = plain_fmt or self.fmt
        self.model_kwargs = model_kwargs
        self.decode_kwargs = {**model_kwargs, **(decode_kwargs or {})}
        rule = self.decode_kwargs.get("adaptive")
        self.reports_steps = rule is not None
        self.track_steps = rule is not None and rule.lookup == "full"  # the cache hides skipped steps
        self.prefill_kwargs = {k: v for k, v in model_kwargs.items() if k != "adaptive"}
        if rule is not None and rule.exit_in_prefill:
            self.prefill_kwargs["adaptive"] = rule
        # The default calibration is built once, here, and passed to the compiled steps.
        self.graphdef, self.params, self.num_loops, self.calib, self.needs_data = setup.prepare(
            model, self.fmt, self.plain_fmt, calib=calib, mesh=mesh, **model_kwargs)
        self._calibrate = setup.jit(self._calibrate_fn)
        # The cache is donated to both (updated in place): the prefill's empty cache, the decode loop's state.
        self._prefill = setup.jit(self._prefill_fn, donate_argnums=4)
        self._decode = setup.jit(self._decode_fn, donate_argnums=2)

    def _empty_cache(self, batch: int, max_len: int, mesh: Mesh | None = None) -> KVCache:
        return sharding.init_sharded_cache(self.model_config, batch, max_len, self.fmt, mesh, num_loops=self.num_loops,
                                           plain_fmt=self.plain_fmt, track_steps=self.track_steps)

    def num_compiled(self) -> int:
        """How many prefill and decode programs have been compiled (one each per batch shape)."""
        return self._prefill._cache_size() + self._decode._cache_size()


    def _calibrate_fn(self, params, tokens, lengths, rng):
        dense = init_cache(self.model_config, tokens.shape[0], tokens.shape[1], Dense("float32"),
                           num_loops=self.num_loops)
        model = nnx.merge(self.graphdef, params)  # a dense prefill of every step: the K/V to fit on
        kwargs = {k: v for k, v in self.model_kwargs.items() if k != "adaptive"}
        out = model(tokens, dense, num_new=lengths, rng=rng, last_only=True, **kwargs)
        calib = fit_calib(out.cache, self.fmt, self.plain_fmt)
        return sharding.constrain(calib, sharding.calib_specs(calib, self.mesh, self.fmt, self.plain_fmt), self.mesh)

    def _prefill_fn(self, params, calib, tokens, lengths, cache, rng):
        rng, model_rng, pick_rng = jax.random.split(rng, 3)
        model = nnx.merge(self.graphdef, params)
        chunk = None if "adaptive" in self.prefill_kwargs else self.cfg.prefill_chunk  # a joint exit: one call
        out = prefill(model, tokens, cache, num_new=lengths, chunk=chunk, rng=model_rng, calib=calib,
                      **self.prefill_kwargs)
        first = choose_tokens(out.logits, pick_rng, self.cfg)
        n, b = self.cfg.max_new_tokens, tokens.shape[0]
        logits = None
        if self.return_logits:
            logits = jnp.zeros((b, n, out.logits.shape[-1]), jnp.float32).at[:, 0].set(out.logits)
        return DecodeState(
            tokens=jnp.full((b, n), self.cfg.pad_id, jnp.int32).at[:, 0].set(first), logits=logits,
            num_generated=jnp.ones((b,), jnp.int32), done=self._stops(first),
            cache=sharding.constrain_cache(out.cache, self.mesh), rng=rng,
            step=jnp.int32(1), steps=self._prefill_steps(out, lengths, n))

    def _prefill_steps(self, out, lengths, n):
        """Steps [B, N] with column 0 the first token's: its prompt's exit step, or every step."""
        if not self.reports_steps:
            return None
        b = lengths.shape[0]
        first = jnp.full((b,), self.num_loops, jnp.int32)
        if "adaptive" in self.prefill_kwargs:
            first = jnp.take_along_axis(out.extras["steps_used"], jnp.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
        return jnp.zeros((b, n), jnp.int32).at[:, 0].set(first)

    def _stops(self, tokens):
        return jnp.isin(tokens, jnp.asarray(self.cfg.stop_tokens, jnp.int32)) if self.cfg.stop_tokens else \
            jnp.zeros(tokens.shape, bool)

    def _decode_fn(self, params, calib, state: DecodeState) -> DecodeState:
        def cond(s: DecodeState):
            return (s.step < self.cfg.max_new_tokens) & ~jnp.all(s.done)

        def body(s: DecodeState):
            rng, model_rng, pick_rng = jax.random.split(s.rng, 3)
            active = ~s.done
            out = decode_step(nnx.merge(self.graphdef, params), s.tokens[:, s.step - 1], s.cache, calib=calib,
                              rng=model_rng, active=active, **self.decode_kwargs)
            steps = s.steps
            if self.reports_steps:
                steps = steps.at[:, s.step].set(jnp.where(active, out.extras["steps_used"][:, 0], 0))
            new = jnp.where(active, choose_tokens(out.logits, pick_rng, self.cfg), self.cfg.pad_id)
            logits = s.logits
            if logits is not None:
                logits = logits.at[:, s.step].set(jnp.where(active[:, None], out.logits, 0.0))
            return DecodeState(
                tokens=s.tokens.at[:, s.step].set(new), logits=logits,
                num_generated=s.num_generated + active, done=s.done | (active & self._stops(new)),
                cache=sharding.constrain_cache(out.cache, self.mesh), rng=rng, step=s.step + 1, steps=steps)

        state = jax.lax.while_loop(cond, body, state)
        if self.mesh is None:
            return state
        # What the host reads comes back replicated (every process can read it); the cache stays split.
        small = dict(tokens=state.tokens, logits=state.logits, num_generated=state.num_generated,
                     done=state.done, steps=state.steps)
        small = sharding.constrain(small, jax.tree_util.tree_map(lambda _: PartitionSpec(), small), self.mesh)
        return state.replace(**small)

    def __call__(self, prompts: Sequence[Sequence[int]], *, seed: int = 0, max_len: int | None = None) -> Generation:
        """Generate for a batch of token-id prompts (lists of different lengths allowed).

        The cache holds `max_len` tokens (default: longest prompt + max_new_tokens); raises ValueError
        if a prompt is empty or prompt plus generation does not fit.
        """
        lengths = np.array([len(p) for p in prompts], np.int32)
        if len(prompts) == 0 or lengths.min() == 0:
            raise ValueError("every prompt needs at least one token")
        need = int(lengths.max()) + self.cfg.max_new_tokens - 1  # the last token is never fed back
        max_len = max_len or need + 1
        if need > max_len:
            raise ValueError(f"prompt of {lengths.max()} tokens plus {self.cfg.max_new_tokens} new tokens "
                             f"needs a cache of {need}, but max_len is {max_len}")
        vocab = self.model_config.vocab_size
        bad = sorted({int(t) for p in prompts for t in p if not 0 <= int(t) < vocab})
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {bad[:5]}")
        tokens = np.full((len(prompts), lengths.max()), self.cfg.pad_id, np.int32)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = p
        cache = self._empty_cache(len(prompts), max_len, self.mesh).held()  # written in place by both programs
        rng = jax.random.key(seed)
        if self.mesh is not None:
            rows = sharding.batch_sharding(self.mesh, tokens.shape)
            tokens, lengths = sharding.put((tokens, lengths), rows)
            rng = sharding.put(rng, sharding.replicated(self.mesh))
        with CompileClock() as prefill_compile:
            start = time.perf_counter()
            calib = self.calib
            if calib is None:
                calib = self._calibrate(self.params, tokens, lengths, jax.random.fold_in(rng, 1))
            state = jax.block_until_ready(self._prefill(self.params, calib, tokens, lengths, cache, rng))
            mid = time.perf_counter()
        with CompileClock() as decode_compile:
            state = jax.block_until_ready(self._decode(self.params, calib, state))
            end = time.perf_counter()
        logits = None if state.logits is None else np.asarray(state.logits)
        num_decoded = int(np.sum(np.asarray(state.num_generated) - 1))  # tokens fed through decode steps
        mean_steps = steps = None
        if self.reports_steps:
            steps = np.asarray(state.steps)
            if num_decoded:
                mean_steps = float(np.sum(steps[:, 1:])) / num_decoded
        compiled = prefill_compile.seconds, decode_compile.seconds
        return Generation(np.asarray(state.tokens), np.asarray(state.num_generated), logits, state.cache.as_values(),
                          mid - start - compiled[0], end - mid - compiled[1], mean_steps, steps, sum(compiled))
