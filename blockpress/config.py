"""Model configuration: DiffusionGemma's `config.json`, read, validated and written back.

The Hugging Face layout nests the text model under `text_config`; blockpress keeps that split
(`ModelConfig` holds a `TextConfig`) so a config read from a checkpoint writes back unchanged.
Per-layer attention shapes (sliding layers vs full layers) are resolved once into `LayerSpec`s.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeGuard, get_args

from .checks import check_flag, is_finite_number, plain_number, warn_user
from .files import read_json_object

# Names and defaults the command line shows in its --help, kept in this module (which imports no torch) so that
# building the parser does not import torch: that takes seconds, and `blockpress --help` needs none of it.
# Queries per encoder pass over a long prompt (DiffusionGemma.prefill_chunk's default). Each pass builds masks
# (and, where SDPA falls back to its math kernel, scores) over chunk x keys, not prompt x prompt; 2048 queries
# still keep the projections' and experts' GEMMs large, and shorter prompts run in one pass.
PREFILL_CHUNK = 2048
SCHEMES = ("int8", "fp8", "int4")  # the quantization schemes (quantize.py)
# The acceptance rules (SamplerConfig.sampler), one list read by the type checker, SamplerConfig's check, the CLI's
# choices and the server's schema: a rule added here is offered everywhere (and denoise_step refuses one it lacks)
SamplerName = Literal["entropy_bound", "confidence", "topk", "greedy"]
SAMPLERS: tuple[str, ...] = get_args(SamplerName)
RANKINGS = ("entropy", "margin", "position")  # the orders acceptance ranks positions in (SamplerConfig.rank_by)
CHAT_TURNS = ("all", "last")  # which assistant turns of a `messages` record are trained on (data.parse_examples)

SLIDING = "sliding_attention"
FULL = "full_attention"
# hidden_activation: each name transformers' ACT2FN knows (its loader knows no other spelling) -> the function
# blockpress computes for it (model.ACTIVATION_FUNCTIONS). Several names are one function: transformers spells the
# tanh GELU five ways. Left out: prelu and xielu, whose learned parameters are no DiffusionGemma tensors.
ACTIVATIONS: dict[str, str] = {
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
    "gelu_accurate": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu": "gelu", "gelu_python": "gelu", "gelu_10": "gelu_10", "quick_gelu": "quick_gelu",
    "silu": "silu", "swish": "silu", "relu": "relu", "relu2": "relu2", "relu6": "relu6", "leaky_relu": "leaky_relu",
    "hardswish": "hardswish", "mish": "mish", "sigmoid": "sigmoid", "tanh": "tanh", "linear": "linear",
    "laplace": "laplace", "sqrtsoftplus": "sqrtsoftplus",
}
# rope_type -> the fields it needs besides rope_theta (what the reference's validation requires; model.rope_inv_freq
# holds the maths). "linear" divides every frequency by `factor` (position interpolation); "dynamic" (NTK) scales the
# base by `factor` only past max_position_embeddings, where blockpress never runs. "longrope" is refused: the
# reference cannot build it for this model (it reads one head_dim, which DiffusionGemma sets per layer).
ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "default": (),
    "proportional": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_FIELDS)


class ConfigError(ValueError):
    """A config.json that blockpress cannot run; the message names the field."""


@dataclass(frozen=True)
class LayerSpec:
    """The attention shape of one layer, resolved from `layer_types` and `per_layer_config`."""

    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int

    @property
    def is_sliding(self) -> bool:
        return self.kind == SLIDING

    @property
    def values_from_keys(self) -> bool:
        # Full-attention layers have no v_proj: values are the raw key projection (then v_norm).
        return not self.is_sliding


def _is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: not a bool (true is an int to Python, and loaded as 1), not a float or a string."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    """A finite JSON number: JSON's Infinity made softcapping's logits NaN, and an infinite eps or rope theta zeroed
    or unrotated what they scale; nor an integer past a float's range (is_finite_number)."""
    return isinstance(value, (int, float)) and is_finite_number(value)


# torch's sizes are 64-bit: a larger JSON integer (Python reads any) would load and then fail deep in torch with
# "empty(): argument 'size' failed to unpack the object ... Overflow when unpacking long long", naming no field.
MAX_INT64 = 2**63 - 1


def _positive_int(value: object) -> TypeGuard[int]:
    return _is_int(value) and 0 < value <= MAX_INT64


# The most layers a config may ask for. Not a limit of the maths: building the model takes ~2.5 ms a layer even on the
# meta device (before any weight is compared with the config), and a config without layer_types has its pattern drawn
# as a list of num_hidden_layers entries, so an untrusted config.json of 10**6 layers would hold `blockpress.load` and
# `blockpress info` for hours, and one of 10**12 take memory until the OOM killer. 1,024 is eight times the deepest
# released models' (Llama 3.1 405B: 126 layers; DiffusionGemma 26B-A4B: 30), and builds in seconds.
MAX_LAYERS = 1024


def _check_depth(n: Any) -> None:
    """num_hidden_layers, checked before anything is built or drawn from it."""
    if not _positive_int(n):
        raise ConfigError(f"text_config.num_hidden_layers: expected a positive integer, got {n!r}")
    if n > MAX_LAYERS:
        raise ConfigError(f"text_config.num_hidden_layers: {n} layers is more than the {MAX_LAYERS} blockpress builds "
                          "(the deepest released models have about 130)")


def _past_int64(value: Any) -> str:
    """What an error adds for an integer past torch's 64-bit sizes, else nothing."""
    return f" of at most {MAX_INT64} (torch's sizes are 64-bit)" if _is_int(value) and value > MAX_INT64 else ""


def _unresolved(name: str) -> ConfigError:
    return ConfigError(f"text_config.{name}: None after construction, which draws it; build a new TextConfig to draw "
                       "it again")


def _default_layer_types(n: int) -> list[str]:
    return [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]


def _default_rope() -> dict[str, dict[str, Any]]:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }


def _rope_type_spelled_new(rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """A copy whose entries name their rope type as `rope_type`: an older config spells it `type`, which transformers
    still reads (a `rope_type` beside it wins). Read as default, a linear or yarn entry ran unscaled without a word."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in rope_parameters.items()}
    for entry in [v for k, v in out.items() if k in (SLIDING, FULL) and isinstance(v, dict)] or [out]:  # (or flat)
        if "rope_type" not in entry and "type" in entry:
            entry["rope_type"] = entry["type"]
    return out


def _read_rope_scaling(text_raw: dict[str, Any]) -> None:
    """text_config's `rope_scaling`, the older name of rope_parameters, read as transformers reads it: it replaces
    rope_parameters (in place). The reference fails on any form but one entry per layer type: the others are refused
    by name here."""
    if "rope_scaling" in text_raw:
        scaling = text_raw.pop("rope_scaling")
        if not (isinstance(scaling, dict) and scaling and set(scaling) <= {SLIDING, FULL}):
            raise ConfigError(f"text_config.rope_scaling: expected the rope settings by layer type ({{'{SLIDING}': "
                              f"{{...}}, '{FULL}': {{...}}}}), the older name of rope_parameters that transformers "
                              f"reads as it; got {scaling!r:.120}")
        text_raw["rope_parameters"] = scaling


def _fill_partial_rotary_factor(text: TextConfig, factor: Any) -> bool:
    """A top-level `partial_rotary_factor` (an older spelling) copied into the rope entries of `text`'s layer kinds
    that name none, as transformers copies it while it builds a rope other than 'default'; False where every such
    entry is 'default' (the reference builds those without it: ignored). An entry whose type takes no partial factor
    cannot get one: the reference's first forward fails."""
    assert isinstance(text.rope_parameters, dict)  # (built by TextConfig)
    entries = {kind: text.rope_parameters[kind] for kind in dict.fromkeys(text.layer_types or ())}
    if all(entry.get("rope_type", "default") == "default" for entry in entries.values()):
        return False
    if not (_is_number(factor) and 0 <= factor <= 1):
        raise ConfigError(f"text_config.partial_rotary_factor: expected a fraction in [0, 1], got {factor!r}")
    for kind, entry in entries.items():
        rope_type = entry.get("rope_type", "default")
        if "partial_rotary_factor" not in entry and rope_type != "proportional" and factor != 1:
            raise ConfigError(f"text_config.partial_rotary_factor: transformers copies it into every rope_parameters "
                              f"entry that names none, and the {kind} entry's rope_type {rope_type!r} takes no "
                              f"partial factor (the reference fails on its first forward); give the factor inside "
                              f"the 'proportional' entries instead")
        entry.setdefault("partial_rotary_factor", factor)
    text.validate()
    return True


# per_layer_config's keys, and the text_config keys it is drawn from where a config.json holds none
DRAWN_FROM = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}


@dataclass
class TextConfig:
    """The text backbone. Defaults follow the reference config class (not the released model's sizes)."""

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, dict[str, Any]] | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    per_layer_config: dict[str, dict[str, int]] | None = None
    final_logit_softcapping: float = 30.0
    use_bidirectional_attention: str | None = None
    num_experts: int = 8
    top_k_experts: int = 2
    moe_intermediate_size: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):  # a numpy number (np.int64 from an array's arithmetic) as the Python one it is: the
            # checks below take JSON's types, and config.json is written with json
            setattr(self, f.name, plain_number(getattr(self, f.name)))
        for name in ("rope_parameters", "per_layer_config"):  # read as dicts just below
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"text_config.{name}: expected an object (a dict), got {value!r}")
        if self.per_layer_config is not None:
            for key, over in self.per_layer_config.items():
                if not (isinstance(over, dict) and all(_is_int(v) for v in over.values())):
                    raise ConfigError(f"text_config.per_layer_config[{key!r}]: expected an object of integers, "
                                      f"got {over!r}")
        if not (self.layer_types is None or isinstance(self.layer_types, list)):  # list() of a string splits it
            raise ConfigError(f"text_config.layer_types: expected a list of layer types, got {self.layer_types!r}")
        if self.layer_types is not None and not all(isinstance(k, str) for k in self.layer_types):
            # (a list in it would fail as "unhashable type: 'list'", a number as "'<' not supported", naming no field)
            kind = next(k for k in self.layer_types if not isinstance(k, str))
            raise ConfigError(f"text_config.layer_types: unknown layer type {kind!r}; expected {SLIDING!r} or {FULL!r}")
        if self.per_layer_config is None:
            # These two only build the full layers' overrides below (the reference pops them; a checkpoint it saved
            # holds per_layer_config instead). Checked here, by name: int() reads 1.5, "1" and true as 1, and a null
            # fails as "text_config: int() argument must be ..."; the reference refuses all of them.
            for name, optional in (("global_head_dim", False), ("num_global_key_value_heads", True)):
                value = getattr(self, name)
                if not ((optional and value is None)
                        or _positive_int(value)):
                    raise ConfigError(f"text_config.{name}: expected a positive integer"
                                      f"{' or null' if optional else ''}, got {value!r}")
        if self.layer_types is None:
            n = self.num_hidden_layers  # read before validate does, to draw the default pattern
            _check_depth(n)
            layer_types = _default_layer_types(n)
        else:
            layer_types = list(self.layer_types)
        self.layer_types = layer_types
        # Before the per-layer shapes below are derived: the forced full layer takes the full layers' shape.
        _last_layer_full(layer_types)
        # (not a field: what this draws from the file's flat forms, whose errors name those forms while the values are
        # still the ones drawn; a value set after construction is named as it is)
        self._drawn: dict[str, Any] = {}
        if self.rope_parameters is None:
            self.rope_parameters = _default_rope()
        else:
            self.rope_parameters = _rope_type_spelled_new(self.rope_parameters)
        if any(isinstance(self.rope_parameters.get(kind), dict) for kind in (SLIDING, FULL)):
            # Entries by layer type rule, as the reference reads them; flat keys beside them are dropped: transformers
            # 5.15 writes `rope_type: default, rope_theta: null` there when layer_types holds one kind only.
            self.rope_parameters = {k: v for k, v in self.rope_parameters.items() if k in (SLIDING, FULL)}
        elif "rope_type" in self.rope_parameters or "rope_theta" in self.rope_parameters:
            # A flat rope dict applies to every layer type.
            self.rope_parameters = {kind: dict(self.rope_parameters) for kind in (SLIDING, FULL)}
            self._drawn["rope_parameters"] = copy.deepcopy(self.rope_parameters)
        if self.per_layer_config is None:
            override: dict[str, int] = {"head_dim": self.global_head_dim}
            if self.num_global_key_value_heads is not None:
                override["num_key_value_heads"] = self.num_global_key_value_heads
            self.per_layer_config = {
                str(i): dict(override) for i, kind in enumerate(layer_types) if kind == FULL
            }
            self._drawn["per_layer_config"] = copy.deepcopy(self.per_layer_config)  # from global_head_dim / ...
        else:
            # transformers writes the keys zero-padded to the widest index ("05" of 30 layers) and reads int(key)
            layers: dict[str, dict[str, int]] = {}
            for k, v in self.per_layer_config.items():
                # other keys: refused by validate, as given ("²" is a digit to isdigit, which int() refused bare, as
                # it does 5,000 digits: no int() here)
                key = (str(k).lstrip("0") or "0") if str(k).isascii() and str(k).isdigit() else str(k)
                if key in layers:
                    raise ConfigError(f"text_config.per_layer_config: two entries for layer {key}")
                layers[key] = dict(v)
            self.per_layer_config = layers
        self.validate()

    # -- derived -----------------------------------------------------------------------------------
    # layer_types, per_layer_config and rope_parameters may be given as None (JSON null, or left out): __post_init__
    # draws them then. These read them as drawn, and refuse by name one set back to None afterwards.
    @property
    def resolved_layer_types(self) -> list[str]:
        """layer_types, drawn from num_hidden_layers where none was given."""
        if self.layer_types is None:
            raise _unresolved("layer_types")
        return self.layer_types

    @property
    def resolved_per_layer_config(self) -> dict[str, dict[str, int]]:
        """per_layer_config, keyed by layer index, derived from global_head_dim where none was given."""
        if self.per_layer_config is None:
            raise _unresolved("per_layer_config")
        return self.per_layer_config

    @property
    def resolved_rope_parameters(self) -> dict[str, dict[str, Any]]:
        """rope_parameters by layer type: the defaults where none were given, a flat entry copied to each type."""
        if self.rope_parameters is None:
            raise _unresolved("rope_parameters")
        # yarn's null factor is the context's growth over the original, as the reference reads it (DeepSeek-V3's)
        return {kind: {**rope, "factor": self.max_position_embeddings / rope["original_max_position_embeddings"]}
                if isinstance(rope, dict) and rope.get("rope_type") == "yarn" and "factor" in rope
                and rope["factor"] is None and _is_number(rope.get("original_max_position_embeddings"))
                and rope["original_max_position_embeddings"] > 0 else rope
                for kind, rope in self.rope_parameters.items()}

    @property
    def kinds(self) -> list[str]:
        """The layer types the model has, each once, in layer order."""
        return list(dict.fromkeys(self.resolved_layer_types))

    @property
    def layers(self) -> list[LayerSpec]:
        specs = []
        per_layer = self.resolved_per_layer_config
        for i, kind in enumerate(self.resolved_layer_types):
            over = per_layer.get(str(i), {})
            specs.append(
                LayerSpec(
                    kind=kind,
                    head_dim=int(over.get("head_dim", self.head_dim)),
                    num_kv_heads=int(over.get("num_key_value_heads", self.num_key_value_heads)),
                )
            )
        return specs

    def global_shape(self) -> dict[str, int | None]:
        """The full layers' shape as global_head_dim / num_global_key_value_heads, the keys the published checkpoint
        writes it with; {} where those two cannot say it (a per_layer_config entry for a sliding layer)."""
        per_layer = self.resolved_per_layer_config
        full = [i for i, kind in enumerate(self.resolved_layer_types) if kind == FULL]
        over = per_layer.get(str(full[0]), {}) if full else {}
        shape = {"global_head_dim": int(over.get("head_dim", self.head_dim)),
                 "num_global_key_value_heads": over.get("num_key_value_heads")}
        # what the reference derives from the two keys alone, checked to be these layers
        derived = TextConfig(**{**asdict(self), "per_layer_config": None, **shape})
        return shape if derived.layers == self.layers else {}

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # -- validation --------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, field_name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"text_config.{field_name}: {msg}")

        layer_types, per_layer = self.resolved_layer_types, self.resolved_per_layer_config
        ropes = self.resolved_rope_parameters
        _check_depth(self.num_hidden_layers)  # before layer_types is compared with it (a list as long as its JSON)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            need(_positive_int(value), name, f"expected a positive integer{_past_int64(value)}, got {value!r}")
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            need(value is None or (_is_int(value) and 0 <= value < self.vocab_size), name,
                 f"expected a token id in [0, vocab_size={self.vocab_size}), got {value!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        need(self.eos_token_id is None or all(_is_int(i) and 0 <= i < self.vocab_size for i in eos),
             "eos_token_id", f"expected a token id (or a list of them) in [0, {self.vocab_size}), got {self.eos_token_id!r}")
        cap = self.final_logit_softcapping
        # The reference divides the logits by it unconditionally: a null would load here and then fail there.
        # JSON's Infinity too: tanh(logits / inf) * inf makes every logit NaN, which generation would then blame on
        # activations overflowing float32
        need(_is_number(cap) and cap > 0,
             "final_logit_softcapping", f"expected a positive finite number, got {cap!r}")
        need(_is_number(self.initializer_range) and self.initializer_range >= 0, "initializer_range",
             f"expected a finite number >= 0, got {self.initializer_range!r}")
        for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            value = getattr(self, name)
            need(_positive_int(value), name,
                 f"expected a positive integer{_past_int64(value)} (DiffusionGemma layers always have experts), "
                 f"got {value!r}")
        need(self.top_k_experts <= self.num_experts, "top_k_experts",
             f"{self.top_k_experts} is more than num_experts={self.num_experts}")
        need(isinstance(self.hidden_activation, str) and self.hidden_activation in ACTIVATIONS, "hidden_activation",
             f"{self.hidden_activation!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
        # (a string "false" is truthy: it would tie the weights, and be saved back for transformers to read as true)
        for name in ("attention_bias", "tie_word_embeddings"):
            need(isinstance(getattr(self, name), bool), name, f"expected true or false, got {getattr(self, name)!r}")
        # "all" would make the encoder bidirectional with a halved, two-sided sliding window; the reference's forward
        # fails on it (transformers 5.23: `is_causal` is passed twice to every attention implementation), so there is
        # nothing to match. "vision" only changes the mask between image tokens, which text-only blockpress never has.
        need(self.use_bidirectional_attention in (None, "vision"), "use_bidirectional_attention",
             f"{self.use_bidirectional_attention!r} is not supported; expected null or 'vision' (text-only)"
             + ("; 'all' (a bidirectional encoder) fails in the reference's own forward, so it has no behaviour to "
                "match" if self.use_bidirectional_attention == "all" else ""))
        need(_is_number(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps",
             f"expected a positive finite number, got {self.rms_norm_eps!r}")
        need(len(layer_types) == self.num_hidden_layers, "layer_types",
             f"has {len(layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = list(dict.fromkeys(repr(k) for k in layer_types if not (isinstance(k, str) and k in (SLIDING, FULL))))
        need(not bad, "layer_types", f"unknown layer type(s) {', '.join(bad)}; expected {SLIDING!r} or {FULL!r}")
        # A window of one token is ill-defined in the reference (its cache keeps the last window - 1 = 0 keys,
        # sliced as [-0:], i.e. all of them): refuse it rather than compute something else.
        need(self.sliding_window >= 2 or SLIDING not in layer_types, "sliding_window",
             f"expected at least 2 when layers use sliding attention, got {self.sliding_window}")
        _last_layer_full(layer_types)  # (a list set after construction: __post_init__ forced the first)
        for key, over in per_layer.items():
            need(key.isascii() and key.isdigit() and len(key) < 20 and int(key) < self.num_hidden_layers,
                 f"per_layer_config[{key[:40]!r}]",
                 f"expected a layer index below {self.num_hidden_layers}")
            unknown = set(over) - {"head_dim", "num_key_value_heads"}
            need(not unknown, f"per_layer_config[{key!r}]",
                 f"unsupported override(s) {sorted(unknown)}; expected head_dim / num_key_value_heads")
        drawn = getattr(self, "_drawn", {}).get("per_layer_config") == per_layer

        def shape_field(i: int, key: str) -> str:
            """The field of the file that gave layer i's `key`: per_layer_config's entry, or the keys it was drawn
            from (global_head_dim, num_global_key_value_heads), or the base one every other layer takes."""
            if key not in per_layer.get(str(i), {}):
                return key
            return DRAWN_FROM[key] if drawn else f"per_layer_config[{i}].{key}"

        for i, spec in enumerate(self.layers):
            need(_positive_int(spec.head_dim) and spec.head_dim % 2 == 0, shape_field(i, "head_dim"),
                 f"expected a positive even integer, got {spec.head_dim}")
            need(_positive_int(spec.num_kv_heads) and self.num_attention_heads % spec.num_kv_heads == 0,
                 shape_field(i, "num_key_value_heads"),
                 f"{spec.num_kv_heads} does not divide num_attention_heads={self.num_attention_heads}")
        for kind in sorted(set(layer_types)):
            # One rotary table serves each kind of layer (the reference also refuses mixed sizes within a kind).
            dims = sorted({spec.head_dim for spec in self.layers if spec.kind == kind})
            need(len(dims) == 1, "per_layer_config", f"the {kind} layers have head_dim {dims}; layers of one kind "
                 "must share one head_dim")
            # The reference builds each kind's layers from one view of per_layer_config, and refuses to build a model
            # whose layers of one kind have entries that differ in anything (num_key_value_heads too, or an entry
            # beside none): refused here too, as a checkpoint saved from such a model is one transformers cannot load.
            layers = [i for i, k in enumerate(layer_types) if k == kind]
            first = per_layer.get(str(layers[0]), {})
            other = next((i for i in layers if per_layer.get(str(i), {}) != first), None)
            need(other is None, "per_layer_config",
                 f"the {kind} layers' entries differ (layer {layers[0]}: {first}, layer {other}: "
                 f"{per_layer.get(str(other), {})}); layers of one kind must have the same entry, as the "
                 "reference refuses to build them otherwise")
        for kind in set(layer_types):
            need(kind in ropes, "rope_parameters", f"missing an entry for {kind!r}")
            rope = ropes[kind]
            need(isinstance(rope, dict), f"rope_parameters.{kind}", f"expected an object, got {rope!r}")
            self._validate_rope(kind, rope)

    def _validate_rope(self, kind: str, rope: dict[str, Any]) -> None:
        """One layer type's rope_parameters entry, field by field: every field its rope_type reads, by name."""
        flat = getattr(self, "_drawn", {}).get("rope_parameters") == self.rope_parameters
        where = "rope_parameters" if flat else f"rope_parameters.{kind}"

        def need(cond: bool, field_name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"text_config.{where}.{field_name}: {msg}")

        rope_type = rope.get("rope_type", "default")
        need(isinstance(rope_type, str) and rope_type in ROPE_FIELDS, "rope_type",
             f"{rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
             + (" (the reference cannot build longrope for DiffusionGemma either)" if rope_type == "longrope" else ""))
        theta = rope.get("rope_theta")
        need(_is_number(theta) and theta > 0, "rope_theta", f"expected a positive number, got {theta!r}")
        factor = rope.get("partial_rotary_factor", 1.0)
        # (0 rotates no angle: a layer kind without positions, as the reference builds it)
        need(_is_number(factor) and 0 <= factor <= 1, "partial_rotary_factor", f"expected a fraction in [0, 1], got {factor!r}")
        # The reference's other types make a shorter table than the head and fail on the first forward.
        need(rope_type == "proportional" or factor == 1.0, "partial_rotary_factor",
             "partial rotary factors need rope_type 'proportional'")
        for name in ROPE_FIELDS[rope_type]:
            need(name in rope, name, f"rope_type {rope_type!r} needs {name}")
        if "original_max_position_embeddings" in ROPE_FIELDS[rope_type]:
            value = rope["original_max_position_embeddings"]  # (8.0 as some JSON writers write 8: read as it is)
            need(_is_number(value) and value > 0, "original_max_position_embeddings",
                 f"expected a positive number (the context the model was trained on), got {value!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = rope.get(name, 1.0)
            null = " or null (max_position_embeddings / original_max_position_embeddings)" if (
                rope_type == "yarn" and name == "factor") else ""
            need(_is_number(value) and value > 0, name, f"expected a positive number{null}, got {value!r}")
        if rope_type == "llama3":  # (equal: no band between the kept and the scaled wavelengths)
            need(rope["high_freq_factor"] >= rope["low_freq_factor"], "high_freq_factor",
                 f"expected at least low_freq_factor={rope['low_freq_factor']}, got {rope['high_freq_factor']}")
        if rope_type == "dynamic":
            need(self.layers[self.resolved_layer_types.index(kind)].head_dim > 2, "rope_type",
                 "'dynamic' needs a head_dim above 2 (its base is raised to head_dim / (head_dim - 2))")
        if rope_type == "yarn":
            value = rope.get("attention_factor")
            need(value is None or (_is_number(value) and value > 0), "attention_factor",
                 f"expected a positive number or null (derived from factor), got {value!r}")
            for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                value = rope.get(name)  # null or 0: the default, as the reference reads them
                need(value is None or (_is_number(value) and value >= 0), name,
                     f"expected a number >= 0 or null, got {value!r}")
            truncate = rope.get("truncate", True)
            need(isinstance(truncate, bool), "truncate", f"expected true or false, got {truncate!r}")
            if not truncate:
                warn_user(f"text_config.rope_parameters.{kind}.truncate: false is ignored, as the reference "
                          "ignores it for DiffusionGemma (it reads the flag beside the layer types, not in their "
                          "entries): the ramp's ends are rounded")

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the text model (tied embedding counted once). `active`: per token, top-k experts."""
        check_flag("active", active)  # "no" would count the active ones
        h, n = self.hidden_size, 0
        for spec in self.layers:
            q = self.num_attention_heads * spec.head_dim
            kv = spec.num_kv_heads * spec.head_dim
            v = 0 if spec.values_from_keys else kv
            n += h * q + h * kv + h * v + q * h  # q, k, v, o
            if self.attention_bias:  # the encoder's biases are not tied to the decoder's: two sets
                n += 2 * (q + kv + v + h)
            n += 2 * spec.head_dim  # q_norm, k_norm
            n += 3 * h * self.intermediate_size  # dense MLP
            n += h * self.num_experts + h + self.num_experts  # router proj, scale, per-expert scale
            experts = self.top_k_experts if active else self.num_experts
            n += experts * 3 * h * self.moe_intermediate_size
            n += 7 * h  # seven RMSNorm scales
        n += self.vocab_size * h  # tied embedding / LM head
        n += h  # final norm
        n += 3 * h * self.intermediate_size + h  # self-conditioning MLP and its pre-norm
        return n


_TEXT_FIELDS = {f.name for f in fields(TextConfig)}
# Keys a text_config may hold that carry no meaning for the text computation: the reference's own, and the generic
# ones every transformers config writes (PretrainedConfig's attributes in transformers 4 and 5, less the token ids and
# tie_word_embeddings, which are TextConfig fields; a test checks this against the installed transformers). The
# generation defaults transformers 4 kept there (temperature, top_k, ...) are not listed: they would look in effect.
_IGNORED_TEXT_KEYS = frozenset({
    "model_type", "architectures", "transformers_version", "attention_dropout", "dtype", "torch_dtype",
    "use_cache", "keys_to_ignore_at_inference",
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder",
    "finetuning_task", "id2label", "label2id", "task_specific_params", "problem_type", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id",
})


@dataclass
class ModelConfig:
    """A whole DiffusionGemma checkpoint config: the text model, the canvas, and pass-through fields."""

    text: TextConfig = field(default_factory=TextConfig)
    canvas_length: int = 256
    vision_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, written back unchanged
    # text_config's keys that are no TextConfig field (attention_dropout, use_cache, an author's own), written back
    # unchanged too: transformers reads them (a fine-tune after a round trip would otherwise lose its dropout)
    text_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.canvas_length = plain_number(self.canvas_length)  # (as TextConfig's numbers)
        self.validate()

    def validate(self) -> None:
        """Refuse, naming the field, a config blockpress cannot build a working model of: what construction checks,
        checked again where a model is built (DiffusionGemma), since fields may change after (`cfg.text.x = v`:
        final_logit_softcapping 0 gave all-zero logits, top_k_experts past num_experts failed inside torch)."""
        self.text.validate()
        if not _positive_int(self.canvas_length):
            raise ConfigError(f"canvas_length: expected a positive integer{_past_int64(self.canvas_length)}, "
                              f"got {self.canvas_length!r}")
        # the flag transformers ties the weights by (text_config's own is read by nothing there)
        tied = self.extra.get("tie_word_embeddings", True)
        if not isinstance(tied, bool):
            raise ConfigError(f"tie_word_embeddings: expected true or false, got {tied!r}")

    @property
    def attention_dropout(self) -> float:
        """text_config's attention_dropout, the reference's: the share of attention probabilities that training drops
        (transformers drops them in train mode only; absent or null: 0). It is no TextConfig field since inference
        never reads it; a value outside [0, 1) is refused by field."""
        value = self.text_extra.get("attention_dropout")
        if value is None:
            return 0.0
        if not (is_finite_number(value) and 0 <= value < 1):
            raise ConfigError(f"text_config.attention_dropout: expected a number in [0, 1) (the share of attention "
                              f"probabilities training drops), got {value!r}")
        return float(value)

    # -- presets -------------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A ~50k-parameter model for tests (not `preset("tiny")`, which has ~190k)."""
        text: dict[str, Any] = dict(
            vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            sliding_window=8, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
            layer_types=[SLIDING, SLIDING, FULL],
        )
        canvas = overrides.pop("canvas_length", 8)
        text.update(overrides)
        return cls(text=TextConfig(**text), canvas_length=canvas)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """Named shapes for speed work and demos: tiny, small (~15M), medium (~60M), 26b-a4b."""
        if name == "26b-a4b":
            return cls.gemma_26b_a4b()
        if name not in PRESETS:
            raise ValueError(f"preset: unknown preset {name!r}; expected one of {preset_names()}")
        p = PRESETS[name]
        return cls(text=TextConfig(**p["text"]), canvas_length=p["canvas"])

    def first_layers(self, count: int) -> ModelConfig:
        """This config cut to its first `count` decoder layers, each as it was (kind, heads, rope): a model of the same
        widths that a machine can hold when the whole one does not (speed per layer, `blockpress bench --layers`).
        The cut must end in a full-attention layer, as every DiffusionGemma does: the 26B-A4B's first 6 hold its
        pattern once, 5 sliding layers and a full one."""
        text = self.text
        kinds = text.layer_types or []
        ends = [i + 1 for i, kind in enumerate(kinds) if kind == FULL]
        if isinstance(count, bool) or not isinstance(count, int) or count not in ends:
            raise ConfigError(f"layers: expected a count of layers that ends in a full-attention one, as a "
                              f"DiffusionGemma's last layer is: one of {', '.join(map(str, ends))}; got {count!r}")
        cut = copy.deepcopy(self)
        cut.text.num_hidden_layers = count
        cut.text.layer_types = list(text.layer_types or [])[:count]
        cut.text.per_layer_config = {key: dict(over) for key, over in text.resolved_per_layer_config.items()
                                     if int(key) < count}
        cut.text.validate()
        return cut

    @classmethod
    def gemma_26b_a4b(cls) -> ModelConfig:
        """The released DiffusionGemma 26B-A4B text shape (for speed work with random weights)."""
        text = TextConfig(
            vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
            num_global_key_value_heads=2, sliding_window=1024, num_experts=128, top_k_experts=8,
            moe_intermediate_size=704, max_position_embeddings=262_144,  # its 256K context (the class default: 128K)
        )
        return cls(text=text, canvas_length=256)

    # -- HF format -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
        raw = copy.deepcopy(raw)
        model_type = raw.get("model_type")
        if model_type not in (None, "diffusion_gemma"):
            raise ConfigError(f"model_type: expected 'diffusion_gemma', got {model_type!r}")
        text_raw = raw.pop("text_config", None)
        if text_raw is None:
            raise ConfigError("text_config: missing; a DiffusionGemma config.json nests the text model there")
        if not isinstance(text_raw, dict):
            raise ConfigError(f"text_config: expected a JSON object, got {type(text_raw).__name__}")
        text_type = text_raw.get("model_type")
        if text_type not in (None, "diffusion_gemma_text"):
            raise ConfigError(f"text_config.model_type: expected 'diffusion_gemma_text', got {text_type!r}")
        _read_rope_scaling(text_raw)
        factor = text_raw.pop("partial_rotary_factor", None)  # read once the layer kinds are known
        kwargs, text_extra = {}, {}
        for key, value in text_raw.items():
            if key in _TEXT_FIELDS:
                kwargs[key] = value
                continue
            if key != "model_type":  # written by to_dict itself
                text_extra[key] = value
            if key not in _IGNORED_TEXT_KEYS:
                warn_user(f"text_config.{key}: unknown field, ignored")
        try:
            text = TextConfig(**kwargs)
        except TypeError as exc:  # a field of the wrong kind that the dataclass itself rejects
            raise ConfigError(f"text_config: {exc}") from exc
        if factor is not None and not _fill_partial_rotary_factor(text, factor):
            text_extra["partial_rotary_factor"] = factor
            warn_user("text_config.partial_rotary_factor: ignored, as transformers ignores it where every layer kind's "
                      "rope_type is 'default'")
        canvas_length = raw.pop("canvas_length", 256)
        vision = raw.pop("vision_config", None)
        return cls(text=text, canvas_length=canvas_length, vision_config=vision, extra=raw, text_extra=text_extra)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:  # as UTF-8 (JSON's encoding, not the locale's), naming the file when it is not JSON or not an object
            raw = read_json_object(path, ConfigError)
        except FileNotFoundError:
            what = ("no such file" if path.name != "config.json"
                    else "no config.json; is this a Hugging Face checkpoint folder?")
            if path.name == "config.json" and (path.parent / "trainer_state.pt").is_file():
                # a `blockpress train` run cut short (a LoRA run merges, a full one saves, only when it ends)
                what = (f"no config.json: a training run that stopped before its final save; finish it with "
                        f"`blockpress train --resume --out {path.parent}` (--steps N to end it sooner)")
            raise FileNotFoundError(f"{path}: {what}") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:  # the field is named; the file too, as the weights' and generation config's errors do
            raise ConfigError(f"{path}: {exc}") from None

    def to_dict(self, dtype: Any = None) -> dict[str, Any]:
        """The config.json of this model; `dtype` (a torch dtype) is the one its weights are saved in."""
        text = copy.deepcopy(self.text_extra)
        text.update({f.name: copy.deepcopy(getattr(self.text, f.name)) for f in fields(TextConfig)})
        # transformers >= 5.15 stores the full layers' shape as per_layer_config alone (and reads it first); the
        # published checkpoint, and readers written for it (transformers 5.8, converters), as these two keys: both
        # are written, agreeing (a reader given per_layer_config alone would take its defaults for the full layers).
        if self.text.per_layer_config is not None:  # (None, set back after construction: the two keys stay, for
            # from_dict to draw it from them again)
            text.pop("global_head_dim")
            text.pop("num_global_key_value_heads")
            text.update(self.text.global_shape())
        text["model_type"] = "diffusion_gemma_text"
        out = dict(self.extra)
        out.update(
            model_type="diffusion_gemma",
            architectures=["DiffusionGemmaForBlockDiffusion"],
            text_config=text,
            canvas_length=self.canvas_length,
            tie_word_embeddings=True,
        )
        if self.vision_config is not None:
            out["vision_config"] = copy.deepcopy(self.vision_config)
        if dtype is not None:  # transformers loads in this dtype: the one read, whatever the file said before
            name = str(dtype).removeprefix("torch.")
            out.pop("torch_dtype", None)
            out["dtype"] = name
            if "dtype" in text or "torch_dtype" in text:  # a sub-config's own, where a writer put one: kept true
                text.pop("torch_dtype", None)
                text["dtype"] = name
        return out

    def save(self, path: str | Path, dtype: Any = None, quantization: dict[str, Any] | None = None) -> None:
        """config.json of weights saved in `dtype`; `quantization`: the `quantization_config` of weights saved
        quantized (quantize.quantization_config), None for plain ones (whatever a loaded config held). `path` is the
        file, or a folder to write its config.json in (as lm.save and transformers' save_pretrained take one): one
        that is there, or a path ending in a separator ("new_model/"), made."""
        target = Path(path)
        if target.is_dir() or str(path).endswith(("/", os.sep)):  # (a folder was an IsADirectoryError)
            target.mkdir(parents=True, exist_ok=True)
            target = target / "config.json"
        out = self.to_dict(dtype)
        out.pop("quantization_config", None)
        if quantization is not None:
            out["quantization_config"] = quantization
        target.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def num_parameters(self, active: bool = False) -> int:
        return self.text.num_parameters(active=active)

    def describe(self) -> str:
        t = self.text
        full = sum(1 for s in t.layers if not s.is_sliding)
        return (
            f"DiffusionGemma: {t.num_hidden_layers} layers ({t.num_hidden_layers - full} sliding/{full} full, "
            f"window {t.sliding_window}), hidden {t.hidden_size}, heads {t.num_attention_heads}, "
            f"experts {t.num_experts} top-{t.top_k_experts}, vocab {t.vocab_size}, canvas {self.canvas_length}, "
            f"context {t.max_position_embeddings}, "
            f"params {_human(self.num_parameters())} total / {_human(self.num_parameters(active=True))} active"
        )


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(text=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                           num_global_key_value_heads=1, sliding_window=32, num_experts=4, top_k_experts=2,
                           moe_intermediate_size=32, layer_types=[SLIDING, FULL]), canvas=16),
    "small": dict(text=dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                            num_global_key_value_heads=1, sliding_window=128, num_experts=8, top_k_experts=2,
                            moe_intermediate_size=256), canvas=64),
    "medium": dict(text=dict(vocab_size=16384, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=64, global_head_dim=128,
                             num_global_key_value_heads=2, sliding_window=256, num_experts=16, top_k_experts=4,
                             moe_intermediate_size=384, layer_types=[SLIDING, SLIDING, SLIDING, FULL]),
                   canvas=128),
}


def _last_layer_full(layer_types: list[str]) -> None:
    """Make the last of `layer_types` full attention, with a warning, where it is sliding (as the reference does)."""
    if layer_types and layer_types[-1] == SLIDING:
        warn_user("text_config.layer_types: the last layer must be full attention; forcing it")
        layer_types[-1] = FULL


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{1 if n < 10 * size else 0}f}{unit}"
    return str(n)


__all__ = ["ConfigError", "LayerSpec", "ModelConfig", "TextConfig", "SLIDING", "FULL"]


def preset_names() -> list[str]:
    """Every name ModelConfig.preset takes: what a --preset flag offers (a help that listed three of the four
    accepted 26b-a4b all the same)."""
    return sorted([*PRESETS, "26b-a4b"])
