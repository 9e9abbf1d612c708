"""Build the native kernels on first use, into a cache folder keyed by the sources and the compiler.

`library()` returns the path of `librq_cpu.so`, compiling it when no build for this exact input exists:
the key hashes every file of `src/`, the compiler's `--version`, the flags and jaxlib's version (the FFI
headers come from `jax.ffi.include_dir()`). `attention.cc` and `encode.cc` are compiled once per instruction set
(`ISAS`: the x86-64 baseline, AVX2 + FMA + F16C, AVX-512) and the library picks one at load time by what the
CPU supports; nothing is built with `-march=native`, so a cache folder shared between machines stays
loadable on each. Concurrent first uses (test workers) wait on a file lock and build once.

    folder: $RQ_JAX_NATIVE_CACHE, else ~/.cache/rq_jax/cpu_kernels/KEY/
    compiler: $CXX, else g++ (else c++)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

SRC = Path(__file__).resolve().parent / "src"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros")
#: The encoder's: every operation rounded as written (no reassociation, no fused multiply-add), so that it
#: computes the same bits as rq_jax's XLA encoder.
EXACT_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
#: Per instruction set: the -D name attention.cc's entry point takes and the flags it is compiled with.
ISAS = {"generic": ()}
if platform.machine() in ("x86_64", "AMD64"):
    ISAS.update(avx2=("-mavx2", "-mfma", "-mf16c"),
                avx512=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                        "-mprefer-vector-width=512"))


class BuildError(RuntimeError):
    """The native kernels could not be built here (no compiler, or it failed); the message says why."""


def compiler() -> str:
    """The C++ compiler to use: $CXX, else g++ or c++ on the PATH. Raises BuildError when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C++ compiler found ($CXX, g++, c++)")


def _key(cxx: str) -> str:
    h = hashlib.sha256()
    for path in sorted(SRC.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    h.update(version.encode() + repr((FLAGS, EXACT_FLAGS, ISAS, jaxlib.__version__)).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """Where builds are kept: $RQ_JAX_NATIVE_CACHE, else ~/.cache/rq_jax/cpu_kernels."""
    return Path(os.environ.get("RQ_JAX_NATIVE_CACHE", Path.home() / ".cache" / "rq_jax" / "cpu_kernels"))


def library() -> Path:
    """The path of the built library, building it first when needed. Raises BuildError."""
    cxx = compiler()
    folder = cache_root() / _key(cxx)
    lib = folder / "librq_cpu.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            _compile(cxx, lib)
    return lib


def _run(*cmds: list[str]) -> None:
    """Run the commands at once (the compiles are independent); raise BuildError naming the first that failed."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in cmds]
    for cmd, proc in zip(cmds, procs):
        _, err = proc.communicate()
        if proc.returncode:
            raise BuildError(f"{Path(cmd[0]).name} failed ({' '.join(cmd[1:4])} ...): {err.strip()[-2000:]}")


def _compile(cxx: str, lib: Path) -> None:
    include = ("-I", jax.ffi.include_dir(), "-I", str(SRC))
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        compiles, objects = [], []
        for isa, flags in ISAS.items():
            for source, source_flags in (("attention", FLAGS), ("encode", EXACT_FLAGS)):
                objects.append(f"{tmp}/{source}_{isa}.o")
                compiles.append([cxx, *source_flags, *flags, f"-DRQ_ISA={isa}", *include, "-c",
                                 str(SRC / f"{source}.cc"), "-o", objects[-1]])
        objects.append(f"{tmp}/ffi.o")
        compiles.append([cxx, *FLAGS, *include, "-c", str(SRC / "ffi.cc"), "-o", objects[-1]])
        _run(*compiles)
        _run([cxx, "-shared", "-o", f"{tmp}/librq_cpu.so", *objects, "-lpthread"])
        os.replace(f"{tmp}/librq_cpu.so", lib)
