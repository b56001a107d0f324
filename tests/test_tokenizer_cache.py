"""The GGUF tokenizer's on-disk cache (shared/model/tokenizer.py): a process after the first loads the
converted vocabulary with `tokenizers` alone, gets the same tokenizer byte for byte, and a torn entry or an
unwritable directory costs only the cache. Then a node process's start: it loads its tokenizer and engine
without importing transformers or xgrammar (each a second or more of CPU per process)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.tests.harness.cluster_fixture import model_path

TEXT = "Sure! Here's café ☕ and 世界 🙂 — done."


def _same(a: Tokenizer, b: Tokenizer) -> None:
    assert a.fingerprint == b.fingerprint  # what the router and the nodes compare
    ids = a.encode(TEXT)
    assert ids == b.encode(TEXT) and a.decode(ids) == b.decode(ids) == TEXT
    assert a.eos_token_ids == b.eos_token_ids and a.chat_template == b.chat_template


def test_a_cached_conversion_is_the_converted_tokenizer(tmp_path: os.PathLike[str]) -> None:
    cache = str(tmp_path)
    fresh = Tokenizer.from_gguf(model_path(), cache_dir=cache)  # converts, writes the entry
    (entry,) = glob.glob(os.path.join(cache, "*.json"))
    assert not glob.glob(os.path.join(cache, "*.tmp"))  # written whole, then renamed
    _same(Tokenizer.from_gguf(model_path(), cache_dir=cache), fresh)  # read back

    with open(entry, "w", encoding="utf-8") as f:
        f.write('{"version": "1.0", "trunc')  # a torn write
    _same(Tokenizer.from_gguf(model_path(), cache_dir=cache), fresh)  # converted again
    _same(Tokenizer.from_gguf(model_path(), cache_dir=cache), fresh)  # and rewritten whole

    blocked = os.path.join(cache, "a-file-not-a-directory")
    open(blocked, "w").close()
    _same(Tokenizer.from_gguf(model_path(), cache_dir=blocked), fresh)  # no cache, same tokenizer


def test_a_node_process_starts_without_transformers_or_xgrammar() -> None:
    Tokenizer.from_gguf(model_path())  # the default cache holds the conversion from here on
    code = (
        "import sys\n"
        "from pdserve.shared.engine.config import EngineConfig\n"
        "from pdserve.shared.engine.engine import LLMEngine\n"
        f"cfg = EngineConfig(model={model_path()!r}, device='cpu', max_num_seqs=2, num_kv_blocks=8)\n"
        "engine = LLMEngine(cfg)\n"
        "print(sorted(m for m in ('transformers', 'xgrammar') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
