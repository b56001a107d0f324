"""xgrammar against llguidance on SmolLM2's tokenizer: compile time of a JSON schema (cold, no cache) and the
time to fill the next-token bitmask per step at batch 1 and 16, over the tokens of a valid answer.

Usage: python -m pdserve.benchmarks.grammar_engines [--model PATH] [--rounds 3]
Prints one table; docs/architecture.md records the figures and the choice they led to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "poetry", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "status": "active",
}


def main() -> None:
    from pdserve.tests.harness.cluster_fixture import model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the SmolLM2 GGUF)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from pdserve.shared.model.loader import load_tokenizer

    tok = load_tokenizer(args.model or model_path())
    hf = PreTrainedTokenizerFast(tokenizer_object=tok._backend.tok)  # type: ignore[attr-defined]
    vocab = tok.vocab_size
    tokens = tok.encode(json.dumps(ANSWER))
    schema = json.dumps(SCHEMA)
    print(f"tokenizer vocab {vocab}, answer {len(tokens)} tokens, torch threads {torch.get_num_threads()}")
    print(f"{'engine':<12}{'compile ms':>12}{'mask b1 us/step':>18}{'mask b16 us/step':>18}")

    # xgrammar
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids))
    compile_ms = []
    for _ in range(args.rounds):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(schema)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    batcher = xgr.BatchGrammarMatcher()
    xg_steps = {}
    for batch in (1, 16):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
        mask = xgr.allocate_token_bitmask(batch, vocab)
        t0 = time.perf_counter()
        for t in tokens:
            if batch == 1:
                matchers[0].fill_next_token_bitmask(mask)
            else:
                batcher.batch_fill_next_token_bitmask(matchers, mask)
            for m in matchers:
                assert m.accept_token(t), f"xgrammar refused token {t}"
        xg_steps[batch] = (time.perf_counter() - t0) / len(tokens) * 1e6
    print(f"{'xgrammar':<12}{statistics.median(compile_ms):>12.1f}{xg_steps[1]:>18.0f}{xg_steps[16]:>18.0f}")

    # llguidance
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    compile_ms = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        first = llguidance.LLMatcher(ll_tok, grammar)
        first.compute_bitmask()  # llguidance compiles lazily: the first mask pays for it
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    executor = llguidance.LLExecutor()
    ll_steps = {}
    for batch in (1, 16):
        lms = [llguidance.LLMatcher(ll_tok, grammar) for _ in range(batch)]
        mask = llguidance.torch.allocate_token_bitmask(batch, vocab)
        t0 = time.perf_counter()
        for t in tokens:
            if batch == 1:
                llguidance.torch.fill_next_token_bitmask(lms[0], mask, 0)
            else:
                llguidance.torch.fill_next_token_bitmask_par(
                    executor, [(m, i) for i, m in enumerate(lms)], mask
                )
            for lm in lms:
                assert lm.consume_token(t), f"llguidance refused token {t}: {lm.get_error()}"
        ll_steps[batch] = (time.perf_counter() - t0) / len(tokens) * 1e6
    print(
        f"{'llguidance':<12}{statistics.median(compile_ms):>12.1f}{ll_steps[1]:>18.0f}{ll_steps[16]:>18.0f}"
    )


if __name__ == "__main__":
    main()
