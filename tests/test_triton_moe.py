"""The fused MoE Triton kernels against the torch reference (kernels/fused_moe.py), on CPU tensors under the
Triton interpreter, with tiny shapes: the grouped kernels (kernels/triton_moe.py) with uneven expert loads,
experts with no tokens, widths that are not multiples of the tiles, and the decode and prefill tile
choices; the few-pairs decode path and its one-kernel router (kernels/triton_moe_decode.py) through a
sparse layer's forward for Qwen3-MoE, Mixtral and a shared-expert config, fp32 and bf16, T = 1, 2 and 7.

tests/harness/triton_interpreter.py switches the interpreter on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pdserve.kernels.fused_moe import ReferenceMoEExperts, Routing, route
from pdserve.kernels.linear import DenseLinear
from pdserve.kernels.reference import ReferenceOps
from pdserve.kernels.triton_moe import MoETiles, TritonMoEExperts, align_pairs
from pdserve.kernels.triton_moe_decode import DECODE_MAX_PAIRS, DecodeTiles, fused_route, moe_decode
from pdserve.shared.model.dummy_weights import fill_dummy_weights
from pdserve.shared.model.model import LlamaModel
from pdserve.shared.model.model_config import NAMED_SHAPES, ModelConfig
from pdserve.shared.model.moe import SparseMoE
from pdserve.shared.model.parallel import plan
from pdserve.tests.harness import triton_interpreter  # noqa: F401  (the interpreter, or a skip on CUDA)
from pdserve.tests.harness.paged_runner import PagedRunner

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""Of the largest |output|: bf16 results differ by an ulp or two where the fp32 sums round differently."""


def _problem(
    n_tokens: int, hidden: int, f: int, n_experts: int, top_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Routing]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=gen)
    gate_up = torch.randn(n_experts, 2 * f, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(n_experts, hidden, f, generator=gen) * f**-0.5
    logits = torch.randn(n_tokens, n_experts, generator=gen)
    logits[:, -1] = -1e4  # the last expert gets no tokens
    return x, gate_up, down, route(logits, top_k, renormalize=True)


def test_reference_is_the_per_token_sum_of_weighted_experts() -> None:
    x, gate_up, down, routing = _problem(6, 40, 24, 5, 2, seed=1)
    f = down.shape[2]
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(routing.ids.shape[1]):
            e = int(routing.ids[t, k])
            h = gate_up[e] @ x[t]  # [2F]
            expected[t] += routing.weights[t, k] * (down[e] @ (F.silu(h[:f]) * h[f:]))
    got = ReferenceMoEExperts()(x, gate_up, down, routing)
    assert (got - expected).abs().max().item() < 1e-5


def test_align_pairs_groups_each_expert_in_whole_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    a = align_pairs(ids, num_experts=5, block_m=4)
    n_pairs = ids.numel()
    used = int(a.num_padded.item())
    assert used == 16  # experts 0, 1, 2, 3 hold 2, 1, 4 and 1 pairs: one 4-row block each
    pairs = a.sorted_pairs[:used].view(-1, 4)
    flat = ids.flatten()
    for block, expert in zip(pairs, a.block_expert[: used // 4].tolist(), strict=True):
        real = block[block < n_pairs]
        assert real.numel() > 0 and bool((flat[real.long()] == expert).all())
    assert sorted(a.sorted_pairs[a.sorted_pairs < n_pairs].tolist()) == list(range(n_pairs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n_tokens", "tiles"),
    [(1, None), (7, None), (70, None), (9, MoETiles(16, 16, 16, 4, 1))],
    ids=["decode-1", "decode-7", "prefill-70", "small-tiles"],
)
def test_fused_kernel_matches_reference(n_tokens: int, tiles: MoETiles | None, dtype: torch.dtype) -> None:
    x, gate_up, down, routing = _problem(n_tokens, 72, 40, 6, 2, seed=n_tokens)
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    ref = ReferenceMoEExperts()(x, gate_up, down, routing)
    got = TritonMoEExperts(tiles, decode_max_pairs=0)(x, gate_up, down, routing)  # the grouped kernels
    assert got.dtype == dtype and got.shape == x.shape
    scale = max(1.0, ref.float().abs().max().item())
    assert (got.float() - ref.float()).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_path_with_cut_tiles_and_an_odd_top_k(dtype: torch.dtype) -> None:
    """The decode path's down kernel loads a token's K pairs as one [K_PAD, BLOCK_N, BLOCK_K] tile: at
    top 3 (one padded pair slot), with E and F not multiples of the tiles, it still gives the reference."""
    x, gate_up, down, routing = _problem(5, 72, 40, 6, 3, seed=3)
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    ref = ReferenceMoEExperts()(x, gate_up, down, routing)
    got = moe_decode(x, gate_up, down, routing, DecodeTiles(1, 32, 1, 16, 16, 2))
    assert got.dtype == dtype and got.shape == x.shape
    scale = max(1.0, ref.float().abs().max().item())
    assert (got.float() - ref.float()).abs().max().item() <= TOL[dtype] * scale


def test_model_with_the_fused_kernel_gives_the_reference_logits() -> None:
    """A tiny Qwen3-MoE model (dummy weights, fp32): its experts swapped for the fused kernel give the
    torch reference's logits over a prefill and a decode step."""
    cfg = ModelConfig.from_dict(
        NAMED_SHAPES["qwen3-30b-a3b"].to_dict()
        | {
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 32,
            "bos_token_id": 1,
            "eos_token_ids": [2],
            "moe": {"num_experts": 8, "top_k": 2, "intermediate_size": 48, "norm_topk_prob": True},
        }
    )
    model = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    fill_dummy_weights(model, seed=5)
    for layer in model.decoder_layers:  # experts as large as the rest of the layer, so that they count
        assert layer.moe is not None
        layer.moe.gate_up_weight.mul_(5.0)
        layer.moe.down_weight.mul_(20.0)
    prompt = torch.randint(3, 300, (21,), generator=torch.Generator().manual_seed(1))
    results = []
    for experts in (ReferenceMoEExperts(), TritonMoEExperts()):
        for layer in model.decoder_layers:
            assert layer.moe is not None
            layer.moe.experts = experts
        runner = PagedRunner(model)
        seq = runner.add_sequence()
        results.append(torch.cat([runner.step({seq: prompt[:-1]}), runner.step({seq: prompt[-1:]})]))
    assert (results[0] - results[1]).abs().max().item() <= 1e-5 * results[0].abs().max().item()


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n_experts", "top_k", "renormalize"),
    [(128, 8, True), (8, 2, True), (60, 4, False), (300, 2, True)],
    ids=["qwen3-moe", "mixtral", "qwen2-moe", "past-the-kernel"],
)
def test_fused_route_gives_route(
    n_experts: int, top_k: int, renormalize: bool, logits_dtype: torch.dtype
) -> None:
    """The one-kernel router (softmax, top-k, renormalisation) picks the torch router's experts with their
    weights (in any order among tied logits, which bf16 has: a token's sum does not depend on it)."""
    logits = torch.randn(7, n_experts, generator=torch.Generator().manual_seed(n_experts)).to(logits_dtype)
    want = route(logits, top_k, renormalize)
    got = fused_route(logits, top_k, renormalize)
    for routing in (want, got):
        order = routing.ids.argsort(dim=1)
        routing.ids.copy_(routing.ids.gather(1, order))
        routing.weights.copy_(routing.weights.gather(1, order))
    assert got.ids.tolist() == want.ids.tolist()
    assert (got.weights - want.weights).abs().max().item() <= 1e-6


def _sparse_moe(arch: str, moe: dict[str, object], dtype: torch.dtype) -> tuple[SparseMoE, torch.Tensor]:
    """A SparseMoE of `moe`'s routing with seeded weights large enough that every expert counts."""
    shape = "mixtral-8x7b" if arch == "mixtral" else "qwen3-30b-a3b"
    base = NAMED_SHAPES[shape].to_dict()
    small = {"architecture": arch, "hidden_size": 72, "num_heads": 4, "num_kv_heads": 2, "head_dim": 18,
             "intermediate_size": 96, "moe": moe}  # fmt: skip
    cfg = ModelConfig.from_dict(base | small)
    layer = SparseMoE(cfg, plan(cfg, 0, 1), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(len(moe))
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    layer.router_weight.mul_(8.0)  # spread the routing so that the top-k is clear of ties
    layer.to(dtype)
    layer.prepare(DenseLinear())
    return layer, torch.randn(7, 72, generator=gen).to(dtype)


MOE_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen3-moe": ("qwen3_moe", {"num_experts": 16, "top_k": 8, "intermediate_size": 40,
                                "norm_topk_prob": True}),
    "mixtral": ("mixtral", {"num_experts": 8, "top_k": 2, "intermediate_size": 40, "norm_topk_prob": True}),
    "shared-expert": ("qwen2_moe", {"num_experts": 6, "top_k": 2, "intermediate_size": 40,
                                    "norm_topk_prob": False, "shared_expert_intermediate_size": 56}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(MOE_CONFIGS))
def test_decode_path_matches_reference(config: str, dtype: torch.dtype) -> None:
    """The few-pairs decode path (fused router, gate/up GEMV, down with the top-k sum in registers) gives
    the reference's output through the layer's forward at T = 1, 2 and 7, and called directly."""
    arch, moe = MOE_CONFIGS[config]
    layer, x = _sparse_moe(arch, moe, dtype)
    for n_tokens in (1, 2, 7):
        assert n_tokens * layer.top_k <= DECODE_MAX_PAIRS
        layer.experts = ReferenceMoEExperts()
        ref = layer(x[:n_tokens], ReferenceOps())
        layer.experts = TritonMoEExperts()
        got = layer(x[:n_tokens], ReferenceOps())
        assert got.dtype == dtype and got.shape == ref.shape
        scale = max(1.0, ref.float().abs().max().item())
        assert (got.float() - ref.float()).abs().max().item() <= TOL[dtype] * scale, (config, n_tokens)
        routing = fused_route(F.linear(x[:n_tokens], layer.router_weight), layer.top_k, layer.renormalize)
        direct = moe_decode(x[:n_tokens], layer.gate_up_weight, layer.down_weight, routing)
        routed = ReferenceMoEExperts()(x[:n_tokens], layer.gate_up_weight, layer.down_weight, routing)
        assert (direct.float() - routed.float()).abs().max().item() <= TOL[dtype] * scale, (config, n_tokens)
