"""Hugging Face checkpoint directories: ``config.json`` plus ``*.safetensors`` shards (with their
``model.safetensors.index.json``), read lazily tensor by tensor and written in exactly that format.

Reading never loads a whole shard: `Checkpoint` maps each tensor name to a `LazyTensor` whose rows are
read from the file on demand (the embedding lookups read one row), so E4B's 15 GB of bf16 weights can be
used on a 24 GB machine. bf16 arrives as `ml_dtypes.bfloat16` NumPy arrays. A `LazyTensor` indexes like the
array it stands for along its rows (``t[i]``, ``t[a:b]``), so code that reads rows of arrays (the ISS's
reference arithmetic) reads a checkpoint unchanged.

A directory that is not a readable Gemma 3n checkpoint is rejected when it is opened, with one message naming
the file and what was wrong: ``FileNotFoundError`` for a missing directory, ``config.json`` or shard;
``ValueError`` for a file that is not JSON, not a JSON object or not a safetensors file, and an index whose
``weight_map`` is malformed; ``TypeError`` or ``ValueError`` (prefixed with the ``config.json`` path) for a
config that `sim.config.ModelConfig.from_hf` rejects. Tensor dtypes and values are checked where they are used
(`sim.gemma3n.check_weight_dtype`, `sim.gemma3n.check_weight_values`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .config import ModelConfig, json_type

__all__ = ["Checkpoint", "LazyTensor", "write_checkpoint", "INDEX_NAME", "TEXT_PREFIX"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Prefix of the text decoder's tensors in the released (multimodal) Gemma 3n checkpoints.
TEXT_PREFIX = "model.language_model."


class LazyTensor:
    """One tensor of a safetensors file, read on demand (`rows`, `load`, or indexing along the rows).

    ``name`` is the tensor's name as stored, ``file`` its shard's file name and ``path`` the shard's path.
    ``t[i]`` is row i (negative i counts from the end), ``t[a:b:s]`` a slice of rows and ``t[i, ...]``
    indexes further into them, as NumPy would; ``np.asarray(t)`` loads the whole tensor."""

    def __init__(self, handle, name: str, file: str, path: str | None = None):
        self._slice = handle.get_slice(name)
        self.name = name
        self.file = file
        self.path = file if path is None else path
        self.shape = tuple(self._slice.get_shape())
        self.dtype_name = self._slice.get_dtype()

    @property
    def dtype(self):
        """The NumPy dtype the values arrive in (bf16: `ml_dtypes.bfloat16`); the safetensors name (a string)
        for a type NumPy has no dtype for."""
        return _DTYPES.get(self.dtype_name, self.dtype_name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPE_BYTES.get(self.dtype_name, 4)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self._slice[start:stop]

    def load(self) -> np.ndarray:
        return self._slice[:] if self.shape else np.asarray(self._slice[...])

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"tensor {self.name!r} is a scalar; it has no rows")
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, tuple):
            if not key or key[0] is Ellipsis:
                return self.load()[key]
            head, rest = key[0], key[1:]
            rows = self[head]
            return rows[(slice(None),) + rest] if isinstance(head, slice) else rows[rest]
        if key is Ellipsis:
            return self.load()
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                return self.rows(start, max(start, stop))
            index = np.arange(start, stop, step)
            if index.size == 0:
                return self.rows(0, 0)
            lo, hi = int(index.min()), int(index.max()) + 1
            return self.rows(lo, hi)[index - lo]
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"tensor {self.name!r} is indexed by row (an integer or a slice), not {key!r}")
        if not -n <= key < n:
            raise IndexError(f"row {key} is out of range for tensor {self.name!r} with {n} rows")
        row = int(key) % n
        return self.rows(row, row + 1)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self.load()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self):
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype_name}, file={self.file!r})"


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
                "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
           "F64": np.dtype(np.float64), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
           "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
           "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
           "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
           "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


def _read_json(path: Path, what: str):
    """The parsed JSON file `path` (a JSON object), or ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object ({what}), not {json_type(value)}")
    return value


class Checkpoint(Mapping):
    """A checkpoint directory opened for lazy reading: ``ckpt.config`` is the parsed ``config.json``,
    ``ckpt.model_config`` the `ModelConfig` it describes, ``ckpt[name]`` a `LazyTensor` (names as stored, e.g.
    with the ``model.language_model.`` prefix). Bad files are rejected here (module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.path)!r} does not exist")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"checkpoint {str(self.path)!r} has no config.json")
        self.config = _read_json(cfg_path, "the model config")
        try:
            self.model_config: ModelConfig = ModelConfig.from_hf(self.config)
        except (TypeError, ValueError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(f"{cfg_path}: {e}") from None
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            index = _read_json(index_path, "a shard index with a 'weight_map'")
            if not isinstance(index.get("weight_map"), dict):
                raise ValueError(f"{index_path} has no 'weight_map' object")
            weight_map: dict[str, str] = index["weight_map"]
            for name, file in weight_map.items():
                if not isinstance(file, str) or not file or Path(file).name != file:
                    raise ValueError(f"{index_path}: weight_map[{name!r}] must be the file name of a shard in "
                                     f"the directory, not {file!r}")
        elif (self.path / SINGLE_NAME).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"checkpoint {str(self.path)!r} has neither {INDEX_NAME} nor {SINGLE_NAME}")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
        self._handles = {}
        self._tensors: dict[str, LazyTensor] = {}
        for file in files:
            fpath = self.path / file
            if not fpath.is_file():
                raise FileNotFoundError(f"shard {file!r} named in {INDEX_NAME} is missing from {str(self.path)!r}")
            try:
                handle = safe_open(str(fpath), framework="numpy")
                self._handles[file] = handle
                for name in handle.keys():
                    if weight_map is not None and weight_map.get(name) != file:
                        continue  # the index is authoritative about which shard holds a tensor
                    self._tensors[name] = LazyTensor(handle, name, file, str(fpath))
            except SafetensorError as e:
                raise ValueError(f"{fpath}: not a readable safetensors file ({e})") from None
        if weight_map is not None:
            missing = [n for n in weight_map if n not in self._tensors]
            if missing:
                raise ValueError(f"tensor {missing[0]!r} is listed in {INDEX_NAME} under "
                                 f"{weight_map[missing[0]]!r} but that shard does not contain it"
                                 + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))

    def __getitem__(self, name: str) -> LazyTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())


def write_checkpoint(path: str | os.PathLike, config: Mapping, tensors: Mapping[str, np.ndarray], *,
                     prefix: str = TEXT_PREFIX, dtype=ml_dtypes.bfloat16,
                     max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write `tensors` as a Hugging Face checkpoint: ``config.json``, shards named
    ``model-00001-of-0000N.safetensors`` of at most `max_shard_bytes` each (a tensor is never split), and
    ``model.safetensors.index.json`` with ``metadata.total_size`` and ``weight_map``. Names get `prefix`;
    values are cast to `dtype` (bf16 like the released checkpoints). Returns the shard file names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    for name, value in tensors.items():
        arr = np.ascontiguousarray(np.asarray(value).astype(dtype))
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][prefix + name] = arr
        size += arr.nbytes
        total += arr.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    with open(path / INDEX_NAME, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
