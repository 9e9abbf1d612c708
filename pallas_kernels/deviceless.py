"""Compile the Pallas kernels for NVIDIA GPUs without a GPU: lowering, Triton's CUDA stages, ptxas.

jax lowers a Triton-backend `pallas_call` for the "cuda" platform into a `__gpu$xla.gpu.triton` custom
call whose backend config holds the kernel's Triton IR (MLIR bytecode) with its `num_warps` and
`num_stages`. The pip `triton` wheel parses that IR and runs its own CUDA pipeline on it for a chosen
`GPUTarget` — make_ttir (jax's IR is not canonicalised), ttgir, llir, ptx — and its bundled `ptxas -v`
turns the PTX into a cubin and reports registers and spills. Neither step needs a GPU or a driver.

XLA compiles the same IR with the Triton it was built with, so these figures are Triton's pipeline at
the wheel's version (pinned in pyproject's test extra), not a measurement of the binary XLA launches.

    kernels = triton_kernels(fn, args, capability=90)     # lower; one entry per pallas_call
    res = compile_kernel(kernels[0], TARGETS["sm_90"])   # Resources (cached by IR hash)
    problems(res)                                        # [] when it fits without spilling

`triton` is imported only here, lazily: the kernels themselves do not need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import subprocess
import tempfile
import time
from typing import NamedTuple

import jax
import jaxlib
from jax._src.lib.mlir import ir

TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to compile for: `capability` as Triton spells it (90 = sm_90), the most dynamic shared
    memory one block may use (bytes) and one SM has, its register file per SM (32-bit registers) and
    the most resident warps per SM."""

    name: str
    capability: int
    max_shared: int
    shared_per_sm: int
    registers_per_sm: int = 65536
    max_warps_per_sm: int = 64


#: Hopper (H100/H200: 227 KiB of shared memory per block, 228 per SM) and Ampere (A100: 163 / 164 KiB).
TARGETS = {
    "sm_90": Target("sm_90", 90, 227 * 1024, 228 * 1024),
    "sm_80": Target("sm_80", 80, 163 * 1024, 164 * 1024),
}


class TritonKernel(NamedTuple):
    """One `pallas_call` as XLA would receive it: its name, Triton IR bytecode and launch parameters."""

    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Resources:
    """What Triton + ptxas report for one kernel on one target.

    shared: dynamic shared memory per block (bytes, Triton's allocation); registers per thread;
    spill_stores / spill_loads: bytes ptxas spills to local memory; stack: stack frame bytes;
    tensor_cores: "wgmma" (Hopper warpgroup MMA), "mma" (mma.sync) or "none", read from the PTX;
    seconds: compile time (0 when the result came from the cache).
    """

    kernel: str
    target: str
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    tensor_cores: str
    ir_hash: str
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class CompileError(RuntimeError):
    """Triton or ptxas rejected a kernel's IR."""


# ---- lowering ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _lowering_capability(capability: int):
    """Make jax lower Triton kernels for `capability`: off a GPU it assumes sm_90, which decides which
    casts it accepts (float8 needs >= 89)."""
    from jax._src.pallas.triton import lowering  # platform: jax._src's Triton lowering, patched only to lower for CUDA

    original = lowering.lower_jaxpr_to_triton_module

    def lower(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx):
        del compute_capability
        return original(jaxpr, grid_mapping, platform, capability, mlir_ctx)

    lowering.lower_jaxpr_to_triton_module = lower
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def triton_kernels(fn, args, *, capability: int = 90) -> list[TritonKernel]:
    """Lower `jax.jit(fn)(*args)` (args: arrays or ShapeDtypeStructs) for CUDA at `capability` and
    return every Triton kernel it embeds, in program order."""
    with _lowering_capability(capability):
        module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    out = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if (child.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL):
                        cfg = ir.DictAttr(child.attributes["mhlo.backend_config"])
                        ints = {k: ir.IntegerAttr(cfg[k]).value
                                for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
                        out.append(TritonKernel(ir.StringAttr(cfg["name"]).value, ir.StringAttr(cfg["ir"]).value_bytes,
                                                ints["num_warps"], ints["num_stages"],
                                                (ints["grid_x"], ints["grid_y"], ints["grid_z"])))
                    walk(child.operation)

    walk(module.operation)
    return out


# ---- Triton's CUDA pipeline and ptxas -------------------------------------------------------------


@functools.cache
def toolchain_versions() -> dict[str, str]:
    """Versions that decide the compiled result: triton, its ptxas, jax and jaxlib."""
    import triton  # optional: triton (the [test] extra), as below
    from triton.backends.nvidia.compiler import get_ptxas_version

    ptxas = re.search(r"release (\S+),", get_ptxas_version(90))
    return {"triton": triton.__version__, "ptxas": ptxas.group(1) if ptxas else "?",
            "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def default_cache_dir() -> pathlib.Path:
    """$RQ_KERNEL_CACHE, else ~/.cache/rq_jax/kernels."""
    return pathlib.Path(os.environ.get("RQ_KERNEL_CACHE") or pathlib.Path.home() / ".cache" / "rq_jax" / "kernels")


def ir_hash(kernel: TritonKernel, target: Target) -> str:
    """Cache key: the IR, the launch parameters, the target and the toolchain versions."""
    h = hashlib.sha256(kernel.ir)
    h.update(json.dumps([kernel.num_warps, kernel.num_stages, target.capability, toolchain_versions()]).encode())
    return h.hexdigest()[:32]


_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _tensor_cores(ptx: str) -> str:
    if re.search(r"\bwgmma\.mma_async", ptx):
        return "wgmma"
    return "mma" if re.search(r"\bmma\.sync", ptx) else "none"


def _compile(kernel: TritonKernel, target: Target) -> dict:
    """ttir -> ttgir -> llir -> ptx with the wheel's CUDA backend, then ptxas -v; resource fields."""
    # optional: triton (the [test] extra: its CUDA backend and ptxas), as below
    from triton._C.libtriton import ir as tir
    from triton.backends.compiler import GPUTarget, Language
    from triton.backends.nvidia.compiler import CUDABackend, get_ptxas, sm_arch_from_capability

    backend = CUDABackend(GPUTarget("cuda", target.capability, 32))
    options = backend.parse_options({"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    context = tir.context()
    tir.load_dialects(context)
    backend.load_dialects(context)
    stages: dict = {}
    backend.add_stages(stages, options, Language.TRITON)
    metadata: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp, "kernel.mlirbc")
        path.write_bytes(kernel.ir)
        try:
            module = tir.parse_mlir_module(str(path), context)
            module.context = context
            for stage in ("ttir", "ttgir", "llir", "ptx"):
                module = stages[stage](module, metadata)
        except Exception as e:  # Triton raises plain RuntimeErrors from its pass managers
            raise CompileError(f"{kernel.name} for {target.name}: Triton failed ({e})") from e
        ptx = pathlib.Path(tmp, "kernel.ptx")
        ptx.write_text(module)
        # Triton's own ptxas flags (backends/nvidia/compiler.py make_cubin), with -v kept.
        cmd = [get_ptxas(target.capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(target.capability)}", str(ptx), "-o", str(ptx) + ".cubin"]
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise CompileError(f"{kernel.name} for {target.name}: ptxas failed: {run.stderr.strip()[-2000:]}")
    spills, regs = _PTXAS_SPILLS.search(run.stderr), _PTXAS_REGS.search(run.stderr)
    if not spills or not regs:
        raise CompileError(f"{kernel.name} for {target.name}: unexpected ptxas output: {run.stderr[-2000:]}")
    return dict(shared=int(metadata["shared"]), registers=int(regs.group(1)), stack=int(spills.group(1)),
                spill_stores=int(spills.group(2)), spill_loads=int(spills.group(3)), tensor_cores=_tensor_cores(module))


def compile_kernel(kernel: TritonKernel, target: Target, cache_dir: pathlib.Path | None = None) -> Resources:
    """Resources of `kernel` compiled for `target`; results are cached as JSON under `cache_dir`
    (default `default_cache_dir()`) by `ir_hash`. Raises CompileError when Triton or ptxas fails."""
    key = ir_hash(kernel, target)
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = cache / f"{key}.json"
    base = dict(kernel=kernel.name, target=target.name, num_warps=kernel.num_warps, num_stages=kernel.num_stages,
                ir_hash=key)
    if entry.exists():
        with contextlib.suppress(ValueError, TypeError):
            return Resources(**base, **json.loads(entry.read_text()))
    start = time.perf_counter()
    fields = _compile(kernel, target)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(fields))
    tmp.replace(entry)
    return Resources(**base, **fields, seconds=round(time.perf_counter() - start, 2))


def problems(res: Resources) -> list[str]:
    """Why a compiled kernel is not acceptable (empty when it is): spills, or more shared memory or
    registers than its target has for one block."""
    target = TARGETS[res.target]
    out = []
    if res.spill_stores or res.spill_loads:
        out.append(f"spills {res.spill_stores} B stored / {res.spill_loads} B loaded")
    if res.shared > target.max_shared:
        out.append(f"shared memory {res.shared} B > {target.max_shared} B")
    if res.registers * res.num_warps * 32 > target.registers_per_sm:
        out.append(f"{res.registers} registers x {res.num_warps * 32} threads > {target.registers_per_sm}")
    return out


def blocks_per_sm(res: Resources) -> int:
    """Blocks of this kernel one SM can hold at once, by registers (allocated per warp in units of 256),
    shared memory and warps: the occupancy ptxas's register count implies."""
    target = TARGETS[res.target]
    regs_per_warp = -(-res.registers * 32 // 256) * 256
    by_regs = target.registers_per_sm // (regs_per_warp * res.num_warps)
    by_shared = target.shared_per_sm // res.shared if res.shared else by_regs
    return min(by_regs, by_shared, target.max_warps_per_sm // res.num_warps)


@functools.cache
def triton_available() -> bool:
    """Whether the pip `triton` wheel (with its CUDA backend and ptxas) can be imported."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401  # optional: triton (the [test] extra)
    except ImportError:
        return False
    return True
