"""A TP=2 engine over two GPUs (tests/test_host_copy.py checks the same copies over CPU pools): rank 0 maps
rank 1's pool on its own GPU (peer access), its gather and scatter of random blocks equal the per-rank
pools' heads bit for bit, from device and host frames, and KV that rank 0 scatters is what rank 1's process
attends over: a prompt admitted through the remote-KV port with its own exported KV decodes the tokens of
computing it. Marked gpu; skipped below two CUDA devices.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from pdserve.shared.engine.config import EngineConfig
from pdserve.shared.engine.engine import LLMEngine
from pdserve.shared.engine.request import Request
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.types import FirstToken, RequestId

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.extras,  # a CUDA engine runs the Triton kernels, the [gpu] extra
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
BLOCKS = 64
RANK0 = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    cfg = EngineConfig(model="dummy:llama-3.1-8b", device="cuda:0,1", tensor_parallel_size=2,
                       dtype="bfloat16", num_kv_blocks=BLOCKS, max_model_len=512, max_num_seqs=4,
                       cuda_graphs=False)  # fmt: skip
    e = LLMEngine(cfg)
    try:
        yield e
    finally:
        e.close()


def _finish(engine: LLMEngine, request_id: str) -> list[int]:
    """Steps until nothing is left; the tokens `request_id` got (after any emitted before)."""
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == request_id for t in out.token_ids]
    return tokens


def _local(engine: LLMEngine, prompt: list[int], salt: str, max_tokens: int = 6) -> tuple[Request, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = engine.new_request(RequestId(f"local-{salt}"), prompt, params, cache_salt=salt)
    engine.add_request(req)
    return req, _finish(engine, f"local-{salt}")


def _heads(engine: LLMEngine, layers: slice, ids: torch.Tensor) -> torch.Tensor:
    """What every rank's pool holds (copied to the host whole) for `layers` of blocks `ids`, in the
    model's head order: [nl, 2, n, B, H, D]."""
    parts = sorted(engine.pools.parts, key=lambda p: p.head_start)
    return torch.cat([p.kv[layers].cpu()[:, :, ids.cpu()] for p in parts], dim=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16)


def test_the_worker_pool_is_mapped_on_rank_0s_gpu(engine: LLMEngine) -> None:
    parts = engine.pools.parts
    assert len(parts) == 2 and [p.head_start for p in parts] == [0, 4]
    assert all(p.kv.device == RANK0 for p in parts), [p.kv.device for p in parts]
    assert parts[0].kv.data_ptr() != parts[1].kv.data_ptr()


def test_gather_and_scatter_equal_the_rank_pools_heads(engine: LLMEngine) -> None:
    _local(
        engine, [random.Random(1).randrange(1, 30000) for _ in range(200)], "fill"
    )  # real KV on both ranks
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(BLOCKS, generator=g)[:12].to(RANK0)
    shape = (2, 12, *engine.pools.block_shape)  # [2, n, B, H, D]
    for layer in (0, 13, 31):
        out = torch.empty(shape, dtype=torch.bfloat16, device=RANK0)
        engine.export_layer(layer, ids, out)
        torch.cuda.synchronize(RANK0)
        assert torch.equal(_bits(out), _bits(_heads(engine, slice(layer, layer + 1), ids)[0])), layer
    for first, where in ((8, RANK0), (20, torch.device("cpu"))):  # a frame on the GPU, then on the host
        frame = torch.randn((4, *shape), generator=g).to(torch.bfloat16).to(where)
        engine.import_layers(first, ids, frame)
        assert torch.equal(_bits(_heads(engine, slice(first, first + 4), ids)), _bits(frame))
        back = torch.empty(shape, dtype=torch.bfloat16, device=RANK0)
        engine.export_layer(first + 1, ids, back)
        torch.cuda.synchronize(RANK0)
        assert torch.equal(_bits(back), _bits(frame[1]))


def test_kv_scattered_by_rank_0_is_what_rank_1_attends_over(engine: LLMEngine) -> None:
    """The P/D path inside one node: the prompt's KV exported, imported into fresh blocks under another
    salt (no prefix shared), admitted with the first token: the decode equals the local one token for token,
    which it would not if rank 1 read its heads before rank 0's writes landed."""
    prompt = [random.Random(2).randrange(1, 30000) for _ in range(128)]  # 8 full blocks
    req, want = _local(engine, prompt, "a")
    held = engine.hold_prefix(engine.prompt_hashes(req))
    assert len(held) == 8
    frame = engine.export_buffer(engine.num_layers, len(held))  # [L, 2, n, B, H, D]
    ids = torch.tensor(held, dtype=torch.int64, device=RANK0)
    for layer in range(engine.num_layers):
        engine.export_layer(layer, ids, frame[layer])
    torch.cuda.synchronize(RANK0)
    engine.release_held(held)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    remote = engine.new_request(RequestId("remote"), prompt, params, cache_salt="b")
    reservation = engine.reserve_remote(engine.prompt_hashes(remote), len(held))
    assert reservation is not None and not reservation.held
    engine.import_layers(0, torch.tensor(reservation.dst, dtype=torch.int64, device=RANK0), frame)
    first = engine.admit_remote(remote, reservation, FirstToken(want[0]))
    got = list(first.token_ids) + _finish(engine, "remote")
    assert got == want
    audit = engine.audit()
    assert (audit.in_use, audit.reserved) == (0, 0), audit
