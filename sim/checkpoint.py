"""Hugging Face checkpoint directories: ``config.json`` plus ``*.safetensors`` shards (with their
``model.safetensors.index.json``), read lazily tensor by tensor and written in exactly that format.

Reading never loads a whole shard: `Checkpoint` maps each tensor name to a `LazyTensor` whose rows are
read from the file on demand (the embedding lookups read one row), so E4B's 15 GB of bf16 weights can be
used on a 24 GB machine. bf16 arrives as `ml_dtypes.bfloat16` NumPy arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

__all__ = ["Checkpoint", "LazyTensor", "write_checkpoint", "INDEX_NAME", "TEXT_PREFIX"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Prefix of the text decoder's tensors in the released (multimodal) Gemma 3n checkpoints.
TEXT_PREFIX = "model.language_model."


class LazyTensor:
    """One tensor of a safetensors file, read on demand (`rows`, `load`)."""

    def __init__(self, handle, name: str, file: str):
        self._slice = handle.get_slice(name)
        self.name = name
        self.file = file
        self.shape = tuple(self._slice.get_shape())
        self.dtype_name = self._slice.get_dtype()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPE_BYTES.get(self.dtype_name, 4)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self._slice[start:stop]

    def load(self) -> np.ndarray:
        return self._slice[:] if self.shape else np.asarray(self._slice[...])

    def __repr__(self):
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype_name}, file={self.file!r})"


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1}


class Checkpoint(Mapping):
    """A checkpoint directory opened for lazy reading: ``ckpt.config`` is the parsed ``config.json``,
    ``ckpt[name]`` a `LazyTensor` (names as stored, e.g. with the ``model.language_model.`` prefix)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.path)!r} does not exist")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"checkpoint {str(self.path)!r} has no config.json")
        with open(cfg_path, encoding="utf-8") as f:
            self.config = json.load(f)
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
            if not isinstance(index.get("weight_map"), dict):
                raise ValueError(f"{index_path} has no 'weight_map' object")
            weight_map: dict[str, str] = index["weight_map"]
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
            handle = safe_open(str(fpath), framework="numpy")
            self._handles[file] = handle
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != file:
                    continue  # the index is authoritative about which shard holds a tensor
                self._tensors[name] = LazyTensor(handle, name, file)
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
