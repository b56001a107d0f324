"""A GGUF file's header: its metadata and tensor table, parsed with `struct` over an mmap.

Owns the format's layout (v2 and v3) and nothing about models or tokenizers, and imports neither torch nor
transformers, so a process that needs only a GGUF's metadata (the router's tokenizer) does not load them.
The `gguf` package supplies the constants; its `GGUFReader` is not used: it builds a numpy memmap view per
vocabulary string, seconds for SmolLM2's 98k strings. Arrays of strings (vocabularies, merges) are walked
and kept as their length unless the caller names them; then they are decoded.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dims fastest-first)
    qtype: GGMLQuantizationType
    start: int  # absolute file offset
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # scalars and strings; arrays of strings: their length, or the list where named
    tensors: dict[str, GGUFTensor]
    data_start: int


def parse_header(buf: mmap.mmap, string_arrays: Container[str] = ()) -> GGUFHeader:
    """Metadata and tensor table of a GGUF v2/v3 file; the arrays of strings under `string_arrays` are
    decoded. ValueError (naming the problem) if malformed."""
    magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
    if magic != GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2, 3)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _read_str(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, GGUFValueType(vtype), key in string_arrays)
    tensors: dict[str, GGUFTensor] = {}
    infos = []
    for _ in range(n_tensors):
        name, pos = _read_str(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset))
    align = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-pos // align) * align
    for name, shape, qtype, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(shape)
        tensors[name] = GGUFTensor(name, shape, qtype, data_start + offset, n_elements // block * block_bytes)
    return GGUFHeader(metadata, tensors, data_start)


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n


def _read_value(buf: mmap.mmap, pos: int, vtype: GGUFValueType, decode: bool = False) -> tuple[Any, int]:
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, pos)
    if vtype != GGUFValueType.ARRAY:
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if GGUFValueType(etype) == GGUFValueType.STRING:  # vocabularies: walked, decoded only when asked for
        if decode:
            strings = []
            for _ in range(count):
                text, pos = _read_str(buf, pos)
                strings.append(text)
            return strings, pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return count, pos
    if GGUFValueType(etype) == GGUFValueType.ARRAY:
        raise ValueError("nested GGUF arrays are not supported")
    fmt = _SCALAR_FORMATS[GGUFValueType(etype)]
    return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), pos + count * struct.calcsize(fmt)
