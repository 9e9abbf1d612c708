"""What the command-line scripts share: the parser and argument types of `rq_jax.argtypes` (handed on
here, so a script needs `cli` alone), the model and cache-format options of generate.py and
serve.py with their checks against the model, output paths checked before any work, the runtime setup
(compile cache, quiet XLA), and the shipped checkpoints' defaults."""

from __future__ import annotations

import argparse
import contextlib
import os

import jax

from rq_jax import checkpoint, sharding
from rq_jax.argtypes import (ArgumentParser as ArgumentParser, HelpFormatter as HelpFormatter, divisors,
                             finite_float as finite_float, int_list as int_list, nonnegative_float as nonnegative_float,
                             nonnegative_int as nonnegative_int, positive_float as positive_float,
                             positive_int as positive_int, probability as probability,
                             spelled_command as spelled_command)
from rq_jax.cache import available_formats, get_format, init_cache
from rq_jax.cache.base import policy_fields
from rq_jax.cache.schemes import Scheme
from rq_jax.calibrate import load_calibration
from rq_jax.calibrate.allocate import load_schedule
from rq_jax.checkpoint import SHIPPED
from rq_jax.compilation import CompileClock, default_cache_dir, quiet_xla, use_persistent_cache
from rq_jax.tokenizer import STOP_STRINGS as STOP_STRINGS, eos_ids as eos_ids, stop_token_ids as stop_token_ids

#: The shipped checkpoint each --model runs without --checkpoint: the base models, whose sample sum
#: survives the default residual cache (Ouro's since it is trained with Ouro's objective, issue 26).
DEFAULT_CHECKPOINT = {"huginn": "huginn-small", "ouro": "ouro-small"}
#: 71226 + 98 with every number written least significant digit first (rq_jax.data.addition), the first
#: held-out addition example: the shipped models answer "423170" (071324) and stop at the newline.
SAMPLE_PROMPT = "62217+89000="
#: Cache options of the command line (argparse dest) -> the policy field they set; a format takes the
#: options whose field it has (`rq_jax.cache.base.policy_fields`), and --calibration when it reads one.
POLICY_OPTIONS = {"bits": "bits", "group_size": "group_size", "rotation": "rotation", "cache_dtype": "dtype",
                  "super_scale": "super_scale", "residual_length": "residual_length"}


def add_model_options(p: argparse.ArgumentParser, *, infer_family: bool = False) -> None:
    """--model, --checkpoint, --loops (alias --num-steps), --dtype and Huginn's --init-state. With
    `infer_family`, --model may be left out when --checkpoint is given (`resolve_checkpoint` reads it)."""
    p.add_argument("--model", choices=("huginn", "ouro"), required=not infer_family,
                   help="model family; runs its shipped small model unless --checkpoint is given" +
                   (" (default: the family --checkpoint's config names)" if infer_family else ""))
    p.add_argument("--checkpoint", help="checkpoint folder or cached hub id (default: checkpoints/huginn-small or "
                   "checkpoints/ouro-small)")
    p.add_argument("--loops", "--num-steps", dest="loops", type=positive_int,
                   help="loops (Ouro) or recurrence steps (Huginn); default the config's")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--init-state", choices=("zeros", "random"),
                   help="Huginn's initial latent state (default random, seeded by --seed)")


def resolve_checkpoint(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The checkpoint's `ModelConfig` and folder, read before any weights: --checkpoint, or --model's
    shipped one. Fills in --model from the config when it was left out; `p.error` for a checkpoint that
    cannot be read, another family than --model, or Huginn-only options on Ouro."""

    if args.checkpoint is None and args.model is None:
        p.error("give --model huginn or --model ouro (the shipped small models), or --checkpoint DIR")
    source = checkpoint_source(args)
    try:
        config, folder = checkpoint.read_config(source)
    except (OSError, ValueError) as err:
        p.error(f"argument --checkpoint: {err}")
    if args.model is None:
        args.model = config.family
    elif config.family != args.model:
        p.error(f"argument --model: {args.model}, but --checkpoint {source} holds a {config.family} model "
                f"(leave --model out to take the checkpoint's)")
    if args.model == "ouro" and getattr(args, "init_state", None):
        p.error("argument --init-state: Huginn's option; this is an Ouro model")
    return config, folder


def model_kwargs(args: argparse.Namespace) -> dict:
    """Model-call keywords from `add_model_options`: `num_loops` (None: the config's) and, for Huginn,
    `init_scale` (0 for --init-state zeros, else 1: a random initial state)."""
    kwargs = dict(num_loops=args.loops)
    if args.model == "huginn":
        kwargs["init_scale"] = 0.0 if args.init_state == "zeros" else 1.0
    return kwargs


def add_cache_options(p: argparse.ArgumentParser, default: str = "residual") -> None:
    """--cache and the format policy options (--bits, --group-size, ..., --calibration)."""

    p.add_argument("--cache", choices=available_formats(), default=default,
                   help="KV cache format" + (" (default: residual, bits 2,2,2,4)" if default == "residual" else ""))
    p.add_argument("--bits", type=int_list,
                   help="bits per loop in a group, e.g. 2,2,2,4 (residual) or 2 (uniform, kivi); default the format's")
    p.add_argument("--group-size", type=positive_int,
                   help="channel group size of the quantizers, a divisor of head_dim; default the format's (32)")
    p.add_argument("--rotation", choices=("identity", "hadamard", "random"),
                   help="uniform/rotated/residual: the rotation before quantizing; default the format's")
    p.add_argument("--cache-dtype", choices=("bfloat16", "float32"),
                   help="storage dtype of the dense cache (default: bfloat16)")
    p.add_argument("--super-scale", action="store_const", const=True,
                   help="uniform/rotated/residual: FP8 metadata relative to a per-vector bf16 super-scale")
    p.add_argument("--residual-length", type=positive_int,
                   help="kivi: recent tokens kept in full precision (default: 128)")
    p.add_argument("--calibration", help="calibration artifact (scripts/calibrate.py) or a folder holding one "
                   "for this schedule (default: the format's own, Hadamard)")
    p.add_argument("--schedule", metavar="FILE", help="residual: a bit-allocation schedule (scripts/allocate.py) "
                   "giving the bits and group sizes per loop, keys and values apart")


def check_cache_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`p.error` when an option of `add_cache_options` is given that --cache does not take."""

    fields = policy_fields(args.cache)
    extra = [name for name, field in POLICY_OPTIONS.items() if getattr(args, name) is not None and field not in fields]
    if args.calibration is not None and not get_format(args.cache).needs_calib:
        extra.append("calibration")
    if args.schedule is not None and args.cache != "residual":
        extra.append("schedule")
    if extra:
        p.error(f"--cache {args.cache} does not take {', '.join('--' + e.replace('_', '-') for e in extra)}")


def cache_policy(args: argparse.Namespace) -> dict:
    """Keyword arguments of the chosen cache format from the command line (only those given)."""
    return {field: getattr(args, name) for name, field in POLICY_OPTIONS.items() if getattr(args, name) is not None}


def check_group_sizes(p: argparse.ArgumentParser, option: str, sizes, head_dim: int) -> None:
    """`p.error` naming `option` unless every group size divides the model's head_dim."""
    bad = [g for g in ((sizes,) if isinstance(sizes, int) else sizes) if head_dim % g]
    if bad:
        p.error(f"argument {option}: {','.join(map(str, bad))} does not divide the model's head_dim {head_dim}; "
                f"use one of {divisors(head_dim)}")


def spelled(dest: str, value) -> str:
    """An option as it was typed: `--bits 2,2,2,4`, `--super-scale`."""
    flag = "--" + dest.replace("_", "-")
    if value is True:
        return flag
    return f"{flag} {','.join(map(str, value)) if isinstance(value, tuple) else value}"


def build_format(p: argparse.ArgumentParser, args: argparse.Namespace, config, num_loops: int):
    """The cache format of --cache and its options (`add_cache_options`), checked against the model
    before any work (`check_format`); `p.error` names the options otherwise."""

    if args.group_size is not None:
        check_group_sizes(p, "--group-size", args.group_size, config.head_dim)
    what = " ".join([f"--cache {args.cache}"] + [spelled(name, getattr(args, name)) for name in POLICY_OPTIONS
                                                  if getattr(args, name) is not None])
    try:
        if args.schedule is not None:
            what += f" --schedule {args.schedule}"
            fmt = load_schedule(args.schedule, **cache_policy(args))
        else:
            fmt = get_format(args.cache, **cache_policy(args))
    except ValueError as err:
        p.error(f"{what}: {err}")
    check_format(p, what, fmt, config, num_loops)
    return fmt


def device_mesh(p: argparse.ArgumentParser, args: argparse.Namespace):
    """Join the processes $JAX_COORDINATOR_ADDRESS etc. name (a no-op when they are not set), then the
    mesh of --mesh (None: one device); `p.error` naming --mesh when it is malformed."""

    sharding.init_distributed()
    try:
        return sharding.parse_mesh(args.mesh)
    except ValueError as err:
        p.error(f"argument --mesh: {err}")


def schedule_schemes(p: argparse.ArgumentParser, paths) -> list:
    """A `Scheme` ("allocated NAME", ladder "allocated") per bit-allocation schedule file of --schedule;
    `p.error` naming the option for a file that is not one."""

    schemes = []
    for path in paths:
        try:
            fmt = load_schedule(path)
        except ValueError as err:
            p.error(f"argument --schedule: {err}")
        schemes.append(Scheme(f"allocated {os.path.splitext(os.path.basename(path))[0]}", fmt, "allocated"))
    return schemes


def calibration(args: argparse.Namespace, model, fmt, num_loops: int):
    """The --calibration artifact loaded for `fmt` (checked against the model and schedule), or None
    without one; raises ValueError naming the option when it does not load."""
    if not args.calibration:
        return None

    try:
        return load_calibration(args.calibration, model, fmt, num_loops=num_loops)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"argument --calibration: {args.calibration}: {err}") from None


def check_format(p: argparse.ArgumentParser, what: str, fmt, config, num_loops: int) -> None:
    """`p.error` (naming `what`, the options that chose `fmt`) unless the format can store this model's
    K/V at `num_loops` loops: its bit accounting and a cache of the model built abstractly (group sizes
    dividing head_dim, packable widths, ...; nothing allocated)."""


    try:
        fmt.bits_per_element(num_loops, config.head_dim)
        jax.eval_shape(lambda: init_cache(config, 1, 1, fmt, num_loops=num_loops))
    except ValueError as err:
        p.error(f"{what}: {err}")


def checkpoint_source(args: argparse.Namespace) -> str:
    """--checkpoint, or the shipped default of --model (a relative path)."""
    return args.checkpoint or os.path.relpath(os.path.join(SHIPPED, DEFAULT_CHECKPOINT[args.model]))


# ---- outputs and runtime ------------------------------------------------------------------------------


def output_folder(p: argparse.ArgumentParser, option: str, folder: str) -> str:
    """Create `folder` (and its parents) now, before any work, and check that it is writable; `p.error`
    naming `option` otherwise. Returns the folder."""
    try:
        os.makedirs(folder or ".", exist_ok=True)
    except OSError as err:
        p.error(f"argument {option}: cannot create {folder}: {err.strerror}")
    if not os.access(folder or ".", os.W_OK):
        p.error(f"argument {option}: {folder} is not writable")
    return folder


def output_file(p: argparse.ArgumentParser, option: str, path: str) -> str:
    """`output_folder` for the folder of a file (or of an output prefix) `path`; returns `path`."""
    if os.path.isdir(path):
        p.error(f"argument {option}: {path} is a folder; give a file name or prefix in it")
    output_folder(p, option, os.path.dirname(path))
    return path


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    """--no-compile-cache (see `start`)."""

    folder = default_cache_dir()
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every program afresh; by default compiled programs are kept in "
                   f"{folder or '$RQ_JAX_COMPILE_CACHE'} ($RQ_JAX_COMPILE_CACHE) and a second run loads them")


def start(args: argparse.Namespace) -> None:
    """What every script does before its work: XLA's C++ log lines silenced (`quiet_xla`), and JAX's
    persistent compilation cache on unless --no-compile-cache (or $RQ_JAX_COMPILE_CACHE is empty)."""

    quiet_xla()
    folder = default_cache_dir()
    if folder and not getattr(args, "no_compile_cache", True):
        use_persistent_cache(folder)


@contextlib.contextmanager
def compiling(what: str, *, quiet: bool = False):
    """Print "compiling WHAT (first run only) ..." before the block and how long it compiled after it
    (`rq_jax.compilation.CompileClock`), noting programs loaded from the persistent cache; `quiet`
    prints nothing (processes other than the first)."""
    cached = bool(jax.config.jax_compilation_cache_dir)
    if not quiet:
        print(f"compiling {what}" + (" (first run only; later runs load them from the compile cache)" if cached
                                     else "") + " ...", end=" ", flush=True)
    with CompileClock() as clock:
        yield clock
    if not quiet:
        hits = clock.cache_hits and f" (tracing; {clock.cache_hits} compiled programs came from the compile cache)"
        print(f"{clock.seconds:.1f} s{hits or ''}", flush=True)
