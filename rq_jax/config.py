"""One frozen config for both looped families (Ouro and Huginn), presets, and `from_hf_config`.

Vocabulary used across the package: a *looped* layer is one that runs once per loop (Ouro's layers,
Huginn's core blocks); a *plain* layer runs once per token (Huginn's prelude and coda).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Literal

Family = Literal["ouro", "huginn"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of an Ouro or Huginn model.

    `num_layers` counts looped layers (Ouro layers, Huginn core blocks); `num_prelude` and `num_coda`
    count Huginn's plain blocks (0 for Ouro). `num_loops` is the default loop count (Ouro
    `total_ut_steps`, Huginn `mean_recurrence`); the forward pass can choose another.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_loops: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # Ouro only.
    early_exit_threshold: float = 1.0
    # Huginn only.
    num_prelude: int = 0
    num_coda: int = 0
    qk_bias: bool = False
    embed_scale: float = 1.0
    init_std: float = 0.02

    def __post_init__(self):
        if self.family not in ("ouro", "huginn"):
            raise ValueError(f"unsupported model family {self.family!r}: expected 'ouro' or 'huginn'")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "num_loops", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.family == "huginn" and self.qk_bias and self.num_kv_heads != self.num_heads:
            raise ValueError(f"huginn's qk_bias holds one bias per query head for q and k alike, so it needs "
                             f"num_kv_heads == num_heads, got {self.num_kv_heads} and {self.num_heads}")
        if self.family == "huginn" and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"huginn needs num_heads * head_dim == hidden_size, got "
                             f"{self.num_heads} * {self.head_dim} != {self.hidden_size}")

    @property
    def num_plain_layers(self) -> int:
        """Plain (non-looped) layers: Huginn's prelude plus coda; 0 for Ouro."""
        return self.num_prelude + self.num_coda

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    "ouro-1.4b": ModelConfig(
        family="ouro", vocab_size=49152, hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=16,
        head_dim=128, intermediate_size=5632, num_loops=4, max_position_embeddings=65536,
        rope_theta=1e6),
    "ouro-2.6b": ModelConfig(
        family="ouro", vocab_size=49152, hidden_size=2048, num_layers=48, num_heads=16, num_kv_heads=16,
        head_dim=128, intermediate_size=5632, num_loops=4, max_position_embeddings=65536,
        rope_theta=1e6),
    "huginn-0125": ModelConfig(
        family="huginn", vocab_size=65536, hidden_size=5280, num_layers=4, num_heads=55, num_kv_heads=55,
        head_dim=96, intermediate_size=17920, num_loops=32, max_position_embeddings=4096,
        rope_theta=50000.0, tie_word_embeddings=True, num_prelude=2, num_coda=2, qk_bias=True,
        embed_scale=math.sqrt(5280), init_std=math.sqrt(2 / (5 * 5280))),
    # The shapes of ../shared/fixtures/{ouro,huginn}-tiny.
    "ouro-tiny": ModelConfig(
        family="ouro", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, intermediate_size=128, num_loops=4, max_position_embeddings=256, rope_theta=10000.0),
    "huginn-tiny": ModelConfig(
        family="huginn", vocab_size=128, hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=24, intermediate_size=192, num_loops=4, max_position_embeddings=256, rope_theta=50000.0,
        tie_word_embeddings=True, num_prelude=1, num_coda=1, qk_bias=True, embed_scale=math.sqrt(96),
        init_std=math.sqrt(2 / (5 * 96))),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset config called `name` (see `PRESETS`), with `overrides` (ModelConfig fields) applied,
    e.g. `preset("ouro-1.4b", num_layers=2)`. Raises ValueError for an unknown name or field."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown ModelConfig field(s) {bad} for preset {name!r}")
    return base.replace(**overrides) if overrides else base


def parse_preset(spec: str) -> tuple[str, ModelConfig]:
    """`NAME[:field=value,...]` → (NAME, the preset with those fields changed), e.g.
    "huginn-0125:num_layers=1,num_loops=4". Values take the field's type (bools: 1/true/0/false).
    Raises ValueError naming a malformed item, an unknown field or an unknown preset."""
    name, _, rest = spec.partition(":")
    base = preset(name)
    changes = {}
    for item in filter(None, rest.split(",")):
        field, _, value = item.partition("=")
        if not hasattr(base, field) or not value:
            raise ValueError(f"bad model field {item!r} in {spec!r}: expected field=value of ModelConfig")
        kind = type(getattr(base, field))
        try:
            changes[field] = (value.lower() in ("1", "true")) if kind is bool else kind(value)
        except ValueError:
            raise ValueError(f"bad value {value!r} for {field} ({kind.__name__}) in {spec!r}") from None
    return name, preset(name, **changes)


def changes_from(name: str, config: ModelConfig) -> str:
    """What `config` changes in preset `name`, e.g. "num_layers 2 of 24", or "as released"."""
    base = preset(name)
    shown = [f"{f.name} {getattr(config, f.name)} of {getattr(base, f.name)}" for f in dataclasses.fields(config)
             if getattr(config, f.name) != getattr(base, f.name)]
    return ", ".join(shown) or "as released"


def _require(raw: dict[str, Any], name: str) -> Any:
    if name not in raw:
        raise ValueError(f"config.json is missing the required field {name!r}")
    return raw[name]


def _reject(raw: dict[str, Any], name: str, ok) -> None:
    if name in raw and not ok(raw[name]):
        raise ValueError(f"unsupported config value {name}={raw[name]!r}")


def _ouro(raw: dict[str, Any]) -> ModelConfig:
    _reject(raw, "use_sliding_window", lambda v: not v)
    _reject(raw, "rope_scaling", lambda v: v is None)
    _reject(raw, "hidden_act", lambda v: v == "silu")
    _reject(raw, "layer_types", lambda v: all(t == "full_attention" for t in v))
    hidden, heads = _require(raw, "hidden_size"), _require(raw, "num_attention_heads")
    threshold = raw.get("early_exit_threshold", 1.0)
    return ModelConfig(
        family="ouro", vocab_size=_require(raw, "vocab_size"), hidden_size=hidden,
        num_layers=_require(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads), head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=_require(raw, "intermediate_size"), num_loops=_require(raw, "total_ut_steps"),
        max_position_embeddings=_require(raw, "max_position_embeddings"),
        rope_theta=float(raw.get("rope_theta", 10000.0)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        early_exit_threshold=1.0 if threshold is None else float(threshold),
        init_std=float(raw.get("initializer_range", 0.02)))


def _huginn(raw: dict[str, Any]) -> ModelConfig:
    _reject(raw, "injection_type", lambda v: v == "linear")
    _reject(raw, "bias", lambda v: not v)
    _reject(raw, "test_time_noise", lambda v: v == 0)
    _reject(raw, "nonlin_name", lambda v: v == "SiLU")
    _reject(raw, "block_class_name", lambda v: v == "SandwichBlock")
    _reject(raw, "mlp_class_name", lambda v: v == "GatedMLP")
    hidden, heads = _require(raw, "n_embd"), _require(raw, "n_heads")
    prelude, core = _require(raw, "n_layers_in_prelude"), _require(raw, "n_layers_in_recurrent_block")
    init = raw.get("init_values", {})
    return ModelConfig(
        family="huginn", vocab_size=raw.get("padded_vocab_size") or _require(raw, "vocab_size"),
        hidden_size=hidden, num_layers=core, num_heads=heads, num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=hidden // heads, intermediate_size=_require(raw, "intermediate_size"),
        num_loops=_require(raw, "mean_recurrence"), max_position_embeddings=_require(raw, "block_size"),
        rope_theta=float(_require(raw, "rope_base")), rms_norm_eps=float(raw.get("norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_embeddings", True)), num_prelude=prelude,
        num_coda=_require(raw, "n_layers_in_coda"), qk_bias=bool(raw.get("qk_bias", False)),
        embed_scale=float(init.get("embed_scale", math.sqrt(hidden))),
        init_std=float(init.get("std", math.sqrt(2 / (5 * hidden)))))


_FAMILIES = {"ouro": _ouro, "huginn_raven": _huginn}


def from_hf_config(raw: dict[str, Any] | str | os.PathLike) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face `config.json` (a dict, or a path to the file or its folder).

    Raises ValueError naming the field for an unknown `model_type`, a missing required field, or an
    unsupported value (sliding-window attention, rope scaling, other activations or injections).
    """
    if not isinstance(raw, dict):
        path = os.fspath(raw)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; expected one of {sorted(_FAMILIES)}")
    return _FAMILIES[model_type](raw)
