"""What the command-line scripts share: argument types (each parses one option or raises
`argparse.ArgumentTypeError` naming what was wrong, and argparse then names the option), the model and
cache-format options of generate.py and serve.py, and the shipped checkpoints' defaults."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex

#: The shipped small models (trained here; see their README cards).
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "checkpoints")
#: The shipped checkpoint each --model runs without --checkpoint: Huginn's, and for Ouro `ouro-small-qat`,
#: `ouro-small` fine-tuned for the residual cache (the base model's sums do not survive a 2-bit cache).
DEFAULT_CHECKPOINT = {"huginn": "huginn-small", "ouro": "ouro-small-qat"}
#: End-of-turn texts whose token ids stop generation when a tokenizer has them.
STOP_STRINGS = ("<|endoftext|>", "<|end_text|>", "<|end_turn|>", "<|im_end|>")
#: Cache options of the command line (argparse dest) -> the policy field they set; a format takes the
#: options whose field it has (`rq_jax.cache.base.policy_fields`), and --calibration when it reads one.
POLICY_OPTIONS = {"bits": "bits", "group_size": "group_size", "rotation": "rotation", "cache_dtype": "dtype",
                  "super_scale": "super_scale", "residual_length": "residual_length"}


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {text}")
    return value


def finite_float(text: str) -> float:
    """A finite float (no nan or inf)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers, e.g. bit widths 2,2,2,4."""
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers such as 2,2,2,4, got {text!r}") from None


def spelled_command(words: list[str], group: argparse._ArgumentGroup, args: argparse.Namespace) -> str:
    """`words` (the script and its fixed arguments) plus every option of `group` that `args` sets,
    spelled out and shell-quoted: the command that reproduces a run (for model cards)."""
    words = list(words)
    for action in group._group_actions:
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            words += [action.option_strings[0]] if value else []
        elif value is not None:
            words += [action.option_strings[0], str(value)]
    return " ".join(shlex.quote(w) for w in words)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--model, --checkpoint, --loops (alias --num-steps), --dtype and Huginn's --init-state."""
    p.add_argument("--model", choices=("huginn", "ouro"), required=True)
    p.add_argument("--checkpoint", help="checkpoint folder or cached hub id (default: checkpoints/huginn-small or "
                   "checkpoints/ouro-small-qat, Ouro fine-tuned for the residual cache)")
    p.add_argument("--loops", "--num-steps", dest="loops", type=positive_int,
                   help="loops (Ouro) or recurrence steps (Huginn); default the config's")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--init-state", choices=("zeros", "random"),
                   help="Huginn's initial latent state (default random, seeded by the request's seed)")


def model_kwargs(args: argparse.Namespace) -> dict:
    """Model-call keywords from `add_model_options`: `num_loops` (None: the config's) and, for Huginn,
    `init_scale` (0 for --init-state zeros, else 1: a random initial state)."""
    kwargs = dict(num_loops=args.loops)
    if args.model == "huginn":
        kwargs["init_scale"] = 0.0 if args.init_state == "zeros" else 1.0
    return kwargs


def add_cache_options(p: argparse.ArgumentParser, default: str = "residual") -> None:
    """--cache and the format policy options (--bits, --group-size, ..., --calibration)."""
    from rq_jax.cache import available_formats

    p.add_argument("--cache", choices=available_formats(), default=default,
                   help=f"KV cache format (default: {default}" + (", [2,2,2,4])" if default == "residual" else ")"))
    p.add_argument("--bits", type=int_list,
                   help="bits per loop in a group, e.g. 2,2,2,4 (residual) or 2 (uniform, kivi)")
    p.add_argument("--group-size", type=positive_int, help="channel group size of the quantizers")
    p.add_argument("--rotation", choices=("identity", "hadamard", "random"), help="uniform/rotated/residual")
    p.add_argument("--cache-dtype", choices=("bfloat16", "float32"), help="storage dtype of the dense cache (bfloat16)")
    p.add_argument("--super-scale", action="store_const", const=True,
                   help="uniform/rotated/residual: FP8 metadata relative to a per-vector bf16 super-scale")
    p.add_argument("--residual-length", type=positive_int, help="kivi: recent tokens kept in full precision (128)")
    p.add_argument("--calibration", help="calibration artifact (scripts/calibrate.py) or a folder holding one "
                   "for this schedule (default: the format's own, Hadamard)")


def check_cache_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`p.error` when an option of `add_cache_options` is given that --cache does not take."""
    from rq_jax.cache import get_format
    from rq_jax.cache.base import policy_fields

    fields = policy_fields(args.cache)
    extra = [name for name, field in POLICY_OPTIONS.items() if getattr(args, name) is not None and field not in fields]
    if args.calibration is not None and not get_format(args.cache).needs_calib:
        extra.append("calibration")
    if extra:
        p.error(f"--cache {args.cache} does not take {', '.join('--' + e.replace('_', '-') for e in extra)}")


def cache_policy(args: argparse.Namespace) -> dict:
    """Keyword arguments of the chosen cache format from the command line (only those given)."""
    return {field: getattr(args, name) for name, field in POLICY_OPTIONS.items() if getattr(args, name) is not None}


def checkpoint_source(args: argparse.Namespace) -> str:
    """--checkpoint, or the shipped default of --model (a relative path)."""
    return args.checkpoint or os.path.relpath(os.path.join(SHIPPED, DEFAULT_CHECKPOINT[args.model]))


def eos_ids(folder: str) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: generation_config.json's `eos_token_id` (an id or a list)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def stop_token_ids(tokenizer, folder: str) -> tuple[int, ...]:
    """Ids that end generation: the tokenizer's `STOP_STRINGS` tokens, then the checkpoint's eos ids."""
    return tuple(i for i in map(tokenizer.token_to_id, STOP_STRINGS) if i is not None) + eos_ids(folder)
