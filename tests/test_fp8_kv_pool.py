"""An FP8 KV cache's memory (shared/engine/config.py kv_cache_dtype): a block takes half of bf16's bytes, so
the same KV budget holds twice the tokens; the layout names the dtype, so P and D compare it."""

from __future__ import annotations

import pytest
import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.model_runner import kv_bytes_per_block, size_kv_pool
from pdserve.tests.harness.graphs import tiny_loaded


def test_an_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_bytes() -> None:
    loaded = tiny_loaded(torch.device("cpu"), torch.bfloat16)
    budget = 8 << 20
    bf16 = EngineConfig(model="dummy:tiny", dtype="bfloat16", kv_cache_bytes=budget)
    fp8 = EngineConfig(model="dummy:tiny", dtype="bfloat16", kv_cache_bytes=budget, kv_cache_dtype="fp8")
    assert (bf16.kv_dtype_name, fp8.kv_dtype_name) == ("bfloat16", "float8_e4m3fn")
    assert fp8.torch_kv_dtype == torch.float8_e4m3fn and fp8.torch_dtype == torch.bfloat16  # weights stay
    assert kv_bytes_per_block(loaded, fp8) * 2 == kv_bytes_per_block(loaded, bf16)
    assert size_kv_pool(fp8, loaded, 128) == 2 * size_kv_pool(bf16, loaded, 128)


@pytest.mark.parametrize(
    ("bad", "message"),
    [({"kv_cache_dtype": "int8"}, r"kv_cache_dtype='int8': accepted auto, fp8"),
     ({"quantization": "int4"}, r"quantization='int4': accepted fp8")],
)  # fmt: skip
def test_kv_cache_dtype_and_quantization_are_checked_at_construction(
    bad: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="dummy:tiny", **bad)  # type: ignore[arg-type]
