"""Loading the committed oracle fixtures (``tests/fixtures/*.npz``, written by ``tests/fixtures/hf_gemma3n_tiny.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"


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
