"""Compile Pallas TPU (Mosaic) kernels for a TPU without one: the real Mosaic and XLA:TPU compilers of libtpu,
run on a CPU host for a named topology.

`jax.experimental.topologies.get_topology_desc(platform="tpu", ...)` gives the devices of a TPU topology;
arguments placed on one of them (`ShapeDtypeStruct(..., sharding=SingleDeviceSharding(dev))`) make
`jax.jit(f).lower(...).compile()` run libtpu's compilers, which refuse what the chip would: a kernel over its
scoped VMEM limit fails with RESOURCE_EXHAUSTED, a block that breaks the tiling rules fails in Mosaic. libtpu
wants TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES when no TPU is present; `quiet_libtpu` sets them (unless
already set) when `pallas_kernels` is imported on a host with libtpu and no TPU, so that jax's backend probe
passes over the TPU silently (libtpu would print errors to stderr) and these compiles work.

    res = compile_for(fn, [jax.ShapeDtypeStruct(...), ...], "v5e")   # TpuCompile, never raises on a refusal
    res.ok, res.error, res.custom_calls, res.vmem_limits, res.vmem_used, res.generated_code_bytes, res.temp_bytes

`libtpu` is looked up lazily, only here: the kernels and their interpret mode do not need it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import os
import re
import time
from pathlib import Path

import jax

#: A topology of each generation (`1x1` is refused by libtpu: the smallest slices).
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
#: HBM per chip, GiB, as Google's TPU pages give it: what a whole program compiled for one chip may take.
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
#: What libtpu needs in the environment off a TPU host (any accelerator type serves every topology above).
#: A deviceless compile touches no chip, so several processes (pytest-xdist workers) may load libtpu at once.
ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
MOSAIC_CALL = "tpu_custom_call"
#: The PCI vendor id of Google's TPU chips (what jax's own hardware_utils looks for in sysfs).
GOOGLE_PCI_VENDOR = "0x1ae0"

_CUSTOM_CALL = re.compile(r"%(\S+) = .*?custom-call\(.*?custom_call_target=\"([^\"]+)\"")
_SCOPED = re.compile(r"\"scoped_memory_configs\":\[\{[^\]]*?\"size\":\"(\d+)\"")
_USED = re.compile(r"\"used_scoped_memory_configs\":\[\{[^\]]*?\"size\":\"(\d+)\"")


@dataclasses.dataclass(frozen=True)
class TpuCompile:
    """One compile for one generation.

    ok: both compilers accepted it; error: the first lines of their refusal ("" when ok); custom_calls:
    (HLO op name, call target) of every custom call in the compiled HLO (a Pallas kernel: its `name`, and
    target "tpu_custom_call"); vmem_limits: the scoped VMEM limit (bytes) of each Mosaic call, from its
    backend config; vmem_used: the scoped VMEM (bytes) each Mosaic call's compiled kernel takes of that
    limit (the backend config's used_scoped_memory_configs); generated_code_bytes, temp_bytes,
    argument_bytes, output_bytes: the compiled program's `memory_analysis()` (HBM; -1 when not ok);
    seconds: lower + compile time.
    """

    generation: str
    topology: str
    ok: bool
    error: str
    custom_calls: tuple[tuple[str, str], ...]
    vmem_limits: tuple[int, ...]
    vmem_used: tuple[int, ...]
    generated_code_bytes: int
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def kernels(self) -> tuple[str, ...]:
        """Op names of the Mosaic kernels (custom calls to "tpu_custom_call") in the compiled HLO."""
        return _mosaic(self.custom_calls)


def custom_calls(hlo: str) -> tuple[tuple[str, str], ...]:
    """(HLO op name, call target) of every custom call in an HLO module's text."""
    return tuple(_CUSTOM_CALL.findall(hlo))


def mosaic_calls(hlo: str) -> tuple[str, ...]:
    """Op names of the Mosaic kernels (custom calls to "tpu_custom_call") in an HLO module's text."""
    return _mosaic(custom_calls(hlo))


def kernel_counts(hlo: str) -> dict[str, int]:
    """How many call sites of each Mosaic kernel an HLO module's text has, by kernel name (the op name
    without XLA's ".N" suffix), most first."""
    names = [re.sub(r"\.\d+$", "", name) for name in mosaic_calls(hlo)]
    return dict(collections.Counter(names).most_common())


def _mosaic(calls) -> tuple[str, ...]:
    """The op names of the (op name, target) custom calls whose target is MOSAIC_CALL."""
    return tuple(name for name, target in calls if target == MOSAIC_CALL)


@functools.cache
def libtpu_available() -> bool:
    """Whether the `libtpu` package (jax[tpu]'s compiler) is installed here."""
    return importlib.util.find_spec("libtpu") is not None


def tpu_attached() -> bool:
    """Whether a TPU chip is on this host's PCI bus (Linux sysfs; False where there is none)."""
    for vendor in Path("/sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor.read_text().strip() == GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def quiet_libtpu() -> None:
    """Set ENV (each unless already set) where libtpu is installed and no TPU is attached: jax's backend probe
    then finds no TPU without libtpu printing errors to stderr, and `topology` works. A no-op elsewhere."""
    if libtpu_available() and not tpu_attached():
        for name, value in ENV.items():
            os.environ.setdefault(name, value)


@functools.cache
def topology(generation: str):
    """The `TopologyDescription` of `generation` ("v4", "v5e", "v5p", "v6e"; TOPOLOGIES), ENV set first.
    ValueError for an unknown generation; RuntimeError when libtpu is missing or refuses."""
    if generation not in TOPOLOGIES:
        raise ValueError(f"unknown TPU generation {generation!r}: choose from {sorted(TOPOLOGIES)}")
    if not libtpu_available():
        raise RuntimeError("libtpu is not installed (pip install 'jax[tpu]' pinned to the jaxlib in use)")
    from jax.experimental import topologies

    quiet_libtpu()
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[generation])
    except Exception as e:  # libtpu's plugin raises XlaRuntimeError / RuntimeError / ValueError
        raise RuntimeError(f"libtpu refused topology {TOPOLOGIES[generation]}: {e}") from e


def place(args, generation: str):
    """`args` (a pytree of arrays or ShapeDtypeStructs) as ShapeDtypeStructs on the first device of
    `generation`'s topology."""
    sharding = jax.sharding.SingleDeviceSharding(topology(generation).devices[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)


def _summary(e: Exception) -> str:
    """The first three non-empty lines of a compiler error, on one line (at most 500 characters)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (" | ".join(lines[:3]) or type(e).__name__)[:500]


def compile_for(fn, args, generation: str) -> TpuCompile:
    """Lower and compile `jax.jit(fn)(*args)` for `generation` (args: arrays or ShapeDtypeStructs, placed by
    `place`). A compiler refusal is returned (ok=False, its first lines in `error`), not raised; errors of the
    Python trace itself (bad shapes, a kernel's own NotImplementedError) propagate."""
    placed = place(args, generation)
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*placed)
    try:
        compiled = lowered.compile()
    except Exception as e:  # libtpu raises XlaRuntimeError (RESOURCE_EXHAUSTED, Mosaic failures) and others
        return TpuCompile(generation, TOPOLOGIES[generation], False, _summary(e), (), (), (), -1, -1, -1, -1,
                          round(time.perf_counter() - start, 3))
    seconds = round(time.perf_counter() - start, 3)
    hlo = compiled.as_text()
    calls = custom_calls(hlo)
    mosaic = [line for line in hlo.splitlines() if f'custom_call_target="{MOSAIC_CALL}"' in line]
    limits = tuple(int(x) for line in mosaic for x in _SCOPED.findall(line))
    used = tuple(int(x) for line in mosaic for x in _USED.findall(line))
    mem = compiled.memory_analysis()
    return TpuCompile(generation, TOPOLOGIES[generation], True, "", calls, limits, used,
                      int(mem.generated_code_size_in_bytes), int(mem.temp_size_in_bytes),
                      int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes), seconds)
