"""Programmatic dependent launch (kernels/pdl.py) on the GPU: a chain of the decode step's kernels, each
allowed to start while the one before it runs, captured in a CUDA graph and replayed, gives the same bits as
the same launches with the device drained after each one (where no two kernels can overlap). Marked gpu."""

from __future__ import annotations

import pytest
import torch
import triton
from pdserve.kernels import triton_fused
from pdserve.kernels.gemv_configs import GemvConfig
from pdserve.kernels.pdl import uses_pdl
from pdserve.kernels.triton_gemv import gemv, gemv_silu_mul
from pdserve.kernels.triton_moe_decode import fused_route, moe_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.extras,  # needs triton, the [gpu] extra
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(bool(triton.knobs.runtime.interpret), reason="Triton is interpreting here"),
]
E, F, LAYERS, EXPERTS, TOP_K = 1024, 2816, 6, 16, 4
SPLIT = GemvConfig(block_n=2, block_k=512, num_warps=4, num_stages=2, split_k=4)  # a split-K reduce too


def _chain(x: torch.Tensor, w: dict[str, list[torch.Tensor]], drain: bool) -> torch.Tensor:
    """x: [1, E] -> [1, E] through LAYERS of norm, GEMV, add + norm, gate|up with SiLU x up, split-K down,
    and a routed MoE; `drain`: the device synchronised after every launcher (no overlap possible)."""

    def step(t: torch.Tensor) -> torch.Tensor:
        if drain:
            torch.cuda.synchronize()
        return t

    residual = x.clone()
    h = step(triton_fused.rms_norm(x, None, w["norm"][0], 1e-5))
    for i in range(LAYERS):
        o = step(gemv(h, w["o"][i], None))  # [1, E]
        h = step(triton_fused.rms_norm(o, residual, w["norm"][i], 1e-5))  # residual += o
        act = step(gemv_silu_mul(h, w["gate_up"][i]))  # [1, F]
        down = step(gemv(act, w["down"][i], None, SPLIT))  # [1, E]
        h = step(triton_fused.rms_norm(down, residual, w["norm"][i], 1e-5))
        routing = fused_route(step(gemv(h, w["router"][i], None)), TOP_K, True)
        step(routing.ids)
        moe = step(moe_decode(h, w["experts_gate_up"][i], w["experts_down"][i], routing))
        h = step(triton_fused.rms_norm(moe, residual, w["norm"][i], 1e-5))
    return torch.cat([h, residual])  # [2, E]


def test_pdl_chain_in_a_graph_equals_the_drained_launches() -> None:
    dev = torch.device("cuda")
    assert uses_pdl(dev) == (torch.cuda.get_device_capability(dev)[0] >= 9)
    gen = torch.Generator(device=dev).manual_seed(5)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(torch.bfloat16)

    w = {
        "norm": [rand(E, scale=1.0) + 1.0 for _ in range(LAYERS)],
        "o": [rand(E, E) for _ in range(LAYERS)],
        "gate_up": [rand(2 * F, E) for _ in range(LAYERS)],
        "down": [rand(E, F) for _ in range(LAYERS)],
        "router": [rand(EXPERTS, E, scale=1.0) for _ in range(LAYERS)],
        "experts_gate_up": [rand(EXPERTS, 2 * F // 4, E) for _ in range(LAYERS)],
        "experts_down": [rand(EXPERTS, E, F // 4) for _ in range(LAYERS)],
    }
    x = rand(1, E, scale=1.0)
    want = _chain(x, w, drain=True)
    assert torch.equal(_chain(x, w, drain=False), want)  # eager, launches overlapping
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, w, drain=False)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
