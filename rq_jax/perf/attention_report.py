"""The decode-attention benchmark behind `scripts/bench_attention.py`: per (model, context, batch) every
scheme timed on every impl (`rq_jax.perf.attention`), its rows with their bandwidth fractions and
ratios to dense, and the table of them.

Columns: `impl` (the implementation the row asked for; "native→xla" when the op fell back to XLA for
this slot, the reason printed above the table and kept in the JSON's `fallback`), time (median of
--repeats; each timed call runs the step --inner times inside one executable to hide dispatch), the
cache bytes the step reads (`read_bits_per_element`: codes, metadata and α, a residual loop re-reading
its anchor), achieved GB/s on those bytes, that as a fraction of the copy bandwidth (`x + 1` over
--copy-mb MiB: read + write bytes per second) and of the read bandwidth (`jit(jnp.sum)` over --read-mb
MiB: read bytes per second, what XLA's own reduction reaches here; "% read BW" near 100% means the
step reads its bytes as fast as XLA reads an array, and a kernel reading faster than XLA's reduction
passes 100%), both bandwidths measured in the same run and printed in the header;
the speed ratio to the dense row of the same impl measured in the same run (the dense kernels on a GPU:
to the first impl's dense row), and the byte-limit ratio (dense bytes / format bytes: the most a format
can gain over a dense kernel at the same bandwidth; Ouro's residual [2,2,2,4]: 64 / 25.875 = 2.47x).
So "x vs dense" of a native row is the native format over native dense, never over XLA dense; compare
impls on "ms/step" of the same format. On a GPU the dense slot is also timed through the dense Pallas
kernel and JAX's `decode_attention` (the outside peer; impls "pallas", "jax-peer").
"""

from __future__ import annotations

import functools

import jax

from rq_jax import report
from rq_jax.cache.schemes import pick
from rq_jax.perf import attention as pa

COLUMNS = ("model", "batch", "context", "format", "impl", "stored", "ms/step", "MB read", "GB/s", "% copy BW",
           "% read BW", "x vs dense", "byte limit x")
#: The dense kernels timed beside the dense slot on a GPU (their ratios pair the first impl's dense row).
PEERS = ("pallas", "jax-peer")
DENSE = "dense bf16"


def header(copy_bw: float, read_bw: float, read_mb: int, impls: list[str]) -> str:
    """The run's one-line header: the device, both bandwidths and the impls."""
    device = jax.devices()[0]
    return (f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; copy bandwidth "
            f"{copy_bw / 1e9:.1f} GB/s (read+write); read bandwidth {read_bw / 1e9:.1f} GB/s (jit(jnp.sum) of "
            f"{read_mb} MiB); {pa.LOOPS} loops per step, one layer; queries float32, 1 token; impls "
            + pa.describe_impls(impls))


def cells(r: dict) -> tuple:
    """A row's cells under `COLUMNS`."""
    shown = r["impl"] + ("→xla" if r["fallback"] else "")
    return (r["model"], r["batch"], r["context"], r["format"], shown, r["stored"], f"{r['ms']:.3f}",
            f"{r['bytes'] / 2**20:.1f}", f"{r['gbps']:.1f}", f"{100 * r['copy_fraction']:.0f}%",
            f"{100 * r['read_fraction']:.0f}%", "-" if r["speedup"] is None else f"{r['speedup']:.2f}",
            f"{r['byte_limit']:.2f}")


def add_speedups(block: list[dict], first_impl: str) -> None:
    """Each row's speed ratio to the dense row of its impl in `block` (one model, context and batch; the
    dense kernels of `PEERS` against `first_impl`'s): dense_impl and speedup, None without that row."""
    dense_ms = {r["impl"]: r["ms"] for r in block if r["format"] == DENSE}
    for r in block:
        pair = first_impl if r["impl"] in PEERS else r["impl"]
        r["dense_impl"] = pair if pair in dense_ms else None
        r["speedup"] = dense_ms[pair] / r["ms"] if pair in dense_ms else None


def measure_block(model: str, context: int, batch: int, schemes, impls: list[str], args, bandwidths,
                  log=print) -> list[dict]:
    """The rows of one (model, context, batch): each scheme on each impl (`--impls`; a format without
    `attend_impl` on "xla" only), and on a GPU (unless `args.no_peer`) the dense slot through the dense
    kernels of `PEERS`; `args` gives repeats and inner, `bandwidths` is (copy, read) in bytes/s. A timing
    that fails (the peer may not cover a shape) or falls back is logged."""
    copy_bw, read_bw = bandwidths
    on_gpu = jax.default_backend() == "gpu"
    config = pa.attention_config(model, context)
    dense_bytes = pa.bytes_read(pick([DENSE])[0].fmt, config, 1, context)
    q = jax.random.normal(jax.random.key(0), (pa.LOOPS, batch, 1, config.num_heads, config.head_dim))
    block = []
    for scheme in schemes:
        cache, calib = pa.filled_cache(config, scheme.fmt, batch, context)
        own = list(dict.fromkeys(i if pa.takes_impl(scheme.fmt) or i == "auto" else "xla" for i in impls))
        entries = [(i, pa.step_fn(pa.with_impl(scheme.fmt, i)), (q, cache, calib)) for i in own]
        if on_gpu and not args.no_peer and scheme.label == DENSE:
            ((slot,),) = cache.values("looped")
            kq = q.reshape(pa.LOOPS, batch, config.num_kv_heads, -1, config.head_dim)
            k, v = (x.reshape(-1, *x.shape[2:]) for x in (slot.k, slot.v))
            entries += [(impl, pa.dense_kernel_fn(impl), (kq, k, v, cache.lengths)) for impl in PEERS]
        for impl, fn, fargs in entries:
            try:
                with pa.fallbacks() as fell:
                    secs = pa.timed(functools.partial(fn, inner=args.inner), fargs, args.repeats) / args.inner
            except Exception as err:  # the peer may not cover a shape (head dim 96)
                log(f"  {model} {scheme.label} {impl}: failed ({type(err).__name__}: {str(err)[:120]})")
                continue
            for message in fell:
                log(f"  {model} {scheme.label} {impl}: {message}")
            nbytes = pa.bytes_read(scheme.fmt, config, batch, context)
            block.append(dict(model=model, batch=batch, context=context, format=scheme.label, impl=impl,
                              fallback=fell or None, stored=scheme.stored, ms=1e3 * secs, bytes=nbytes,
                              gbps=nbytes / secs / 1e9, copy_fraction=nbytes / secs / copy_bw,
                              read_fraction=nbytes / secs / read_bw,
                              byte_limit=dense_bytes / pa.bytes_read(scheme.fmt, config, 1, context)))
        del cache
    add_speedups(block, impls[0])
    return block


def run(args, schemes, impls: list[str]) -> dict:
    """The whole run of `scripts/bench_attention.py`'s `args` over `schemes` on `impls`: both bandwidths
    measured, the header and the table printed as rows come; returns the run's JSON (header, device,
    platform, jax, copy_bandwidth, read_bandwidth, impls, args, rows)."""
    device = jax.devices()[0]
    copy_bw = pa.copy_bandwidth(args.copy_mb << 20, args.repeats)
    read_bw = pa.read_bandwidth(args.read_mb << 20, args.repeats)
    head = header(copy_bw, read_bw, args.read_mb, impls)
    print(head)
    print(report.row(COLUMNS))
    rows = []
    for model in args.models:
        for context in args.context:
            for batch in args.batch:
                block = measure_block(model, context, batch, schemes, impls, args, (copy_bw, read_bw))
                for r in block:
                    print(report.row(cells(r)), flush=True)
                rows += block
    return dict(header=head, device=device.device_kind, platform=device.platform, jax=jax.__version__,
                copy_bandwidth=copy_bw, read_bandwidth=read_bw, impls=impls, args=vars(args), rows=rows)


def page(result: dict) -> str:
    """A run's Markdown page: its header, then the table."""
    return result["header"] + "\n\n" + "\n".join(report.table(COLUMNS, map(cells, result["rows"]))) + "\n"
