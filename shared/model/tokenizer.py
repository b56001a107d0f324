"""`Tokenizer`: text <-> token ids and chat templates, over the Rust `tokenizers` backend.

Built from a GGUF file's metadata (transformers' GGUF tokenizer conversion), from an HF directory
(tokenizer.json + tokenizer_config.json / chat_template.jinja), or as a byte-level fallback for dummy
models. Invariants: `encode` never adds the chat template; `apply_chat_template` renders with the
template's own special-token strings and encodes with add_special_tokens=False, as transformers does.
Loading a tokenizer never touches model weights, so its time is measured on its own.

A GGUF vocabulary's conversion (importing transformers and building the BPE: about 2 s of CPU per process)
is kept as tokenizer.json under `~/.cache/pdserve/tokenizers`, named by a digest of the file's tokenizer
metadata and transformers' version, so that every later process (each node, each `pdserve generate`) loads
it with `tokenizers` alone; an unreadable entry is converted again, an unwritable directory only costs the
cache. The loaded tokenizer is the converted one, byte for byte (`identity` is its serialisation).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import tokenizers
from pdserve.shared.model.gguf_header import parse_header

log = logging.getLogger("pdserve.tokenizer")
GGUF_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def vocab_size(self) -> int: ...
    def identity(self) -> bytes: ...


class _RustBackend:
    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def identity(self) -> bytes:
        return str(self.tok.to_str()).encode()


class _ByteBackend:
    """Ids 0..255 are UTF-8 bytes; a larger id decodes as byte id % 256; special ids decode as `<|id|>`."""

    def __init__(self, vocab_size: int, special_ids: frozenset[int]) -> None:
        self.size = vocab_size
        self.special_ids = special_ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        special = self.special_ids
        if not special.intersection(ids):
            return bytes([i & 0xFF for i in ids]).decode("utf-8", errors="replace")
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in special:
                out.append(bytes(run).decode("utf-8", errors="replace"))
                run.clear()
                out.append("" if skip_special_tokens else f"<|{i}|>")
            else:
                run.append(i & 0xFF)
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)

    def vocab_size(self) -> int:
        return self.size

    def identity(self) -> bytes:
        return json.dumps({"byte_level": self.size, "special": sorted(self.special_ids)}).encode()


_TEMPLATE_ARGS = frozenset(
    ("conversations", "chat_template", "messages", "add_generation_prompt", "continue_final_message", "tools",
     "documents", "return_assistant_tokens_mask")
)  # fmt: skip
"""What render_chat passes to the template itself: a client's template variables may not override them."""


class Tokenizer:
    def __init__(
        self,
        backend: _Backend,
        *,
        name: str,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
        template_tokens: dict[str, str],
    ) -> None:
        self._backend = backend
        self.name = name
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self._template_tokens = template_tokens  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (may be below the model's padded vocab_size)."""
        return self._backend.vocab_size()

    @property
    def rust_tokenizer(self) -> tokenizers.Tokenizer | None:
        """The Rust tokenizer behind this one (None for the byte-level fallback): what a grammar engine reads
        the vocabulary from."""
        return self._backend.tok if isinstance(self._backend, _RustBackend) else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The byte-level fallback's special ids (EOS, BOS); empty for a Rust tokenizer (it knows its own)."""
        return self._backend.special_ids if isinstance(self._backend, _ByteBackend) else frozenset()

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of what turns text into ids and back: the backend's vocabulary, merges, normalizer
        and special tokens, the EOS ids, the chat template and its token strings (not the display name).
        The router and every node must share it (docs/faults.md)."""
        parts = {
            "backend": hashlib.sha256(self._backend.identity()).hexdigest(),
            "eos": sorted(self.eos_token_ids),
            "chat_template": self.chat_template,
            "template_tokens": self._template_tokens,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[Any, Any]] | None = None,
    ) -> str:
        """The chat template applied to `messages`, as text; continue_final_message leaves the last message
        open (its end-of-turn cut) for the model to continue; template_kwargs are more template variables
        (e.g. Qwen3's enable_thinking); `tools` (OpenAI's tool definitions) reach a template that renders
        them. ValueError if there is no template, if the final message cannot be continued, or if a template
        variable is one this call sets itself."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template; use a completion request")
        render_jinja_template = _template_renderer()

        template_tokens: dict[str, Any] = dict(self._template_tokens)
        clash = sorted(set(template_kwargs or {}) & (set(template_tokens) | _TEMPLATE_ARGS))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {clash}: the server sets them itself")
        template_tokens.update(template_kwargs or {})
        # annotated `-> str`, but returns (rendered conversations, generation indices)
        result: Any = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=list(tools) if tools is not None else None,
            **template_tokens,
        )
        return str(result[0][0])

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered template; add_special_tokens adds the tokenizer's own (BOS) on top of the
        template's, which already holds them for most models."""
        text = self.render_chat(
            messages, add_generation_prompt, continue_final_message, template_kwargs, tools
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    @classmethod
    def byte_level(cls, vocab_size: int, eos_token_ids: Iterable[int], bos_token_id: int | None) -> Tokenizer:
        """Fallback for dummy models: UTF-8 bytes as ids, a plain `role: content` chat template."""
        if vocab_size < 256:
            raise ValueError(f"vocab_size={vocab_size} is below 256, too small for a byte-level tokenizer")
        eos = frozenset(eos_token_ids)
        specials = eos | ({bos_token_id} if bos_token_id is not None else set())
        return cls(
            _ByteBackend(vocab_size, frozenset(specials)),
            name="byte-level",
            eos_token_ids=eos,
            chat_template=BYTE_CHAT_TEMPLATE,
            template_tokens={},
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """From a directory holding tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
        generation_config.json). FileNotFoundError if tokenizer.json is missing."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the Rust binding raises bare Exception for a malformed file
            raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from e
        tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = _pick_template(tok_cfg.get("chat_template"))
        jinja_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        template_tokens = {
            key: _token_text(tok_cfg[key])
            for key in ("bos_token", "eos_token")
            if tok_cfg.get(key) is not None
        }
        eos: set[int] = set()
        if "eos_token" in template_tokens:
            eos_id = backend.token_to_id(template_tokens["eos_token"])
            if eos_id is not None:
                eos.add(int(eos_id))
        for extra in ("generation_config.json", "config.json"):
            eos.update(_as_ids(_read_json(os.path.join(path, extra)).get("eos_token_id")))
        return cls(
            _RustBackend(backend),
            name=os.path.basename(os.path.normpath(path)),
            eos_token_ids=eos,
            chat_template=template,
            template_tokens=template_tokens,
        )

    @classmethod
    def from_gguf(cls, path: str, cache_dir: str | None = None) -> Tokenizer:
        """From a GGUF file's tokenizer metadata (vocabulary, merges, special ids, chat template); the
        converted vocabulary is cached in `cache_dir` (default `~/.cache/pdserve/tokenizers`)."""
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta = parse_header(buf, GGUF_STRING_ARRAYS).metadata
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{path} has no tokenizer.ggml.tokens in its metadata")
        backend = _gguf_backend(meta, cache_dir or _default_cache_dir())
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        template_tokens = {
            name: tokens[meta[key]]
            for name, key in (
                ("bos_token", "tokenizer.ggml.bos_token_id"),
                ("eos_token", "tokenizer.ggml.eos_token_id"),
            )
            if key in meta
        }
        return cls(
            _RustBackend(backend),
            name=str(meta.get("general.name") or os.path.basename(path)),
            eos_token_ids=(int(meta[k]) for k in GGUF_EOS_KEYS if k in meta),
            chat_template=meta.get("tokenizer.chat_template"),
            template_tokens=template_tokens,
        )


@functools.cache
def _template_renderer() -> Any:
    """transformers' chat-template renderer, imported on first use (transformers takes about a second)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template


def preload_chat_templates() -> None:
    """Imports the chat-template renderer now (the router does at start, so no request imports it)."""
    _template_renderer()


def _default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "tokenizers")


def _gguf_backend(meta: Mapping[str, Any], cache_dir: str) -> tokenizers.Tokenizer:
    """The GGUF vocabulary as a Rust tokenizer: from the cache when it holds this metadata's conversion,
    else converted by transformers and written there (atomically: concurrent processes may race)."""
    tok_meta = sorted((k, v) for k, v in meta.items() if k.startswith("tokenizer."))
    key = hashlib.sha256(
        repr(
            (meta.get("general.architecture"), importlib.metadata.version("transformers"), tok_meta)
        ).encode()
    ).hexdigest()
    entry = os.path.join(cache_dir, f"{key}.json")
    try:
        with open(entry, encoding="utf-8") as f:
            return tokenizers.Tokenizer.from_str(f.read())
    except FileNotFoundError:
        pass
    except Exception as exc:  # a torn or foreign file (tokenizers' own errors too): convert again, rewrite
        log.warning("tokenizer cache entry %s unreadable (%s); converting again", entry, exc)
    backend = _convert_gguf(meta)
    tmp = None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(backend.to_str())
        os.replace(tmp, entry)
    except OSError as exc:
        log.info("tokenizer cache %s not written (%s)", cache_dir, exc)
        if tmp is not None:  # a write cut short (a full disk) leaves no partial file behind
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return backend


def _convert_gguf(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """transformers' conversion of the GGUF tokenizer metadata (imports transformers: about a second)."""
    try:  # transformers >= 5.18 moved the tokenizer table and converter next to the GGUF reader
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

    tok_dict = {
        field: meta[f"tokenizer.{key}"]
        for key, field in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    backend: tokenizers.Tokenizer = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)[0]
    return backend


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (take 'default')."""
    if value is None or isinstance(value, str):
        return value
    named = {t["name"]: t["template"] for t in value}
    return named.get("default")


def _token_text(value: Any) -> str:
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
