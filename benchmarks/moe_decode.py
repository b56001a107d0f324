"""The MoE MLP of one qwen3-30b-a3b layer on a CUDA GPU (bf16, 128 experts, top 8, E 2048, F 768): the
grouped path (torch router, pairs sorted by expert, grouped GEMMs) against the few-pairs decode path (one
router kernel, gate/up GEMV, down with the top-k sum in registers), at T = 1, 4, 16 and 64 tokens.

Each case is replayed from a CUDA graph, as decode runs, over `--layers` layers' own weights in turn (so no
call finds the previous call's experts in L2) and timed per layer: router GEMV + routing + experts. Its
bandwidth counts the bytes the step must read, the router and the distinct selected experts' gate, up and
down rows, and is printed next to the device-to-device copy bandwidth measured in the same run (bytes read
+ written). Then the decode path's tiles are swept at T = 1 (gate/up and down separately), the best
printed as a `DecodeTiles` for kernels/triton_moe_decode.py. Every case runs under try/except: a failing
one prints its error in its row. Sized to finish within a minute.

    python3 benchmarks/moe_decode.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing
from pdserve.kernels.fused_moe import route
from pdserve.kernels.triton_moe import TritonMoEExperts
from pdserve.kernels.triton_moe_decode import DecodeTiles, default_decode_tiles, fused_route
from pdserve.shared.model.model_config import NAMED_SHAPES

GIB = 1024**3
TOKENS = (1, 4, 16, 64)
GATE_UP_TILES = ((1, 1024, 4), (1, 2048, 4), (2, 1024, 4), (4, 2048, 4), (8, 512, 4))
DOWN_TILES = ((1, 128, 4), (2, 128, 8), (2, 256, 8), (4, 128, 8), (8, 128, 8))  # all K pairs a step


@dataclasses.dataclass(frozen=True)
class Layer:
    router: torch.Tensor  # [X, E]
    gate_up: torch.Tensor  # [X, 2F, E]
    down: torch.Tensor  # [X, E, F]


MoEStep = Callable[[torch.Tensor, Layer], torch.Tensor]


def grouped_step(top_k: int, renormalize: bool) -> MoEStep:
    experts = TritonMoEExperts(decode_max_pairs=0)

    def step(x: torch.Tensor, layer: Layer) -> torch.Tensor:
        routing = route(F.linear(x, layer.router), top_k, renormalize)
        return experts(x, layer.gate_up, layer.down, routing)

    return step


def decode_step(top_k: int, renormalize: bool, tiles: DecodeTiles | None) -> MoEStep:
    experts = TritonMoEExperts(decode_max_pairs=1 << 30, decode_tiles=tiles)

    def step(x: torch.Tensor, layer: Layer) -> torch.Tensor:
        routing = fused_route(F.linear(x, layer.router), top_k, renormalize)
        return experts(x, layer.gate_up, layer.down, routing)

    return step


def graph_us(step: MoEStep, x: torch.Tensor, layers: list[Layer]) -> float:
    """Median µs per layer of a CUDA graph that runs `step` once on every layer in turn."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        for layer in layers:
            step(x, layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            step(x, layer)
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return float(ms) * 1e3 / len(layers)


def bytes_read(x: torch.Tensor, layer: Layer, top_k: int) -> int:
    """The router and the distinct experts the tokens select (gate, up and down rows), bf16."""
    ids = torch.topk(F.linear(x, layer.router).float(), top_k, dim=-1).indices
    per_expert = layer.gate_up[0].numel() + layer.down[0].numel()
    elem = layer.gate_up.element_size()
    return (layer.router.numel() + int(ids.unique().numel()) * per_expert) * elem


def short(t: DecodeTiles) -> str:
    """Block n x block k / warps, gate/up then down."""
    return (f"gate/up {t.gate_up_block_n}x{t.gate_up_block_k}/{t.gate_up_warps}, "
            f"down {t.down_block_n}x{t.down_block_k}/{t.down_warps}")  # fmt: skip


def copy_gibs(dev: torch.device) -> float:
    src = torch.empty(GIB, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2.0 / (float(ms) / 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="layers' weights cycled through (default 4)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("moe_decode: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    cfg = NAMED_SHAPES["qwen3-30b-a3b"]
    assert cfg.moe is not None
    x_n, k, e, f, renorm = (
        cfg.moe.num_experts,
        cfg.moe.top_k,
        cfg.hidden_size,
        cfg.moe.intermediate_size,
        True,
    )
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * shape[-1] ** -0.5).to(torch.bfloat16)

    layers = [Layer(rand(x_n, e), rand(x_n, 2 * f, e), rand(x_n, e, f)) for _ in range(args.layers)]
    copy = copy_gibs(dev)
    name = torch.cuda.get_device_name(dev)
    print(f"{name}; qwen3-30b-a3b MoE layer: {x_n} experts, top {k}, E {e}, F {f}, bf16; copy bandwidth "
          f"{copy:,.0f} GiB/s (read + written)\n")  # fmt: skip
    print("| T | path | µs / layer | GiB/s of the bytes read | % of copy | max err vs grouped |")
    print("|---|---|---|---|---|---|")
    for t in TOKENS:
        x = torch.randn(t, e, generator=gen, device=dev).to(torch.bfloat16)
        gib = sum(bytes_read(x, layer, k) for layer in layers) / len(layers) / GIB
        want = None
        for name, step in (("grouped", grouped_step(k, renorm)), ("decode", decode_step(k, renorm, None))):
            try:
                us = graph_us(step, x, layers)
                out = step(x, layers[0]).float()
                want = out if want is None else want
                err = (out - want).abs().max().item()
                rate = gib / (us / 1e6)
                print(f"| {t} | {name} | {us:.1f} | {rate:,.0f} | {100 * rate / copy:.1f} % | {err:.2e} |")
            except Exception as exc:  # one failing case must not hide the others
                print(f"| {t} | {name} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | |")
    sweep_tiles(layers, k, renorm, e, f, copy, gen, dev)
    return 0


def sweep_tiles(
    layers: list[Layer],
    k: int,
    renorm: bool,
    e: int,
    f: int,
    copy: float,
    gen: torch.Generator,
    dev: torch.device,
) -> None:
    """The decode path at T = 1 over GATE_UP_TILES (down at its default) and DOWN_TILES (gate/up at its
    default); prints each and the best of both as one DecodeTiles."""
    x = torch.randn(1, e, generator=gen, device=dev).to(torch.bfloat16)
    gib = sum(bytes_read(x, layer, k) for layer in layers) / len(layers) / GIB
    base = default_decode_tiles(e, f)
    gate_ups = [dataclasses.replace(base, gate_up_block_n=n, gate_up_block_k=bk, gate_up_warps=w)
                for n, bk, w in GATE_UP_TILES]  # fmt: skip
    downs = [
        dataclasses.replace(base, down_block_n=n, down_block_k=bk, down_warps=w) for n, bk, w in DOWN_TILES
    ]
    print(f"\ndecode path tiles at T = 1 (default {short(base)}; block n x block k / warps)\n")
    print("| tiles | µs / layer | % of copy |\n|---|---|---|")

    def timed(tiles: DecodeTiles) -> float:
        try:
            us = graph_us(decode_step(k, renorm, tiles), x, layers)
        except Exception as exc:  # one failing tile must not hide the others
            print(f"| {short(tiles)} | failed: {type(exc).__name__}: {str(exc)[:120]} | |")
            return float("inf")
        print(f"| {short(tiles)} | {us:.1f} | {100 * gib / (us / 1e6) / copy:.1f} % |")
        return us

    gate_up = min(gate_ups, key=timed)
    down = min(downs, key=timed)
    best = dataclasses.replace(gate_up, down_block_n=down.down_block_n, down_block_k=down.down_block_k,
                               down_warps=down.down_warps)  # fmt: skip
    print(f"\nbest of each, timed together: {best}")
    timed(best)


if __name__ == "__main__":
    sys.exit(main())
