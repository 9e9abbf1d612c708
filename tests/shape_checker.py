"""The suite's runtime checker of rq_jax's array annotations (pyproject's `--jaxtyping-packages`).

jaxtyping's import hook wraps every function of rq_jax with `jaxtyped(typechecker=check)`, which binds
each axis name (`rq_jax.shapes`) to one size across a call's arguments and its result. `check` has
beartype check only the hints that hold a jaxtyping array type: plain hints (`jax.Array`, `int`,
`KVCache`) name no axes, and the tests of bad input pass the wrong types to them on purpose, to reach
the code's own validation.
"""

import typing

import beartype
from jaxtyping import AbstractArray


def _holds_array(hint) -> bool:
    if isinstance(hint, (list, tuple)):  # a Callable's argument list
        return any(map(_holds_array, hint))
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return True
    return any(map(_holds_array, typing.get_args(hint)))


def check(fn):
    """`fn` (the stand-in jaxtyping builds with a checked function's signature) under beartype, its
    annotations cut to those that hold a jaxtyping array type."""
    fn.__annotations__ = {name: hint for name, hint in fn.__annotations__.items() if _holds_array(hint)}
    return beartype.beartype(fn)
