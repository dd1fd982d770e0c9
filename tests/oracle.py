"""Loading the committed oracle fixtures (``tests/fixtures/*.npz``, written by ``tests/fixtures/hf_gemma3n_tiny.py``).

The fixtures of random models hold their weights. Those of the built-in trained model
(``tests/fixtures/trained/``, written with the oracle's ``--checkpoint``) hold only ids and logits: the weights
are the checkpoint's, and `load_checkpoint_case` checks that its files are the ones the logits came from."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
TRAINED = FIXTURES / "trained"


@dataclass
class OracleCase:
    name: str
    config: dict
    tensors: dict[str, np.ndarray]
    input_ids: np.ndarray
    logits: np.ndarray          # [steps, vocab], transformers' decode logits
    dtype: type                 # np.float64 for --float64 dumps, np.float32 otherwise


def load_case(path: Path) -> OracleCase:
    with np.load(path) as d:
        return OracleCase(
            name=path.stem,
            config=json.loads(str(d["config_json"])),
            tensors={k[2:]: d[k] for k in d.files if k.startswith("w/")},
            input_ids=d["input_ids"].astype(np.int64),
            logits=d["logits_decode"].astype(np.float64),
            dtype=np.float64 if str(d["dtype"]) == "float64" else np.float32,
        )


def fixture_paths(prefix: str = "") -> list[Path]:
    return sorted(FIXTURES.glob(f"{prefix}*.npz"))


def checkpoint_digest(directory: Path) -> str:
    """What the oracle records as ``checkpoint_sha256``: ``name:sha256`` of each ``*.safetensors``, joined by ';'."""
    files = sorted(Path(directory).glob("*.safetensors"))
    return ";".join(f"{f.name}:{hashlib.sha256(f.read_bytes()).hexdigest()}" for f in files)


def load_checkpoint_case(path: Path, checkpoint: str | Path) -> OracleCase:
    """An oracle fixture made with ``--checkpoint`` from `checkpoint`: its ids and logits with the checkpoint's
    config and tensors (as stored, bf16). AssertionError if the checkpoint's files are not those of the fixture."""
    from sim.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoint)
    with np.load(path) as d:
        recorded = str(d["checkpoint_sha256"])
        assert checkpoint_digest(ckpt.path) == recorded, (
            f"{path.name} was made from other checkpoint files than {checkpoint} ({recorded}); "
            f"run its command in tests/fixtures/README.md again")
        return OracleCase(
            name=path.stem,
            config=ckpt.config,
            tensors={name: np.asarray(t) for name, t in ckpt.items()},
            input_ids=d["input_ids"].astype(np.int64),
            logits=d["logits_decode"].astype(np.float64),
            dtype=np.float64 if str(d["dtype"]) == "float64" else np.float32,
        )
