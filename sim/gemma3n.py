"""The golden model: a NumPy Gemma 3n text decoder that computes what Hugging Face transformers computes.

Every other check in the project (the instruction-set simulator, the RTL) is measured against this
model, and this model is measured against transformers itself (``tests/fixtures``, made with
``tests/fixtures/hf_gemma3n_tiny.py``). It follows ``modeling_gemma3n.py`` of transformers 5.23 step by step, not the
pccx spec: ``docs/gemma3n-errata.md`` lists the ten places where the spec is wrong and the test that
pins each one. One decode step (`Model.step`) per token, with a KV cache:

- embedding x sqrt(D); AltUp init projections rescaled to the RMS of x0 (clamped mean square);
- per-layer inputs: projection x D^-0.5, RMSNorm per layer slice, plus the PLE table row (id mapped
  to 0 outside the PLE vocabulary) x sqrt(P), all x 1/sqrt(2);
- per layer: AltUp router + predict; input norm; LAuReL; Q/K/V with QK-norm and the scale-free
  V-norm; RoPE in the rotate-half layout with the layer type's theta; KV cache with cross-layer
  sharing; sliding window on sliding layers; GQA with no score scaling; o_proj; post-attention norm;
  the 1/sqrt(2) merge with LAuReL; FFN with Gaussian top-k (population std) on sparse layers and
  GELU-tanh; AltUp correct on the unscaled output; PLE gate on corrected[active] x
  correct_output_scale, mixed into streams 1.. only;
- unembed projections with magnitude matching, mean of the streams, final norm, tied LM head,
  soft-cap.

Arithmetic runs in the model's dtype (float64 or float32) throughout, with constants cast to it, so
float32 mode rounds where transformers' float32 run rounds (up to summation order).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from statistics import NormalDist

import numpy as np

from .config import ModelConfig, check_index

__all__ = ["Model", "Weights", "gaussian_std_multiplier", "gelu_tanh", "resolve_tensor_names", "check_weight_dtype",
           "check_weight_values", "FLOAT_DTYPES"]

# Component names of a multimodal Gemma 3n checkpoint that are not part of the text decoder.
_NON_TEXT_COMPONENTS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.",
                        "multi_modal_projector.")
_PREFIXES = ("model.language_model.", "model.")
# Row chunk for matrix-vector products on lazily loaded (e.g. bf16, memory-mapped) weights: bounds the
# temporary converted copy to about 64 MB in float64.
_CHUNK_BYTES = 64 * 2**20


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (``gelu_pytorch_tanh``), in the dtype of `x`."""
    dt = x.dtype.type
    inner = dt(math.sqrt(2.0 / math.pi)) * (x + dt(0.044715) * (x * x * x))
    return dt(0.5) * x * (dt(1.0) + np.tanh(inner))


def gaussian_std_multiplier(sparsity: float) -> float:
    """The Gaussian top-k cutoff multiplier for a target sparsity, as transformers computes it:
    ``Normal(0, 1).icdf(tensor(sparsity, float32))`` = erfinv(2p - 1) * sqrt(2), all in float32.
    For the 0.95 of Gemma 3n this is 1.6448535919189453 (the float32 nearest to the true 1.6448536270);
    the float64 golden model uses this float32 value, as transformers does in a float64 run."""
    p = np.float32(sparsity)
    y = float(np.float32(2.0) * p - np.float32(1.0))
    # erfinv in float64 (Newton on math.erf from the normal quantile), rounded to float32.
    x = NormalDist().inv_cdf((y + 1.0) / 2.0) / math.sqrt(2.0)
    for _ in range(3):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return float(np.float32(np.float32(x) * np.float32(math.sqrt(2.0))))


# The dtypes a weight may arrive in: what checkpoints store (bf16, fp16, fp32) and what NumPy computes in.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _weight_label(name: str, value) -> str:
    """How messages name a weight: a checkpoint's tensor by its stored name and shard file, an array by the
    canonical name it is used under."""
    path = getattr(value, "path", None)
    stored = getattr(value, "name", None)
    if isinstance(path, str) and isinstance(stored, str):
        return f"tensor {stored!r} in {path}"
    return f"tensor {name!r}"


def check_weight_dtype(name: str, value) -> None:
    """TypeError unless weight `value` (an array, or a lazy tensor with ``dtype``) holds floating-point numbers
    (`FLOAT_DTYPES`). `name` is its canonical name. The golden model (`Weights`), the packer
    (`firmware.pack.pack`) and the ISS (`sim.iss.Machine`, reference arithmetic) all check with this function,
    so they reject the same tensors with the same message."""
    dt = getattr(value, "dtype", None)
    if dt is None:
        dt = np.asarray(value).dtype
    if not (isinstance(dt, np.dtype) and dt.name in FLOAT_DTYPES):
        raise TypeError(f"{_weight_label(name, value)} has dtype {dt}; expected a floating-point tensor "
                        f"({', '.join(FLOAT_DTYPES)})")


def check_weight_values(name: str, value, data) -> None:
    """ValueError unless `data` (values read from weight `value`: all of it or some rows) is finite. Shared like
    `check_weight_dtype`; the message does not depend on which part was read."""
    if not np.all(np.isfinite(data)):
        raise ValueError(f"{_weight_label(name, value)} holds a non-finite value (NaN or infinity); weights must "
                         f"be finite")


def _as_float_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, not {dt}")
    return dt


class Weights:
    """The decoder's tensors under their canonical names (`ModelConfig.tensor_shapes`), checked for
    presence and shape, converted to the model's dtype.

    Values may be NumPy arrays or lazy tensors (anything with ``shape``, ``dtype``, ``rows(start, stop)`` and
    ``load()``, such as `sim.checkpoint.LazyTensor`). With ``lazy=False`` everything is converted once,
    tensor by tensor; with ``lazy=True`` 2-D tensors stay where they are (e.g. memory-mapped bf16) and
    are read in row chunks at every use, so a model larger than memory still runs.

    Every tensor is checked here, before the model exists: a non-floating-point dtype is a TypeError
    (`check_weight_dtype`), a NaN or an infinity a ValueError (`check_weight_values`), both naming the tensor
    (and its file). In lazy mode that reads each matrix once, in row chunks.
    """

    def __init__(self, config: ModelConfig, tensors: Mapping, dtype=np.float64, *, lazy: bool = False,
                 progress: Callable[[int, int, str], None] | None = None):
        self.config = config
        self.dtype = _as_float_dtype(dtype)
        self.lazy = lazy
        expected = config.tensor_shapes()
        canonical = resolve_tensor_names(config, tensors)
        for name in expected:
            check_weight_dtype(name, tensors[canonical[name]])
        self._store: dict[str, object] = {}
        for i, (name, shape) in enumerate(expected.items()):
            value = tensors[canonical[name]]
            if progress is not None:
                progress(i, len(expected), name)
            if lazy and len(shape) == 2:
                step = max(1, _CHUNK_BYTES // (8 * max(1, shape[1])))
                for r in range(0, shape[0], step):
                    check_weight_values(name, value, _rows(value, r, min(shape[0], r + step)))
                self._store[name] = value
            else:
                data = _load(value)
                check_weight_values(name, value, data)
                self._store[name] = self._convert(name, data)
        if progress is not None:
            progress(len(expected), len(expected), "")

    def _convert(self, name: str, value) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(value), dtype=self.dtype)

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._store[name]
        if isinstance(value, np.ndarray) and value.dtype == self.dtype:
            return value
        return self._convert(name, _load(value))

    def row(self, name: str, index: int) -> np.ndarray:
        value = self._store[name]
        if isinstance(value, np.ndarray):
            return self._convert(name, value[index])
        return self._convert(name, _rows(value, index, index + 1)[0])

    def matvec(self, name: str, x: np.ndarray) -> np.ndarray:
        """``W @ x`` for the ``[out, in]`` matrix `name` (i.e. ``x @ W.T``, a Linear layer)."""
        value = self._store[name]
        if isinstance(value, np.ndarray) and value.dtype == self.dtype:
            return value @ x
        rows = value.shape[0]
        step = max(1, _CHUNK_BYTES // (self.dtype.itemsize * max(1, value.shape[1])))
        out = np.empty(rows, dtype=self.dtype)
        for r in range(0, rows, step):
            out[r:r + step] = self._convert(name, _rows(value, r, min(rows, r + step))) @ x
        return out


def resolve_tensor_names(config: ModelConfig, tensors: Mapping) -> dict[str, str]:
    """Map every tensor the decoder reads (canonical name, `ModelConfig.tensor_shapes`) to its key in
    `tensors`, checking presence and shape. Keys may carry the ``model.language_model.`` or ``model.``
    prefix; vision/audio components, dead K/V tensors of KV-shared layers and a tied ``lm_head.weight``
    are ignored; anything else unknown, a duplicate, a missing tensor or a wrong shape raises
    `ValueError` naming the tensor and the expected shape."""
    expected = config.tensor_shapes()
    dead = set(config.dead_tensor_names())
    canonical: dict[str, str] = {}
    unknown = []
    for full in tensors:
        name = _canonical_name(full)
        if name is None or name in dead:
            continue
        if name not in expected:
            unknown.append(full)
            continue
        if name in canonical:
            raise ValueError(f"tensor {name!r} is given twice: as {canonical[name]!r} and as {full!r}")
        canonical[name] = full
    if unknown:
        raise ValueError(f"unknown tensor {unknown[0]!r}: not a Gemma 3n text-decoder tensor of this config"
                         + (f" ({len(unknown) - 1} more unknown)" if len(unknown) > 1 else ""))
    for name, shape in expected.items():
        if name not in canonical:
            raise ValueError(f"missing tensor {name!r} (expected shape {shape})")
        got = tuple(tensors[canonical[name]].shape)
        if got != shape:
            raise ValueError(f"tensor {canonical[name]!r} has shape {got}; expected {shape}")
    return canonical


def _load(value):
    return value.load() if hasattr(value, "load") else value


def _rows(value, start: int, stop: int):
    return value.rows(start, stop) if hasattr(value, "rows") else value[start:stop]


def _canonical_name(full: str) -> str | None:
    """Strip the ``model.language_model.`` / ``model.`` prefix; None for non-text components."""
    name = full
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith(_NON_TEXT_COMPONENTS):
        return None
    return name


class _KVStore:
    """K and V of one cache-owning layer. Sliding layers keep a ring of the last `window` positions
    (all they can ever see); full layers keep everything, growing geometrically."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: np.dtype, window: int | None):
        self.window = window
        cap = window if window is not None else 64
        self.k = np.zeros((cap, kv_heads, head_dim), dtype)
        self.v = np.zeros((cap, kv_heads, head_dim), dtype)
        self.pos = np.full(cap, -1, dtype=np.int64)
        self.count = 0

    def append(self, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        if self.window is not None:
            slot = pos % self.window
        else:
            slot = self.count
            if slot == len(self.pos):
                grow = len(self.pos)
                self.k = np.concatenate([self.k, np.zeros_like(self.k[:grow])])
                self.v = np.concatenate([self.v, np.zeros_like(self.v[:grow])])
                self.pos = np.concatenate([self.pos, np.full(grow, -1, dtype=np.int64)])
        self.k[slot], self.v[slot], self.pos[slot] = k, v, pos
        self.count += 1

    def view(self):
        n = min(self.count, len(self.pos))
        return self.k[:n], self.v[:n], self.pos[:n]


class Model:
    """Gemma 3n text decoder, one token per `step`.

    >>> m = Model.from_hf(config_dict, tensors, dtype=np.float64)
    >>> m.reset(); logits = m.step(2)      # soft-capped logits for the next position
    """

    def __init__(self, config: ModelConfig, weights: Weights):
        self.config = config
        self.weights = weights
        self.dtype = weights.dtype
        c = config
        dt = self.dtype.type
        self._eps = dt(c.rms_norm_eps)
        # The constants transformers keeps as buffers, cast to the model dtype as transformers does.
        self._embed_scale = dt(math.sqrt(c.hidden_size))
        self._ple_embed_scale = dt(math.sqrt(c.hidden_size_per_layer_input))
        self._ple_proj_scale = dt(c.hidden_size ** -0.5)
        self._ple_input_scale = dt(1.0 / math.sqrt(2.0))
        self._router_scale = dt(1.0 / c.hidden_size)
        self._std_multiplier = [dt(gaussian_std_multiplier(s)) if s > 0 else None
                                for s in c.activation_sparsity_pattern]
        half = np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim
        self._inv_freq = {theta: 1.0 / (theta ** half) for theta in (c.rope_theta_sliding, c.rope_theta_full)}
        self.reset()

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping | ModelConfig, tensors: Mapping[str, np.ndarray],
                dtype=np.float64) -> "Model":
        """From a Hugging Face config dict and tensors under HF names (with or without the
        ``model.language_model.`` / ``model.`` prefix), ``[out, in]`` layout. Dead K/V tensors of
        KV-shared layers and a tied ``lm_head.weight`` are ignored; a missing tensor or a wrong shape
        raises `ValueError` naming the tensor and the expected shape."""
        cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
        return cls(cfg, Weights(cfg, tensors, dtype))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype=np.float32, *, lazy: bool | None = None,
                        progress: Callable[[int, int, str], None] | None = None) -> "Model":
        """Load a checkpoint directory (``config.json``, ``*.safetensors`` shards with their index, bf16
        tensors), tensor by tensor. ``lazy=None`` keeps the matrices in the (memory-mapped) files when
        converting them all to `dtype` would take more than half of the machine's memory (E4B), and
        converts everything up front otherwise."""
        from .checkpoint import Checkpoint

        ckpt = Checkpoint(path)
        cfg = ckpt.model_config
        if lazy is None:
            needed = cfg.parameter_count() * np.dtype(dtype).itemsize
            lazy = needed > _physical_memory() // 2
        return cls(cfg, Weights(cfg, ckpt, dtype, lazy=lazy, progress=progress))

    def reset(self) -> None:
        """Clear the KV cache; the next `step` is position 0."""
        c = self.config
        self.position = 0
        self._kv = {i: _KVStore(c.num_key_value_heads, c.head_dim, self.dtype, self._window(i))
                    for i in c.kv_cache_layers}

    # --- one token ----------------------------------------------------------------------------------

    def step(self, token_id: int) -> np.ndarray:
        """Run token `token_id` at the current position; return the soft-capped logits [vocab]. `token_id` is a
        Python or NumPy integer (not a bool, not a float) in ``[0, vocab_size)``: TypeError or ValueError
        otherwise, as `firmware.runtime.Runtime.step` (`sim.config.check_index`)."""
        c = self.config
        token_id = check_index("token id", token_id, c.vocab_size, "the vocabulary")
        if self.position >= c.max_position_embeddings:
            raise ValueError(f"position {self.position} reaches max_position_embeddings "
                             f"({c.max_position_embeddings}); call reset()")
        pos = self.position
        x0 = self.weights.row("embed_tokens.weight", token_id) * self._embed_scale
        pli = self._per_layer_inputs(token_id, x0)
        xs = self._altup_init(x0)
        for i in range(c.num_hidden_layers):
            xs = self._layer(i, xs, pli[i], pos)
        logits = self._logits(xs)
        self.position += 1
        return logits

    def _per_layer_inputs(self, token_id: int, x0: np.ndarray) -> np.ndarray:
        c = self.config
        shape = (c.num_hidden_layers, c.hidden_size_per_layer_input)
        proj = self.weights.matvec("per_layer_model_projection.weight", x0) * self._ple_proj_scale
        proj = self._rms_norm(proj.reshape(shape), self.weights["per_layer_projection_norm.weight"])
        table = self.weights.row("embed_tokens_per_layer.weight", self._ple_id(token_id)).reshape(shape)
        return (proj + table * self._ple_embed_scale) * self._ple_input_scale

    def _ple_id(self, token_id: int) -> int:
        """Ids outside the PLE vocabulary (multimodal ids >= 262144 in E4B) read PLE row 0."""
        return token_id if 0 <= token_id < self.config.vocab_size_per_layer_input else 0

    def _altup_init(self, x0: np.ndarray) -> np.ndarray:
        target = self._rms(x0)
        streams = [x0]
        for k in range(self.config.altup_num_inputs - 1):
            proj = self.weights.matvec(f"altup_projections.{k}.weight", x0)
            streams.append(self._magnitude_match(proj, target))
        return np.stack(streams)

    def _magnitude_match(self, x: np.ndarray, target) -> np.ndarray:
        dt = self.dtype.type
        mag = np.sqrt(np.maximum(np.mean(x * x), dt(1e-5)))
        return x * target / mag

    def _layer(self, i: int, xs: np.ndarray, pli: np.ndarray, pos: int) -> np.ndarray:
        c, w = self.config, self.weights
        p = f"layers.{i}."
        a = c.altup_active_idx
        pred = self._altup_predict(i, xs)
        x_in = pred[a]
        x_norm = self._rms_norm(x_in, w[p + "input_layernorm.weight"])
        laurel = self._laurel(i, x_norm)
        attn = self._attention(i, x_norm, pos)
        attn = self._rms_norm(attn, w[p + "post_attention_layernorm.weight"])
        x_attn = ((x_in + attn) + laurel) / self.dtype.type(math.sqrt(2.0))
        h = self._rms_norm(x_attn, w[p + "pre_feedforward_layernorm.weight"])
        ffn = self._mlp(i, h)
        out = x_attn + self._rms_norm(ffn, w[p + "post_feedforward_layernorm.weight"])
        corrected = self._altup_correct(i, pred, out)
        gate = w.matvec(p + "per_layer_input_gate.weight", self._ple_gate_input(i, corrected))
        mixed = w.matvec(p + "per_layer_projection.weight", gelu_tanh(gate) * pli)
        corrected[1:] += self._rms_norm(mixed, w[p + "post_per_layer_input_norm.weight"])
        return corrected

    # --- AltUp --------------------------------------------------------------------------------------

    def _router(self, i: int, x: np.ndarray) -> np.ndarray:
        w = self.weights
        p = f"layers.{i}.altup."
        r = self._rms_norm(x, w[p + "router_norm.weight"]) * self._router_scale
        return np.tanh(w.matvec(p + "modality_router.weight", r))

    def _altup_predict(self, i: int, xs: np.ndarray) -> np.ndarray:
        n = self.config.altup_num_inputs
        m = self._router(i, xs[self.config.altup_active_idx])
        coefs = self.weights.matvec(f"layers.{i}.altup.prediction_coefs.weight", m).reshape(n, n)
        return xs + coefs @ xs

    def _altup_correct(self, i: int, pred: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Router and innovation both use the unscaled layer output (spec erratum D1)."""
        m = self._router(i, out)
        coefs = self.weights.matvec(f"layers.{i}.altup.correction_coefs.weight", m) + self.dtype.type(1.0)
        innovation = out - pred[self.config.altup_active_idx]
        return innovation[None, :] * coefs[:, None] + pred

    def _ple_gate_input(self, i: int, corrected: np.ndarray) -> np.ndarray:
        """``correct_output_scale`` applies only here, to the corrected active stream (erratum D1)."""
        x = corrected[self.config.altup_active_idx]
        if self.config.altup_correct_scale:
            x = x * self.weights[f"layers.{i}.altup.correct_output_scale"]
        return x

    # --- attention ----------------------------------------------------------------------------------

    def _window(self, layer: int) -> int | None:
        c = self.config
        return c.sliding_window if c.is_sliding(layer) else None

    def _attention(self, i: int, x: np.ndarray, pos: int) -> np.ndarray:
        c, w = self.config, self.weights
        p = f"layers.{i}.self_attn."
        theta = c.rope_theta(i)
        q = w.matvec(p + "q_proj.weight", x).reshape(c.num_attention_heads, c.head_dim)
        q = self._rope(self._rms_norm(q, w[p + "q_norm.weight"]), pos, theta)
        if not c.is_kv_shared(i):
            k = w.matvec(p + "k_proj.weight", x).reshape(c.num_key_value_heads, c.head_dim)
            k = self._rope(self._rms_norm(k, w[p + "k_norm.weight"]), pos, theta)
            v = self._v_norm(w.matvec(p + "v_proj.weight", x).reshape(c.num_key_value_heads, c.head_dim))
            self._kv[i].append(pos, k, v)
        keys, values, positions = self._kv[c.kv_source(i)].view()
        window = self._window(i)
        visible = positions <= pos
        if window is not None:
            visible &= positions > pos - window
        keys, values = keys[visible], values[visible]
        group = c.num_attention_heads // c.num_key_value_heads
        out = np.empty_like(q)
        for g in range(c.num_key_value_heads):
            heads = slice(g * group, (g + 1) * group)
            probs = self._softmax(self._scores(q[heads], keys[:, g]))
            out[heads] = probs @ values[:, g]
        return w.matvec(p + "o_proj.weight", out.reshape(-1))

    def _scores(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Q K^T with no 1/sqrt(d) scaling: QK-norm replaces it (erratum D6)."""
        return q @ k.T

    def _softmax(self, s: np.ndarray) -> np.ndarray:
        e = np.exp(s - np.max(s, axis=-1, keepdims=True))
        return e / np.sum(e, axis=-1, keepdims=True)

    def _v_norm(self, v: np.ndarray) -> np.ndarray:
        """RMSNorm without a gain, per KV head (erratum D3)."""
        return self._rms_norm(v, None)

    def _rope(self, x: np.ndarray, pos: int, theta: float) -> np.ndarray:
        """Rotate-half RoPE (erratum D4): pairs (x_j, x_{j+d/2}) rotate by pos * theta^(-2j/d)."""
        angle = pos * self._inv_freq[theta]
        cos = np.cos(angle).astype(self.dtype)
        sin = np.sin(angle).astype(self.dtype)
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    # --- FFN ----------------------------------------------------------------------------------------

    def _mlp(self, i: int, h: np.ndarray) -> np.ndarray:
        w = self.weights
        p = f"layers.{i}.mlp."
        gate = w.matvec(p + "gate_proj.weight", h)
        if self._std_multiplier[i] is not None:
            gate = self._gaussian_topk(gate, self._std_multiplier[i])
        up = w.matvec(p + "up_proj.weight", h)
        return w.matvec(p + "down_proj.weight", gelu_tanh(gate) * up)

    def _gaussian_topk(self, g: np.ndarray, multiplier) -> np.ndarray:
        """relu(g - (mean + multiplier * std)) with the population std (erratum D10)."""
        mean = np.mean(g)
        std = np.sqrt(np.mean((g - mean) ** 2))
        return np.maximum(g - (mean + std * multiplier), self.dtype.type(0.0))

    def _laurel(self, i: int, x: np.ndarray) -> np.ndarray:
        w = self.weights
        p = f"layers.{i}.laurel."
        r = w.matvec(p + "linear_right.weight", w.matvec(p + "linear_left.weight", x))
        return x + self._rms_norm(r, w[p + "post_laurel_norm.weight"])

    # --- output -------------------------------------------------------------------------------------

    def _logits(self, xs: np.ndarray) -> np.ndarray:
        c, w = self.config, self.weights
        target = self._rms(xs[0])
        streams = [xs[0]]
        for k in range(c.altup_num_inputs - 1):
            proj = w.matvec(f"altup_unembed_projections.{k}.weight", xs[k + 1])
            streams.append(self._magnitude_match(proj, target))
        x = self._rms_norm(np.mean(np.stack(streams), axis=0), w["norm.weight"])
        head = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        logits = w.matvec(head, x)
        if c.final_logit_softcapping is not None:
            cap = self.dtype.type(c.final_logit_softcapping)
            logits = np.tanh(logits / cap) * cap
        return logits

    # --- norms --------------------------------------------------------------------------------------

    def _rms(self, x: np.ndarray):
        return np.sqrt(np.mean(x * x))

    def _rms_norm(self, x: np.ndarray, gain: np.ndarray | None) -> np.ndarray:
        """x * (mean(x^2) + eps)^-1/2 * gain over the last axis; the gain is used as is (not 1 + gain)."""
        y = x * (np.mean(x * x, axis=-1, keepdims=True) + self._eps) ** self.dtype.type(-0.5)
        return y if gain is None else y * gain


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30
