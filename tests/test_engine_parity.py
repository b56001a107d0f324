"""`pdserve generate` (the real CLI, in a subprocess) vs Hugging Face `generate` on the SmolLM2 GGUF, fp32.

Transformers loads the same GGUF file and runs each prompt alone, greedy, 64 new tokens or EOS. Our CLI
runs two prompts alone (a chat and a raw prompt, with --json) and the other 19 in one --prompts-file call:
one engine, all concurrent, mixed lengths, with a ~200-token prompt over a 64-token chunked-prefill
budget. Every prompt must give HF's tokens exactly; a divergence is excused only where HF's own top-2 logit
gap at that step is below 1e-4 (a numerical tie), and each excused case is printed and warned about.
An HF safetensors directory saved from the same weights must give the same tokens through `--model <dir>`.
Teacher-forced logits (1e-3 at every position) are tests/test_model_gguf.py's job, not repeated here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pdserve.tests.harness.hf_reference import HFSmolLM2

pytestmark = pytest.mark.slow
MAX_NEW = 64
TIE_GAP = 1e-4
CHUNK_BUDGET = 64
LONG_TEXT = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were used in "
    "China to print cloth and paper more than a thousand years earlier, and movable type made of baked "
    "clay appeared there in the eleventh century. In Korea, metal type was cast in the thirteenth century "
    "and used to print Buddhist texts. When Johannes Gutenberg built his press in Mainz around 1440, he "
    "combined several older ideas: a screw press like those used for wine and olive oil, an oil-based ink "
    "that stuck to metal, and a hand mould that could cast many identical letters quickly. His Bible, "
    "finished around 1455, showed that printed books could be as beautiful as handwritten ones. Within "
    "fifty years, presses were working in more than two hundred European cities, and millions of books had "
    "been printed. Summarize this history in three sentences:"
)
# (kind, content): chat messages go through the model's template, raw text is encoded as is.
PROMPTS: list[tuple[str, str]] = [
    ("chat", "What is the capital of France?"),
    ("raw", "The quick brown fox jumps over the lazy dog. Then the fox"),
    ("chat", "Write a haiku about autumn leaves."),
    ("raw", "Once upon a time"),
    ("chat", "List three primary colors."),
    ("raw", "def fibonacci(n):\n    "),
    ("chat", "Explain what a black hole is in two sentences."),
    ("raw", "The capital of Japan is"),
    ("chat", "Give me a recipe for pancakes."),
    ("raw", "1, 2, 3, 4, 5,"),
    ("chat", "Translate 'good morning' into Spanish and French."),
    ("raw", "Water boils at"),
    ("chat", "What are the benefits of regular exercise? Answer briefly."),
    ("raw", "In the beginning of the twentieth century, the city of Paris"),
    ("chat", "Hi!"),
    ("raw", "import numpy as np\n\n# compute the mean of an array\n"),
    ("chat", "Why is the sky blue? Explain it to a child, using simple words and one example."),
    ("raw", "Dear hiring manager,\n\nI am writing to apply for"),
    ("chat", "Name a mammal that can fly."),
    ("raw", LONG_TEXT),
    ("chat", LONG_TEXT),
]
SOLO = (0, 1)  # run through --messages / --prompt; the rest go through one --prompts-file run


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    tokens: list[int]
    gaps: list[float]  # HF's top-1 minus top-2 logit at each generated step


@dataclass(frozen=True)
class HF:
    refs: list[Reference]
    hf_dir: str


def _line(kind: str, content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]} if kind == "chat" else {"prompt": content}


def _cli(*args: str) -> list[dict[str, Any]]:
    """Runs `pdserve generate --json` and returns one parsed object per prompt."""
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--json", "--threads", "1", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def _prompts_file(path: Path, indices: list[int]) -> str:
    path.write_text("".join(json.dumps(_line(*PROMPTS[i])) + "\n" for i in indices), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def ours_running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[list[dict[str, Any]]]]:
    """Our CLI runs (one thread each), started before HF's reference (one thread) and running beside it."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_ours, tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def hf(ours_running: Future[list[dict[str, Any]]], hf_smollm2: Callable[[], HFSmolLM2]) -> HF:
    """HF's reference; asks for `ours_running` so that our runs start first and overlap with it."""
    reference = hf_smollm2()
    model, tok = reference.model, reference.tokenizer
    torch.set_num_threads(1)
    refs = []
    for kind, content in PROMPTS:
        text = content
        if kind == "chat":
            messages = [{"role": "user", "content": content}]
            text = str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        ids = tok.encode(text, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        top2 = torch.cat(out.logits).float().topk(2, dim=-1).values  # [steps, 2]
        refs.append(Reference(ids, out.sequences[0, len(ids) :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return HF(refs, reference.saved_dir)


def _ours(prompts_path: Path) -> list[dict[str, Any]]:
    """Our CLI's output for every prompt, in PROMPTS order."""
    chat_kind, chat = PROMPTS[SOLO[0]]
    raw_kind, raw = PROMPTS[SOLO[1]]
    assert (chat_kind, raw_kind) == ("chat", "raw")
    messages = json.dumps([{"role": "user", "content": chat}])
    solo = _cli("--messages", messages, "--max-tokens", str(MAX_NEW)) + _cli(
        "--prompt", raw, "--max-tokens", str(MAX_NEW)
    )
    rest = [i for i in range(len(PROMPTS)) if i not in SOLO]
    path = _prompts_file(prompts_path, rest)
    # the concurrent run overlaps steps (async scheduling, off by default on the CPU): same tokens
    batched = _cli(
        "--prompts-file", path, "--max-tokens", str(MAX_NEW), "--max-num-batched-tokens", str(CHUNK_BUDGET),
        "--async-scheduling", "on",
    )  # fmt: skip
    assert len(solo) == 2 and len(batched) == len(rest)
    by_index = dict(zip([*SOLO, *rest], solo + batched, strict=True))
    return [by_index[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def ours(ours_running: Future[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return ours_running.result()


def _compare(i: int, ref: Reference, tokens: list[int]) -> str | None:
    """None if identical; a description if the first divergence is an excused near-tie; else fails."""
    for step, (want, got) in enumerate(zip(ref.tokens, tokens, strict=False)):
        if want != got:
            gap = ref.gaps[step]
            assert gap < TIE_GAP, (
                f"prompt {i} {PROMPTS[i][1][:40]!r}: step {step} gave {got}, HF {want} "
                f"(HF top-2 gap {gap:.3g} >= {TIE_GAP}); ours {tokens}, HF {ref.tokens}"
            )
            return f"prompt {i} step {step}: ours {got}, HF {want}, HF top-2 gap {gap:.3g}"
    assert tokens == ref.tokens, f"prompt {i}: lengths differ: ours {tokens}, HF {ref.tokens}"
    return None


def _report(excused: list[str]) -> None:
    for case in excused:
        print(f"excused near-tie divergence: {case}")
        warnings.warn(f"excused near-tie divergence: {case}", stacklevel=2)


def test_workload_shape() -> None:
    assert len(PROMPTS) >= 20 and len(PROMPTS) - len(SOLO) >= 16
    assert {k for k, _ in PROMPTS} == {"chat", "raw"}


def test_prompt_tokens_match_hf_tokenizer(hf: HF, ours: list[dict[str, Any]]) -> None:
    for i, (ref, out) in enumerate(zip(hf.refs, ours, strict=True)):
        assert out["prompt_token_ids"] == ref.prompt_ids, f"prompt {i} tokenized differently"
    lengths = sorted(len(r.prompt_ids) for r in hf.refs)
    assert lengths[0] < 16 and 180 <= lengths[-1] <= 260 and lengths[-1] > CHUNK_BUDGET


def test_solo_cli_runs_match_hf(hf: HF, ours: list[dict[str, Any]]) -> None:
    excused = [e for i in SOLO if (e := _compare(i, hf.refs[i], ours[i]["token_ids"])) is not None]
    _report(excused)
    for i in SOLO:
        reason = ours[i]["finish_reason"]
        assert reason == ("stop" if len(ours[i]["token_ids"]) < MAX_NEW else "length"), reason


def test_concurrent_chunked_run_matches_hf(hf: HF, ours: list[dict[str, Any]]) -> None:
    rest = [i for i in range(len(PROMPTS)) if i not in SOLO]
    excused = [e for i in rest if (e := _compare(i, hf.refs[i], ours[i]["token_ids"])) is not None]
    _report(excused)


def test_safetensors_dir_gives_same_tokens(hf: HF, ours: list[dict[str, Any]], tmp_path: Path) -> None:
    picked = [0, 1, 2, 3, 19, 20]  # chat and raw, short and long
    path = _prompts_file(tmp_path / "prompts.jsonl", picked)
    outs = _cli(
        "--model",
        hf.hf_dir,
        "--prompts-file",
        path,
        "--max-tokens",
        str(MAX_NEW),
        "--max-num-batched-tokens",
        str(CHUNK_BUDGET),
    )
    for i, out in zip(picked, outs, strict=True):
        assert out["prompt_token_ids"] == ours[i]["prompt_token_ids"]
        assert out["token_ids"] == ours[i]["token_ids"], f"prompt {i}: HF dir and GGUF runs differ"
