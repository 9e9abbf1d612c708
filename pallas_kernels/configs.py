"""The kernel configurations the dispatch can pick for the shipped cache policies, as abstract calls.

A `KernelConfig` names one call of a decode kernel by what decides its compiled code: head dim, query
rows (GQA group x tokens per step), the chain of (bits, group size) links and their metadata dtype, α,
key means — or, for the dense kernel, the K/V dtype. `config.call()` gives the jitted function and
ShapeDtypeStruct arguments, so it can be lowered (and compiled without a GPU, `pallas_kernels.deviceless`)
without allocating anything; `config.tpu_call(generation)` is the same call of the TPU (Mosaic) kernel
(compiled without a TPU by `pallas_kernels.tpu_deviceless`). Sequence length, batch and kv heads only
change the split count, which is a loop bound, so every config uses Ouro's 16 kv heads at S = 4096 and
batch 1.

`MATRIX` holds every configuration of the shipped policies that changes the kernel's code:

* chains (keys and values alike; query dtype float32, as `rq_jax.cache.loop_quant.attend_pallas` passes):
  `uniform`/`rotated` and the anchor loop (one link, INT2/4/8 at g16 and g32); `residual` loops with the
  last-loop reference ([b, a]: INT2/4/8 loops over an INT4 anchor, INT2 over INT2) and the previous-loop
  reference (3- and 4-link chains of INT2 over an INT2 or INT4 anchor), each at g16 and g32, plus mixed
  group sizes (INT2 g16 over INT4 g32);
* head dims 64 (GQA models), 96 (Huginn), 128 (Ouro); query rows (query heads per kv head x tokens
  per step) 1 (decode), 32 and 64 (several tokens per step), i.e. row blocks of 16, 32 and 64 (more
  rows run more 64-row programs), and 8 rows (GQA 8:1 decode, the 16-row block with half its rows
  real) for the residual loop at g16 and g32;
* with FP8 metadata, α and key means (the most work per token), and, at 1 and 64 rows, one-at-a-time
  variations of them: bf16 / f16 / f32 metadata (f32 is also what a super-scale folds into), α off,
  key means off;
* dense: bf16 and f32 K/V at each head dim and row count;
* paged (`PAGED`): issue 23's table over a pool of the serving engine's 16-token pages, rows read through a
  block table (`page`).

`CI_SUBSET` names the configurations compiled on every test run (see tests/kernels/test_compile.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp

from pallas_kernels import decode_common as dc
from pallas_kernels import dense_attention as da
from pallas_kernels import deviceless, launch
from pallas_kernels import residual_attention as ra
from pallas_kernels import tpu_dense_attention as tda
from pallas_kernels import tpu_residual_attention as tra


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One decode-kernel call. `links`: (bits, group size) per chain link, loop first, anchor last (the
    keys', and the values' unless `v_links` differ: a bit-allocation schedule's); empty for the dense
    kernel, whose K/V dtype is `kv`."""

    name: str
    dim: int
    rows: int
    links: tuple[tuple[int, int], ...] = ()
    v_links: tuple[tuple[int, int], ...] | None = None
    meta: str = "float8_e4m3fn"
    alpha: bool = True
    means: bool = True
    kv: str = "bfloat16"
    q_dtype: str = "float32"
    heads: int = 16
    seq: int = 4096
    batch: int = 1
    slots: int = 4
    page: int = 0  # tokens per page of a paged pool read through a block table (0: contiguous rows)

    @property
    def kernel(self) -> str:
        """The launch table's kernel name: "residual", "dense-bfloat16" or "dense-float32"."""
        return "residual" if self.links else f"dense-{self.kv}"

    def groups(self) -> tuple[int, ...]:
        """Per link, the finer of its key and value group sizes: what the dispatch keys on."""
        return tuple(min(k, v) for (_, k), (_, v) in zip(self.links, self.v_links or self.links))

    def launch_key(self) -> launch.LaunchKey | None:
        return launch.key(self.kernel, self.dim, self.rows, self.groups())

    def launch(self) -> launch.Launch:
        """The launch parameters the dispatch picks for this call (`pallas_kernels.launch`; a paged call's
        tiles at most a page, `decode_common.tile_block`)."""
        lp = launch.lookup(self.kernel, self.dim, self.rows, self.groups(), paged=bool(self.page))
        return lp._replace(block_s=dc.tile_block(lp.block_s, self.page))

    def compile(self, target: deviceless.Target, cache_dir=None, override: launch.Launch | None = None):
        """`deviceless.Resources` of this call compiled for `target` with the dispatch's launch
        parameters, or with `override`'s. Raises deviceless.CompileError, or NotImplementedError when
        the lowering rejects it."""
        fn, args = self.call()
        if override is not None:  # a paged call's tiles at most a page, as the dispatch caps them
            fn = functools.partial(fn, block_s=dc.tile_block(override.block_s, self.page), num_warps=override.num_warps,
                                   num_stages=override.num_stages,
                                   block_r=min(launch.row_block(self.rows), override.max_block_r),
                                   **({"dequant_keys": override.dequant_keys} if self.links else {}))
        [kernel] = deviceless.triton_kernels(fn, args, capability=target.capability)
        return deviceless.compile_kernel(kernel, target, cache_dir)

    def call(self):
        """(fn, args): the kernel with its static arguments bound, and ShapeDtypeStruct inputs."""
        sds = jax.ShapeDtypeStruct
        b, k, r, d = self.batch, self.heads, self.rows, self.dim
        q = sds((b, k, r, d), jnp.dtype(self.q_dtype))
        lengths, slot = sds((b,), jnp.int32), sds((), jnp.int32)
        lead = (self.slots, b, k, self.seq)
        table = ()
        if self.page:  # every row's pages in a pool of as many
            n = self.seq // self.page
            lead, table = (self.slots, b * n, k, self.page), (sds((b, n), jnp.int32),)
        if not self.links:
            kv = sds(lead + (d,), jnp.dtype(self.kv))
            return da.dense_decode_attention, (q, kv, kv, lengths, slot, *table)

        def stream(bits, g):
            meta = sds(lead + (d // g,), jnp.dtype(self.meta))
            return ra.QuantStream(sds(lead + (d * bits // 8,), jnp.uint8), meta, meta)

        v_links = self.v_links or self.links
        keys, values = (tuple(stream(*ln) for ln in links) for links in (self.links, v_links))
        alphas = tuple(sds(lead, jnp.bfloat16) if self.alpha else None for _ in self.links[1:])
        means = tuple(sds((b, k, r), jnp.float32) for _ in self.links) if self.means else None
        fn = functools.partial(ra.residual_decode_attention, k_bits=tuple(x for x, _ in self.links),
                               v_bits=tuple(x for x, _ in v_links), k_group_sizes=tuple(g for _, g in self.links),
                               v_group_sizes=tuple(g for _, g in v_links))
        return fn, (q, keys, values, alphas, alphas, means, lengths, slot, *table)

    def tpu_call(self, generation: str):
        """(fn, args): `call()` for the TPU (Mosaic) kernel of `generation` ("v5e", ...: its `tpu_launch`
        entry), the same ShapeDtypeStruct inputs and chain arguments (a paged configuration's pool and block
        table included). Tracing it raises NotImplementedError for what the TPU kernel declines."""
        fn, args = self.call()
        tpu = tra.tpu_residual_decode_attention if self.links else tda.tpu_dense_decode_attention
        return functools.partial(tpu, generation=generation, **getattr(fn, "keywords", {})), args


def chain_name(links) -> str:
    return "-".join(f"int{b}g{g}" for b, g in links)


def schedule_configs(chains, dim: int, rows: int, prefix: str) -> tuple[KernelConfig, ...]:
    """The calls of a cache schedule's decode-kernel chains (`LoopQuant.kernel_chains`: (key links,
    value links) pairs) at head dim `dim` and `rows` query rows, named PREFIX-dD-rR-KEYCHAIN[-v-VALUECHAIN]."""
    out = []
    for k_links, v_links in chains:
        name = f"{prefix}-d{dim}-r{rows}-{chain_name(k_links)}" + (
            "" if v_links == k_links else f"-v-{chain_name(v_links)}")
        out.append(KernelConfig(name, dim, rows, tuple(k_links), None if v_links == k_links else tuple(v_links),
                                means=False))
    return tuple(out)


def _chains():
    out = []
    for g in (16, 32):
        out += [((b, g),) for b in (2, 4, 8)]                       # uniform / rotated / the anchor loop
        out += [((b, g), (4, g)) for b in (2, 4, 8)] + [((2, g), (2, g))]  # residual, last-loop reference
        out += [((2, g),) * (n - 1) + ((a, g),) for n in (3, 4) for a in (2, 4)]  # previous-loop reference
    return out + [((2, 16), (4, 32))]                                # mixed group sizes


DIMS = (64, 96, 128)
ROWS = (1, 32, 64)
CHAINS = tuple(_chains())


def _matrix() -> tuple[KernelConfig, ...]:
    out = []
    for links, d, r in itertools.product(CHAINS, DIMS, ROWS):
        out.append(KernelConfig(f"d{d}-r{r}-{chain_name(links)}", d, r, links))
    for links, d in itertools.product((((2, 16), (4, 16)), ((2, 32), (4, 32))), DIMS):  # GQA 8:1 at decode
        out.append(KernelConfig(f"d{d}-r8-{chain_name(links)}", d, 8, links))
    for n_links, d, r in itertools.product((1, 2, 3, 4), DIMS, (1, 64)):  # variations, INT2 g32 over INT4
        links = ((2, 32),) * (n_links - 1) + ((4, 32),)
        base = KernelConfig(f"d{d}-r{r}-{chain_name(links)}", d, r, links)
        for meta in ("bfloat16", "float16", "float32"):
            out.append(dataclasses.replace(base, name=f"{base.name}-{meta}meta", meta=meta))
        if n_links > 1:
            out.append(dataclasses.replace(base, name=f"{base.name}-noalpha", alpha=False))
        out.append(dataclasses.replace(base, name=f"{base.name}-nomeans", means=False))
    for kv, d, r in itertools.product(("bfloat16", "float32"), DIMS, ROWS):
        out.append(KernelConfig(f"dense-d{d}-r{r}-{kv}kv", d, r, kv=kv))
    return tuple(out)


#: The configurations of issue 23's resource table (S 4096, FP8 metadata, α, float32 queries, no key means).
ISSUE_TABLE = (
    KernelConfig("ouro-loop-d128-int2g32-int4g32", 128, 1, ((2, 32), (4, 32)), means=False),
    KernelConfig("ouro-anchor-d128-int4g32", 128, 1, ((4, 32),), means=False),
    KernelConfig("chain3-d128-int2g32-int2g32-int4g32", 128, 1, ((2, 32), (2, 32), (4, 32)), means=False),
    KernelConfig("gqa4-d64-int2g16-int4g16", 64, 4, ((2, 16), (4, 16)), means=False),
    KernelConfig("huginn-d96-int2g16-int4g16", 96, 1, ((2, 16), (4, 16)), means=False),
    KernelConfig("rows64-d128-int2g32-int4g32", 128, 64, ((2, 32), (4, 32)), means=False),
    KernelConfig("dense-d128-float32kv", 128, 1, kv="float32"),
    KernelConfig("dense-d128-bfloat16kv", 128, 1),
)

def paged(cfg: KernelConfig, page: int = 16) -> KernelConfig:
    """`cfg` over a pool of pages of `page` tokens (the serving engine's 16 by default), rows read through a
    block table, named pagedP-NAME."""
    return dataclasses.replace(cfg, name=f"paged{page}-{cfg.name}", page=page)


#: The issue table's calls over the engine's 16-token pages (`scripts/kernel_report.py --page 16` compiles
#: every configuration so).
PAGED = tuple(paged(c) for c in ISSUE_TABLE)

MATRIX = ISSUE_TABLE + _matrix() + PAGED
BY_NAME = {c.name: c for c in MATRIX}

#: Compiled on every test run (tests/kernels/test_compile.py), for both targets: the issue's table, then
#: the largest codes (INT8), dense float32 K/V at 64 rows, the two heaviest chains of the reconstructed-
#: key path (4-link g16 at head dims 128 and 96, launch.OVERRIDES) and Ouro's loop and dense bf16 over the
#: engine's 16-token pages: 28 compiles, which keeps a cold cache near two minutes (docs/performance.md).
#: The rest of MATRIX is compiled by scripts/kernel_report.py or
#: RQ_KERNEL_COMPILE=all.
CI_SUBSET = tuple(c.name for c in ISSUE_TABLE) + ("d128-r1-int8g32", "dense-d96-r64-float32kv",
                                                 "d128-r1-int2g16-int2g16-int2g16-int4g16",
                                                 "d96-r1-int2g16-int2g16-int2g16-int4g16",
                                                 "paged16-ouro-loop-d128-int2g32-int4g32",
                                                 "paged16-dense-d128-bfloat16kv")

#: A TPU pool's page: the TPU kernels' tiles hold tokens on the 128 lanes, and XLA:TPU relays out a pool of
#: smaller pages around the call (measured on v5e: 379 MiB of temporaries for Ouro's loop over a 57 MiB pool of
#: 16-token pages, none at 128): `scripts/kernel_report.py --tpu v5e --page 128`.
TPU_PAGE = 128

#: Compiled for v5e and v6e on every test run where libtpu is installed (tests/kernels/test_tpu_report.py):
#: Ouro's loop and anchor, the 3-link chain, Huginn's head dim, the 4-link g16 chain that takes the most
#: VMEM, dense bf16 and f32 K/V, INT8 codes at head dim 128 (read token-major) and float16 metadata (read as
#: its bits). `scripts/kernel_report.py --tpu` compiles the rest of MATRIX (its
#: contiguous configurations; `--page 128` the pooled ones).
TPU_CI_SUBSET = ("ouro-loop-d128-int2g32-int4g32", "ouro-anchor-d128-int4g32", "chain3-d128-int2g32-int2g32-int4g32",
                 "huginn-d96-int2g16-int4g16", "d96-r1-int2g16-int2g16-int2g16-int4g16", "dense-d128-bfloat16kv",
                 "dense-d128-float32kv", "d128-r1-int8g32", "d64-r1-int2g32-int4g32-float16meta")
#: With them, Ouro's loop and dense bf16 over a pool of TPU_PAGE-token pages, read through a block table.
TPU_CI_PAGED = tuple(paged(BY_NAME[n], TPU_PAGE) for n in ("ouro-loop-d128-int2g32-int4g32", "dense-d128-bfloat16kv"))
