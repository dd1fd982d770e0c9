"""Gemma 3n model dimensions: the single source of truth for every model-shaped number in the project.

`ModelConfig` is built from a Hugging Face ``config.json`` dict (`ModelConfig.from_hf`), either the text
config itself or the multimodal config that nests it under ``text_config``, or taken from a preset
(`PRESETS`: ``e4b`` is what ``google/gemma-3n-E4B`` ships, ``tiny`` is the random test model of
``tests/fixtures/hf_gemma3n_tiny.py``). Everything else that depends on the model's shape (the golden model, the weight
packer, the compiler, the tests) derives it from here: tensor names and shapes (`tensor_shapes`), KV
sharing (`kv_source`), layer types, RoPE thetas.

The module imports only the standard library, so the golden model runs without Amaranth.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ModelConfig", "PRESETS", "SLIDING", "FULL", "E4B_HF_CONFIG", "TINY_HF_CONFIG", "REQUIRED_HF_FIELDS",
           "check_index", "check_positive_int", "json_type"]

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# The hidden activation Gemma 3n uses; GELU with the tanh approximation.
GELU_TANH = "gelu_pytorch_tanh"

# ``Gemma3nTextConfig()`` defaults in transformers 5.23, which is what the E4B checkpoint's converter uses.
# These are the only place in the project where the E4B numbers are written.
E4B_HF_CONFIG: dict = {
    "model_type": "gemma3n_text",
    "vocab_size": 262_400,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size": 2048,
    "intermediate_size": 16_384,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size_per_layer_input": 256,
    "laurel_rank": 64,
    "altup_num_inputs": 4,
    "altup_active_idx": 0,
    "altup_correct_scale": True,
    "altup_coef_clip": 120.0,
    "num_kv_shared_layers": 15,
    "sliding_window": 512,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "hidden_activation": GELU_TANH,
    "max_position_embeddings": 32_768,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

# The tiny random model of ``tests/fixtures/hf_gemma3n_tiny.py`` with its default arguments: every
# structural feature of E4B (AltUp x4, LAuReL, PLE, QK- and V-norm, 4 sliding : 1 full layers with two
# thetas, KV sharing, Gaussian top-k, soft-cap, tied head) at a size that runs in milliseconds.
TINY_HF_CONFIG: dict = {
    **E4B_HF_CONFIG,
    "vocab_size": 320,
    "vocab_size_per_layer_input": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 10,
    "head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
    "num_kv_shared_layers": 5,
    "sliding_window": 4,
    "activation_sparsity_pattern": [0.95] * 3 + [0.0] * 7,
    "max_position_embeddings": 512,
}


# The fields a Gemma 3n text config must give: every one sets a tensor's shape or which tensors exist, and
# the released models differ in them (E2B and E4B), so no default is safe. transformers writes them all into
# a checkpoint's config.json. The other fields take ``Gemma3nTextConfig``'s defaults (E4B_HF_CONFIG).
REQUIRED_HF_FIELDS = ("vocab_size", "vocab_size_per_layer_input", "hidden_size", "intermediate_size",
                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "hidden_size_per_layer_input", "laurel_rank", "altup_num_inputs", "num_kv_shared_layers")

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def json_type(value) -> str:
    """What a parsed JSON value is, for messages: 'an object', 'an array', 'a string', 'a number', ..."""
    return _JSON_TYPES.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def check_index(name: str, value, stop: int, within: str) -> int:
    """`value` as an `int` for an argument that must be an integer in ``[0, stop)``: Python and NumPy integers,
    not bools. TypeError ``"<name> must be an integer, not <value>"`` or ValueError ``"<name> <value> is outside
    <within> [0, <stop>)"`` (the runtime's, the golden model's and the ISS's token and position checks)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {value!r}") from None
    if not 0 <= index < stop:
        raise ValueError(f"{name} {index} is outside {within} [0, {stop})")
    return index


def check_positive_int(name: str, value) -> int:
    """`value` as an `int` for an argument that must be a positive integer (Python or NumPy, not bool): TypeError
    or ValueError ``"<name> must be a positive integer, not <value>"``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise TypeError(f"{name} must be a positive integer, not {value!r}")
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return number


def _number(key: str, value) -> float:
    """A JSON number (not a bool, not a string) as a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{key} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, not {value!r}")
    return float(value)


def _flag(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false, not {value!r}")
    return value


def _list(key: str, value, what: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{key} must be a list of {what}, not {value!r}")
    return tuple(value)


def _default_layer_types(n_layers: int) -> tuple[str, ...]:
    # transformers 5.x default and the E4B pattern: every fifth layer is a full-attention layer.
    return tuple(FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n_layers))


def _default_sparsity(n_layers: int) -> tuple[float, ...]:
    # transformers' default: the first 10 layers are sparse, but only when there are more than 10 layers.
    n_sparse = 10 if n_layers > 10 else 0
    return (0.95,) * n_sparse + (0.0,) * (n_layers - n_sparse)


def _check_int(name: str, value, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The dimensions and structural choices of a Gemma 3n text decoder.

    Field names and meanings are those of Hugging Face's ``Gemma3nTextConfig``. Per-layer lists are
    tuples with one entry per layer. The constructor validates everything and raises `TypeError` or
    `ValueError` with a message naming the field.
    """

    vocab_size: int
    vocab_size_per_layer_input: int
    hidden_size: int
    intermediate_size: tuple[int, ...]
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size_per_layer_input: int
    laurel_rank: int
    altup_num_inputs: int
    altup_active_idx: int
    altup_correct_scale: bool
    num_kv_shared_layers: int
    activation_sparsity_pattern: tuple[float, ...]
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_theta_sliding: float
    rope_theta_full: float
    final_logit_softcapping: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int = 2

    def __post_init__(self):
        for name in ("vocab_size", "vocab_size_per_layer_input", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size_per_layer_input",
                     "laurel_rank", "altup_num_inputs", "sliding_window", "max_position_embeddings"):
            _check_int(name, getattr(self, name))
        _check_int("num_kv_shared_layers", self.num_kv_shared_layers, minimum=0)
        _check_int("altup_active_idx", self.altup_active_idx, minimum=0)
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            _check_int(name, getattr(self, name), minimum=0)
        n = self.num_hidden_layers
        if self.vocab_size_per_layer_input > self.vocab_size:
            raise ValueError(f"vocab_size_per_layer_input ({self.vocab_size_per_layer_input}) must not exceed "
                             f"vocab_size ({self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, not {self.head_dim!r}")
        if self.altup_active_idx >= self.altup_num_inputs:
            raise ValueError(f"altup_active_idx ({self.altup_active_idx}) must be below altup_num_inputs "
                             f"({self.altup_num_inputs})")
        if self.altup_num_inputs < 2:
            raise ValueError(f"altup_num_inputs must be at least 2, not {self.altup_num_inputs!r}")
        for name in ("intermediate_size", "activation_sparsity_pattern", "layer_types"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                raise TypeError(f"{name} must be a tuple with one entry per layer, not {value!r}")
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries; expected one per layer "
                                 f"(num_hidden_layers = {n})")
        for i, size in enumerate(self.intermediate_size):
            _check_int(f"intermediate_size[{i}]", size)
        for i, s in enumerate(self.activation_sparsity_pattern):
            if not isinstance(s, float) or not 0.0 <= s < 1.0:
                raise ValueError(f"activation_sparsity_pattern[{i}] must be a float in [0, 1), not {s!r}")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] is {t!r}; expected one of {', '.join(LAYER_TYPES)}")
        if self.num_kv_shared_layers >= n:
            raise ValueError(f"num_kv_shared_layers ({self.num_kv_shared_layers}) must be below "
                             f"num_hidden_layers ({n})")
        if self.num_kv_shared_layers:
            producers = set(self.layer_types[:self.first_kv_shared_layer])
            missing = sorted(set(self.layer_types[self.first_kv_shared_layer:]) - producers)
            if missing:
                raise ValueError(f"num_kv_shared_layers = {self.num_kv_shared_layers} leaves no non-shared "
                                 f"{', '.join(missing)} layer whose KV cache the shared layers could reuse")
        for name in ("rope_theta_sliding", "rope_theta_full", "rms_norm_eps"):
            v = getattr(self, name)
            if not isinstance(v, float) or not v > 0:
                raise ValueError(f"{name} must be a positive float, not {v!r}")
        if self.final_logit_softcapping is not None and not (
                isinstance(self.final_logit_softcapping, float) and self.final_logit_softcapping > 0):
            raise ValueError(f"final_logit_softcapping must be a positive float or None, "
                             f"not {self.final_logit_softcapping!r}")
        for name in ("altup_correct_scale", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, not {getattr(self, name)!r}")

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping) -> "ModelConfig":
        """Build from a Hugging Face config dict (``Gemma3nTextConfig`` or ``Gemma3nConfig`` with
        ``text_config``), as found in a checkpoint's ``config.json``. Accepts the transformers 5.x
        (``rope_parameters``) and 4.5x (``rope_theta`` / ``rope_local_base_freq``) spellings. The fields of
        `REQUIRED_HF_FIELDS` (the tensor dimensions) must be present; the others take transformers' defaults
        when absent. A value of the wrong JSON type is a TypeError naming the field, never converted (``"64"``
        is not 64); in a nested config the message starts with ``text_config:``."""
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping (a parsed config.json), not {type(config).__name__}")
        if "text_config" not in config:
            return cls._from_text_config(config)
        text = config["text_config"]
        if not isinstance(text, Mapping):
            raise TypeError(f"text_config must be an object (the text decoder's config), not {json_type(text)}")
        try:
            return cls._from_text_config(text)
        except (TypeError, ValueError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(f"text_config: {e}") from None

    @classmethod
    def _from_text_config(cls, config: Mapping) -> "ModelConfig":
        model_type = config.get("model_type", "gemma3n_text")
        if model_type not in ("gemma3n_text", "gemma3n"):
            raise ValueError(f"model_type is {model_type!r}; this model implements 'gemma3n_text'")
        missing = [key for key in REQUIRED_HF_FIELDS if key not in config]
        if missing:
            raise ValueError(f"missing required field{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))} (a Gemma 3n text config gives every tensor dimension)")
        defaults = E4B_HF_CONFIG

        def get(key):
            value = config.get(key)
            return defaults.get(key) if value is None and key not in REQUIRED_HF_FIELDS else value

        n = get("num_hidden_layers")
        _check_int("num_hidden_layers", n)
        inter = get("intermediate_size")
        if isinstance(inter, (list, tuple)):
            inter = tuple(inter)
        elif isinstance(inter, int) and not isinstance(inter, bool):
            inter = (inter,) * n
        else:
            raise TypeError(f"intermediate_size must be an integer or a list of one integer per layer, not {inter!r}")
        layer_types = config.get("layer_types")
        layer_types = _default_layer_types(n) if layer_types is None else \
            _list("layer_types", layer_types, "one layer type per layer")
        sparsity = config.get("activation_sparsity_pattern")
        if sparsity is None:
            sparsity = _default_sparsity(n)
        elif isinstance(sparsity, (list, tuple)):
            sparsity = tuple(_number(f"activation_sparsity_pattern[{i}]", s) for i, s in enumerate(sparsity))
        else:
            sparsity = (_number("activation_sparsity_pattern", sparsity),) * n
        theta = _rope_thetas(config)
        act = get("hidden_activation")
        if act != GELU_TANH:
            raise ValueError(f"hidden_activation is {act!r}; Gemma 3n uses {GELU_TANH!r}")
        if _flag("attention_bias", config.get("attention_bias", False)):
            raise ValueError("attention_bias = True is not Gemma 3n; the model has no projection biases")
        eos = get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            if not eos:
                raise ValueError("eos_token_id must be an integer or a non-empty list of integers, not []")
            eos = eos[0]
        softcap = config.get("final_logit_softcapping", defaults["final_logit_softcapping"])
        return cls(
            vocab_size=get("vocab_size"),
            vocab_size_per_layer_input=get("vocab_size_per_layer_input"),
            hidden_size=get("hidden_size"),
            intermediate_size=inter,
            num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            hidden_size_per_layer_input=get("hidden_size_per_layer_input"),
            laurel_rank=get("laurel_rank"),
            altup_num_inputs=get("altup_num_inputs"),
            altup_active_idx=config.get("altup_active_idx", defaults["altup_active_idx"]),
            altup_correct_scale=_flag("altup_correct_scale",
                                      config.get("altup_correct_scale", defaults["altup_correct_scale"])),
            num_kv_shared_layers=get("num_kv_shared_layers"),
            activation_sparsity_pattern=sparsity,
            layer_types=layer_types,
            sliding_window=get("sliding_window"),
            rope_theta_sliding=theta[SLIDING],
            rope_theta_full=theta[FULL],
            final_logit_softcapping=None if softcap is None else _number("final_logit_softcapping", softcap),
            rms_norm_eps=_number("rms_norm_eps", get("rms_norm_eps")),
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=_flag("tie_word_embeddings", config.get("tie_word_embeddings", True)),
            pad_token_id=config.get("pad_token_id", defaults["pad_token_id"]),
            eos_token_id=eos,
            bos_token_id=get("bos_token_id"),
        )

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}") \
                from None

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_hf(json.load(f))

    def to_hf(self) -> dict:
        """The ``Gemma3nTextConfig`` dict (5.x spelling) that `from_hf` turns back into this config."""
        d = dataclasses.asdict(self)
        d["intermediate_size"] = list(self.intermediate_size)
        d["activation_sparsity_pattern"] = list(self.activation_sparsity_pattern)
        d["layer_types"] = list(self.layer_types)
        d["rope_parameters"] = {
            SLIDING: {"rope_type": "default", "rope_theta": d.pop("rope_theta_sliding")},
            FULL: {"rope_type": "default", "rope_theta": d.pop("rope_theta_full")},
        }
        d.update(model_type="gemma3n_text", hidden_activation=GELU_TANH, attention_bias=False,
                 architectures=["Gemma3nForCausalLM"])
        return d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --- derived quantities -------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def ple_dim(self) -> int:
        """Width of one token's per-layer-embedding row: every layer's slice, layer-major."""
        return self.num_hidden_layers * self.hidden_size_per_layer_input

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def rope_theta(self, layer: int) -> float:
        return self.rope_theta_sliding if self.is_sliding(layer) else self.rope_theta_full

    def is_kv_shared(self, layer: int) -> bool:
        return self.num_kv_shared_layers > 0 and layer >= self.first_kv_shared_layer

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache `layer` attends over: itself, or for a KV-shared layer the last
        non-shared layer of the same type (transformers' ``kv_sharing_modes`` 'store' layer)."""
        if not self.is_kv_shared(layer):
            return layer
        first = self.first_kv_shared_layer
        kind = self.layer_types[layer]
        return max(i for i in range(first) if self.layer_types[i] == kind)

    @property
    def kv_cache_layers(self) -> tuple[int, ...]:
        """The layers that compute and store K and V (all layers below the first KV-shared one)."""
        return tuple(range(self.first_kv_shared_layer))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.activation_sparsity_pattern) if s > 0.0)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the text decoder reads: Hugging Face name (without the ``model.`` /
        ``model.language_model.`` prefix) -> shape in HF ``[out, in]`` layout. Dead K/V weights of
        KV-shared layers are not listed, nor is a tied ``lm_head.weight``."""
        D, P, n = self.hidden_size, self.hidden_size_per_layer_input, self.altup_num_inputs
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (self.vocab_size, D),
            "embed_tokens_per_layer.weight": (self.vocab_size_per_layer_input, self.ple_dim),
            "per_layer_model_projection.weight": (self.ple_dim, D),
            "per_layer_projection_norm.weight": (P,),
        }
        for k in range(n - 1):
            shapes[f"altup_projections.{k}.weight"] = (D, D)
        for k in range(n - 1):
            shapes[f"altup_unembed_projections.{k}.weight"] = (D, D)
        shapes["norm.weight"] = (D,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, D)
        for i in range(self.num_hidden_layers):
            F = self.intermediate_size[i]
            p = f"layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (self.q_dim, D)
            if not self.is_kv_shared(i):
                shapes[p + "self_attn.k_proj.weight"] = (self.kv_dim, D)
                shapes[p + "self_attn.v_proj.weight"] = (self.kv_dim, D)
            shapes[p + "self_attn.o_proj.weight"] = (D, self.q_dim)
            shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
            if not self.is_kv_shared(i):
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm", "post_per_layer_input_norm"):
                shapes[p + norm + ".weight"] = (D,)
            shapes[p + "mlp.gate_proj.weight"] = (F, D)
            shapes[p + "mlp.up_proj.weight"] = (F, D)
            shapes[p + "mlp.down_proj.weight"] = (D, F)
            shapes[p + "laurel.linear_left.weight"] = (self.laurel_rank, D)
            shapes[p + "laurel.linear_right.weight"] = (D, self.laurel_rank)
            shapes[p + "laurel.post_laurel_norm.weight"] = (D,)
            shapes[p + "altup.router_norm.weight"] = (D,)
            shapes[p + "altup.modality_router.weight"] = (n, D)
            shapes[p + "altup.prediction_coefs.weight"] = (n * n, n)
            shapes[p + "altup.correction_coefs.weight"] = (n, n)
            shapes[p + "altup.correct_output_scale"] = (D,)
            shapes[p + "per_layer_input_gate.weight"] = (P, D)
            shapes[p + "per_layer_projection.weight"] = (D, P)
        return shapes

    def dead_tensor_names(self) -> tuple[str, ...]:
        """Tensors a checkpoint may carry that the model must ignore: the K/V projections and K-norm of
        KV-shared layers (the converter writes them for every layer) and a tied ``lm_head.weight``."""
        names = [f"layers.{i}.self_attn.{t}.weight" for i in range(self.num_hidden_layers)
                 if self.is_kv_shared(i) for t in ("k_proj", "v_proj", "k_norm")]
        if self.tie_word_embeddings:
            names.append("lm_head.weight")
        return tuple(names)

    def parameter_count(self) -> int:
        """Number of weights the decoder reads (dead and tied tensors not counted)."""
        return sum(math.prod(shape) for shape in self.tensor_shapes().values())


def _rope_thetas(config: Mapping) -> dict[str, float]:
    rp = config.get("rope_parameters")
    if rp is None and config.get("rope_scaling"):
        raise ValueError(f"rope_scaling {config['rope_scaling']!r} is not supported; Gemma 3n uses plain RoPE")
    if rp is not None and not isinstance(rp, Mapping):
        raise TypeError(f"rope_parameters must be an object with one entry per layer type, not {rp!r}")
    defaults = E4B_HF_CONFIG["rope_parameters"]
    legacy = {SLIDING: "rope_local_base_freq", FULL: "rope_theta"}
    thetas = {}
    for kind in LAYER_TYPES:
        params = (rp or {}).get(kind) or {}
        if not isinstance(params, Mapping):
            raise TypeError(f"rope_parameters[{kind!r}] must be an object, not {params!r}")
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_parameters[{kind!r}] has rope_type {rope_type!r}; only 'default' "
                             f"(unscaled) RoPE is supported")
        if params.get("rope_theta") is not None:
            key, theta = f"rope_parameters[{kind!r}]['rope_theta']", params["rope_theta"]
        else:
            key, theta = legacy[kind], config.get(legacy[kind])
        thetas[kind] = defaults[kind]["rope_theta"] if theta is None else _number(key, theta)
    return thetas


PRESETS: dict[str, ModelConfig] = {
    "e4b": ModelConfig.from_hf(E4B_HF_CONFIG),
    "tiny": ModelConfig.from_hf(TINY_HF_CONFIG),
}
