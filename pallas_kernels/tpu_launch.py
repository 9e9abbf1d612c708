"""Launch parameters of the TPU (Mosaic) decode kernels: tokens per grid step and the scoped VMEM limit, per
TPU generation and kernel.

Unlike `launch.py`, the entries are not a timing sweep (no TPU is at hand). Each block is a power of two
large enough that one grid step's K and V read (bf16, head dim 128: 512 KiB at 1024 tokens, ~0.6 us of a
v5e's HBM bandwidth) outweighs the ~0.35 us fixed cost of a Pallas TPU grid step, while the double-buffered
K and V tiles at head dim 256 take at most a quarter of the limit. The limit is the generation's default
scoped VMEM or less (v4's whole VMEM is 16 MiB; v5e/v6e have 128 MiB and v5p 64 MiB, of which XLA scopes
16-32 MiB to a kernel by default). `tpu_deviceless` compiles the entries with the real Mosaic and XLA:TPU
compilers (tests/kernels/test_tpu_attention.py), which is what proves they fit; timing them is left to a
real TPU.

A generation is named as `jax.experimental.topologies` names topologies: "v4", "v5e", "v5p", "v6e".
"""

from __future__ import annotations

from typing import NamedTuple

import jax

MIB = 1 << 20
GENERATIONS = ("v4", "v5e", "v5p", "v6e")
#: The generation assumed when a kernel is traced off a TPU with none named (e.g. interpret mode on a CPU).
DEFAULT_GENERATION = "v5e"


#: Query rows per grid step (a multiple of 8 sublanes): a call with more (a prompt chunk's T·H/K rows) runs
#: them in blocks of this many, each reading the context again; decode's rows (H/K, at most 64 in the
#: configuration matrix) take one block. Without it, a 2048-token chunk's [2048, block] float32 scores alone
#: took 8 MiB of v5e's 16 MiB scoped VMEM, and its prefill did not compile.
ROW_BLOCK = 64


def row_block(rows: int) -> int:
    """Query rows per grid step of a call with `rows` rows per kv head: all of them, or ROW_BLOCK."""
    return min(rows, ROW_BLOCK)


class TpuLaunch(NamedTuple):
    """Context tokens per grid step (the online-softmax block; a multiple of 128) and the kernel's scoped
    VMEM limit in bytes (CompilerParams.vmem_limit_bytes)."""

    block_s: int
    vmem_limit_bytes: int


TABLE: dict[tuple[str, str], TpuLaunch] = {
    ("v4", "dense-bfloat16"): TpuLaunch(512, 12 * MIB),
    ("v4", "dense-float32"): TpuLaunch(256, 12 * MIB),
    ("v5e", "dense-bfloat16"): TpuLaunch(1024, 16 * MIB),
    ("v5e", "dense-float32"): TpuLaunch(512, 16 * MIB),
    ("v5p", "dense-bfloat16"): TpuLaunch(1024, 16 * MIB),
    ("v5p", "dense-float32"): TpuLaunch(512, 16 * MIB),
    ("v6e", "dense-bfloat16"): TpuLaunch(2048, 32 * MIB),
    ("v6e", "dense-float32"): TpuLaunch(1024, 32 * MIB),
    # The packed chains (tpu_residual_attention): a step's DMA is small (head dim 128, [2, 4]: 96 code bytes
    # and 16 metadata bytes per token and stream), its VMEM is the float32 [D, block] tiles the chain is
    # reconstructed into (a few per link: 1 MiB each at head dim 256 and 1024 tokens), so the block is the
    # dense bf16 one capped at 1024.
    ("v4", "residual"): TpuLaunch(512, 12 * MIB),
    ("v5e", "residual"): TpuLaunch(1024, 16 * MIB),
    ("v5p", "residual"): TpuLaunch(1024, 16 * MIB),
    ("v6e", "residual"): TpuLaunch(1024, 32 * MIB),
}

#: `device_kind` strings of TPU devices (as jax reports them, real or from a topology) -> generation.
_KINDS = (("v6 lite", "v6e"), ("v6e", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"),
          ("v5", "v5p"), ("v4", "v4"))


def generation_of(device_kind: str) -> str:
    """The generation name of a TPU `device_kind` ("TPU v5 lite" -> "v5e", "TPU v6 lite" -> "v6e",
    "TPU v5" / "TPU v5p" -> "v5p", "TPU v4" -> "v4"); ValueError for anything else."""
    kind = device_kind.lower()
    for needle, gen in _KINDS:
        if needle in kind:
            return gen
    raise ValueError(f"not a TPU generation this table covers: device_kind {device_kind!r}")


def default_generation() -> str:
    """The default device's generation when it is a TPU, else DEFAULT_GENERATION."""
    dev = jax.devices()[0]
    return generation_of(dev.device_kind) if dev.platform == "tpu" else DEFAULT_GENERATION


def lookup(generation: str, kernel: str) -> TpuLaunch:
    """The launch entry of `kernel` ("dense-bfloat16", "dense-float32", "residual") on `generation`; ValueError when the
    table has none."""
    try:
        return TABLE[(generation, kernel)]
    except KeyError:
        raise ValueError(f"no TPU launch entry for {kernel!r} on {generation!r}: generations {GENERATIONS}, "
                         f"kernels {sorted({k for _, k in TABLE})}") from None
