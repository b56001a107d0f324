"""One tiny Hugging Face checkpoint against our model over a paged cache: `ParityCase` holds HF's reference
logits of two seeded prompts and the checkpoint as `load_model` loads it; the three checks run the same
prompts through `PagedRunner` (a full prefill, a prefill then per-token decode, a varlen batch then one
batched decode step) and hold each logit to HF's within TOL (test_model_hf_parity.py, over every family).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pdserve.shared.model.loader import LoadedModel, load_model
from pdserve.tests.harness.paged_runner import PagedRunner

TOL = 1e-4
PROMPT_LEN = 40
PREFILL_LEN = 25
OTHER_LEN = 23


@dataclass
class ParityCase:
    family: str
    path: str
    loaded: LoadedModel
    prompt: torch.Tensor  # [PROMPT_LEN] int64
    other: torch.Tensor  # [OTHER_LEN] int64, a second sequence for batching
    ref: torch.Tensor  # [PROMPT_LEN, V] HF logits
    ref_other: torch.Tensor  # [OTHER_LEN, V]


def parity_case(family: str, hf: Any, path: str, vocab: int, tokenizer_path: str | None = None) -> ParityCase:
    """`hf` (already saved to `path`) on two seeded prompts of token ids in [3, vocab), and `path` loaded
    on the CPU in fp32."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=gen)
    other = torch.randint(3, vocab, (OTHER_LEN,), generator=gen)
    with torch.inference_mode():
        ref = hf(prompt[None]).logits[0].float()
        ref_other = hf(other[None]).logits[0].float()
    loaded = load_model(path, device=torch.device("cpu"), dtype=torch.float32, tokenizer_path=tokenizer_path)
    return ParityCase(family, path, loaded, prompt, other, ref, ref_other)


def check_full_prefill(case: ParityCase) -> PagedRunner:
    """The whole prompt in one step; returns the runner (its `hooked` layers)."""
    runner = PagedRunner(case.loaded.model)
    logits = runner.step({runner.add_sequence(): case.prompt})
    assert logits.dtype == torch.float32 and logits.shape == case.ref.shape
    print(f"\n{case.family}: max |dlogit| vs HF {(logits - case.ref).abs().max().item():.2e}")
    assert (logits - case.ref).abs().max().item() <= TOL, case.family
    return runner


def check_prefill_then_decode(case: ParityCase) -> None:
    runner = PagedRunner(case.loaded.model)
    seq = runner.add_sequence()
    rows = [runner.step({seq: case.prompt[:PREFILL_LEN]})]
    for i in range(PREFILL_LEN, PROMPT_LEN):
        rows.append(runner.step({seq: case.prompt[i : i + 1]}))
    assert (torch.cat(rows) - case.ref).abs().max().item() <= TOL, case.family


def check_varlen_batch(case: ParityCase) -> None:
    """Both prompts but their last tokens in one prefill step, then one decode step for both."""
    runner = PagedRunner(case.loaded.model)
    a, b = runner.add_sequence(), runner.add_sequence()
    n_b = OTHER_LEN - 1
    logits = runner.step({a: case.prompt[:-1], b: case.other[:-1]})
    assert (logits[: PROMPT_LEN - 1] - case.ref[:-1]).abs().max().item() <= TOL
    assert (logits[PROMPT_LEN - 1 :] - case.ref_other[:n_b]).abs().max().item() <= TOL
    last = runner.step({a: case.prompt[-1:], b: case.other[-1:]})
    assert (last[0] - case.ref[-1]).abs().max().item() <= TOL
    assert (last[1] - case.ref_other[-1]).abs().max().item() <= TOL
