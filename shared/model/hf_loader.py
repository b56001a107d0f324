"""Reading a Hugging Face checkpoint directory: config.json and *.safetensors (single or sharded).

Tensors are memory-mapped by `safetensors.safe_open` and materialized one at a time when the model asks
for them; a tensor-parallel rank reads only its rows or columns (`get_slice`: just those bytes of the
map). The identity is SHA-256 over each shard's name, size and safetensors header (the JSON table of names,
dtypes, shapes and offsets): no pass over the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from typing import Any

import torch
from pdserve.shared.model.model_config import ModelConfig
from pdserve.shared.model.parallel import RowSlice
from safetensors import safe_open

WeightThunks = dict[str, Callable[[RowSlice | None], torch.Tensor]]
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024


def shard_files(path: str) -> list[str]:
    """The directory's safetensors shards, from the index if there is one. ValueError if there are none."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError("no *.safetensors files")
    return [os.path.join(path, n) for n in names]


def safetensors_header(file: str) -> bytes:
    """The 8-byte length prefix and the JSON header of one safetensors file."""
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file} is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{file} declares a {length}-byte header; not a safetensors file")
        header = f.read(length)
    if len(header) != length:
        raise ValueError(f"{file} is truncated inside its header")
    return prefix + header


def hf_identity(files: list[str]) -> bytes:
    h = hashlib.sha256(b"pdserve-safetensors-v1\0")
    for file in files:
        h.update(os.path.basename(file).encode() + b"\0")
        h.update(os.path.getsize(file).to_bytes(8, "little"))
        h.update(safetensors_header(file))
    return h.digest()


def read_hf_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf: dict[str, Any] = json.load(f)
    return ModelConfig.from_hf_config(hf)


def read_hf_dir(path: str) -> tuple[ModelConfig, WeightThunks, bytes]:
    """(config, {HF name: thunk returning the tensor}, weights identity). Raises ValueError or OSError."""
    config = read_hf_config(path)
    files = shard_files(path)
    identity = hf_identity(files)
    thunks: WeightThunks = {}
    for file in files:
        handle = safe_open(file, framework="pt", device="cpu")
        for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            thunks[name] = _thunk(handle, name)
    return config, thunks, identity


def _thunk(handle: Any, name: str) -> Callable[[RowSlice | None], torch.Tensor]:
    def read(part: RowSlice | None) -> torch.Tensor:
        if part is None:
            return handle.get_tensor(name)
        rows = handle.get_slice(name)
        index = slice(part.start, part.stop)
        tensor: torch.Tensor = rows[index] if part.dim == 0 else rows[:, index]
        return tensor

    return read
