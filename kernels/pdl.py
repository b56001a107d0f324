"""Programmatic dependent launch (PDL) for the decode step's Triton kernels: which devices launch with it
(`uses_pdl`: CUDA at sm_90+, a property of the device, not a setting) and the grid dependency lines a kernel
runs (`pdl_wait`). With PDL kernel N+1 of a stream may start while kernel N still runs, so its launch and
its first loads hide in N's tail; a CUDA graph captured from such launches keeps them as programmatic edges.

Invariants, kept by every kernel launched with `**pdl_launch(device)`:
- each program calls `pdl_wait` unconditionally, before any early return: the kernel completes only after
  it has seen its predecessor complete, with that kernel's memory flushed;
- before `pdl_wait` a program reads only what no kernel of a step writes (weights, norm weights; never the
  step's inputs, which the host copies in on the stream and a torch op may produce) and writes nothing;
- `pdl_wait` triggers the dependents first (griddepcontrol.launch_dependents), then waits. So N+2 may be
  launched while N still runs, but N+2 waits for N+1's completion, which came after N+1's wait returned,
  that is after N's completion: every kernel's work after the wait sees all earlier kernels' writes, and no
  kernel writes (not even into memory the caching allocator recycled from an earlier kernel's input)
  before every earlier kernel has finished. A kernel launched without PDL (torch, cuBLAS) waits for its
  predecessor's completion as always, and a PDL kernel after it waits for it, so mixed chains keep this.
Under the interpreter and below sm_90 the PDL constexpr is False: no griddepcontrol instruction is
compiled and the launch is a plain one.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["pdl_launch", "pdl_wait", "uses_pdl"]


@functools.cache
def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: NVIDIA CUDA at compute
    capability 9.0 or above (Hopper's griddepcontrol; a ROCm build reports its GPUs as "cuda" devices, some
    with major 9, and has no such instruction); CPU tensors run under the interpreter, without it."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_properties(device).major >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A PDL kernel's launch arguments: its `PDL` constexpr and the launch's `launch_pdl`, both from one
    value, so a programmatic launch never runs a kernel compiled without its wait."""
    on = uses_pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    # the dependents may launch now; this program then waits for the predecessor grid's completion
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
