"""The docs state the KV-transfer protocol version the code speaks: README's link, architecture.md's module
map, and every place the protocol document writes the current version (title, frame prefix, headers,
refusal)."""

from __future__ import annotations

import os
import re

from pdserve.kvtransfer.messages import PROTOCOL_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_readme_names_the_protocol_version_of_the_code() -> None:
    found = re.findall(r"KV-transfer protocol v(\d+)", _read("README.md"))
    assert found and {int(v) for v in found} == {PROTOCOL_VERSION}, found


def test_protocol_doc_states_the_current_version_everywhere() -> None:
    doc = _read("docs/kv_transfer_protocol.md")
    stated = {
        "title": re.search(r"^# KV-transfer protocol, version (\d+)$", doc, re.M),
        "prefix byte": re.search(r"^\| 4 \| version \| `(\d+)` \(u8\) \|$", doc, re.M),
        "header v": re.search(r'plus `"v"`: the protocol version \((\d+)\)', doc),
        "refusal": re.search(r"\(`local v(\d+), peer vN`\)", doc),
    }
    versions = {where: int(m.group(1)) if m else None for where, m in stated.items()}
    assert versions == dict.fromkeys(stated, PROTOCOL_VERSION)


def test_architecture_names_the_protocol_version_of_the_code() -> None:
    found = re.findall(r"protocol v(\d+) written once", _read("docs/architecture.md"))
    assert found and {int(v) for v in found} == {PROTOCOL_VERSION}, found
