"""The kernel ops: one entry point each for every format's attention to its stored past (`DENSE`, `PACKED`)
and for the packed write's encoder (`ENCODE`), with ordered implementations and a logged reason on every
fallback.

A format registers, per implementation name, a function of the op's arguments (`KernelOp`); `attend_impl`
and `write_impl` (policy fields of the formats) name the one to try first:

    "auto"     the kernel of the platform the program is lowered for, then XLA: "pallas" (the Triton
               kernels) on a CUDA GPU, "pallas-tpu" (the Mosaic kernels) on a TPU, "native" (the C++ kernels
               of `cpu_kernels`, through the XLA FFI) on a CPU, XLA alone elsewhere
    "xla"      the jnp implementation (always there; every other one falls back to it)
    NAME       that implementation, then XLA

"auto" follows the lowering platform, not the host's default backend (`jax.lax.platform_dependent`): each
platform's chain is traced, and only the one of the platform being compiled for is lowered, so a TPU
program compiled on a CPU host (`pallas_kernels.tpu_deviceless`) inlines the TPU kernel. While a chain is
traced, `target()` names its platform (a kernel compiles for it, or runs in interpret mode off it). A program
that runs where it is traced (the Sampler's, the eval loops', the serving runner's: `rq_jax.setup.jit`) is
traced `for_host`: "auto" then traces the host platform's chain alone. Tracing every platform's chain took
most of a residual program's trace (Ouro-small's decode program: 2.3 s against 0.6 s for the CPU's chain
alone), and a server traces each of its ~40 programs at every start, from its compile cache or not.

A kernel (any implementation but XLA) of a differentiable op is differentiated as the XLA implementation
(`base.with_gradient_of`); the encoder is not differentiated (training reads K/V through `fake_quant`).
An implementation raises NotImplementedError (at trace time) for what it does not cover — a head dim, bit
width or dtype outside the kernel, the native library not built here — and the op logs the reason (once
per op, implementation and reason under "auto") and tries the next. A `visible` mask goes to XLA directly:
no kernel takes one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Any, Callable

import jax

from rq_jax.cache import base

log = logging.getLogger(__name__)

#: Implementation names in the order "auto" considers them, with the lowering platform each needs (None: any).
IMPLEMENTATIONS = {"pallas": "cuda", "pallas-tpu": "tpu", "native": "cpu", "xla": None}
_WARNED: set[tuple[str, str, str]] = set()
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("rq_jax_attention_target", default=None)
_HOST_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("rq_jax_attention_host_only", default=False)


def host_platform() -> str:
    """The default backend as a lowering platform name ("cpu", "cuda", "tpu")."""
    backend = jax.default_backend()
    return "cuda" if backend == "gpu" else backend


def target() -> str:
    """The platform the implementation being traced is for: an "auto" chain's platform while it is traced,
    else the host's (`host_platform`)."""
    return _TARGET.get() or host_platform()


def for_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, with every op's "auto" tracing only the chain of the host's platform (`host_platform`) while
    `fn` runs: for a function traced by a program that runs on this host's default backend."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        token = _HOST_ONLY.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _HOST_ONLY.reset(token)

    return traced


@contextlib.contextmanager
def _targeting(platform: str):
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def check_impl(name: str, impl: str) -> None:
    """Raise ValueError naming the choices when `impl` is not "auto" or an implementation name."""
    if impl != "auto" and impl not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: unknown attend_impl {impl!r}: available {['auto', *IMPLEMENTATIONS]}")


def order(impl: str, platform: str | None = None) -> tuple[str, ...]:
    """The implementations to try for `impl` on lowering platform `platform` (default: the host's), first
    to last ("xla" always last)."""
    platform = platform or host_platform()
    if impl == "auto":
        first = [name for name, needs in IMPLEMENTATIONS.items() if needs == platform]
    else:
        first = [impl]
    return tuple(dict.fromkeys([*first, "xla"]))


class KernelOp:
    """One op (attention over dense K/V or over packed chains, the packed write's encoder): implementations
    by name, each a function of the same arguments with the same result, registered with `register`."""

    def __init__(self, name: str, field: str = "attend_impl", differentiable: bool = True):
        self.name = name
        self.field = field  # the policy field naming the implementation (logged on a fallback)
        self.differentiable = differentiable
        self.impls: dict[str, Callable[..., Any]] = {}

    def register(self, impl: str):
        """Decorator registering `fn` as implementation `impl` of this op."""
        def wrap(fn):
            self.impls[impl] = fn
            return fn

        return wrap

    def __call__(self, impl: str, *args, who: str = "") -> Any:
        """The first implementation of `order(impl)` this op has that covers `args`; every one that raises
        NotImplementedError is logged (with its reason) and passed over. Under "auto", one such chain per
        platform with a kernel here, picked by the platform the program is lowered for (within `for_host`,
        the host's chain alone). `who` names the caller in the log."""
        if impl != "auto" or _HOST_ONLY.get():
            return self._first(order(impl), impl, who, *args)
        chains = {platform: functools.partial(self._first, order(impl, platform), impl, who, *args, platform=platform)
                  for name, platform in IMPLEMENTATIONS.items() if platform and name in self.impls}
        xla = functools.partial(self._first, ("xla",), impl, who, *args)
        return jax.lax.platform_dependent(**chains, default=xla) if chains else xla()

    def _first(self, tried: tuple[str, ...], impl: str, who: str, *args, platform: str | None = None):
        """The partial of the first implementation of `tried` that covers `args`, traced for `platform`
        (`target()`); a fallback is logged as a warning for the host's platform, at info level for another
        (a chain that may never be lowered)."""
        with _targeting(platform or host_platform()):
            for name in tried:
                fn = self.impls.get(name)
                if fn is None:
                    continue
                try:
                    if name == "xla" or not self.differentiable:
                        return fn(*args)
                    return base.with_gradient_of(self.impls["xla"], fn, *args)  # kernels differentiate as XLA
                except NotImplementedError as why:
                    if name == tried[-1]:
                        raise
                    key = (self.name, name, str(why))
                    if impl != "auto" or key not in _WARNED:
                        _WARNED.add(key)
                        level = logging.WARNING if target() == host_platform() else logging.INFO
                        log.log(level, "%s %s=%r does not cover this slot (%s); using %s", who or self.name,
                                self.field, name, why, tried[tried.index(name) + 1])
        raise NotImplementedError(f"{self.name}: no implementation of {tried} is registered")


#: Attention over dense K/V (`Dense`) and over packed loop-group chains (`LoopQuant`), and the encoder of a
#: `LoopQuant` write (a loop group's rotated K or V to its stored codes, metadata and α).
DENSE = KernelOp("dense")
PACKED = KernelOp("packed chains")
ENCODE = KernelOp("encode", field="write_impl", differentiable=False)
