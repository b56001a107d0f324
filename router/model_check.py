"""The router and the nodes agree on the model: a router whose tokenizer, or whose checkpoint, is not the one
the nodes registered refuses to serve (503 `model_mismatch`, naming both) instead of sending wrong token ids.

Invariants:
- A node is checked once per (node id, epoch): its registration's tokenizer fingerprint against the router's
  tokenizer (model/tokenizer.py), and its model fingerprint against the one the router computes from its own
  checkpoint (config and weights identity from the file headers, never the weights; the KV dtype, block
  size and weight quantization the node registered: a checkpoint quantized at load has its own identity).
  A dummy model (`dummy:...`) has no checkpoint to read: its tokenizer alone is compared. A node that
  registered no tokenizer fingerprint (an older node) is compared on its model only.
- The router's checkpoint headers are read once, off the event loop, before it serves (`prepare`); `check`
  never awaits, so it adds no suspension point to a placement.
"""

from __future__ import annotations

import asyncio
import logging
import os

from pdserve.router.errors import ModelMismatch
from pdserve.shared.engine.block_hash import model_fingerprint
from pdserve.shared.index.block_index_types import NodeInfo
from pdserve.shared.model.fp8 import checkpoint_quantization, quantized_identity
from pdserve.shared.model.gguf_loader import read_gguf
from pdserve.shared.model.hf_loader import read_hf_dir
from pdserve.shared.model.loader import DUMMY_PREFIX
from pdserve.shared.model.model_config import ModelConfig
from pdserve.shared.model.tokenizer import Tokenizer
from pdserve.shared.types import NodeId

log = logging.getLogger(__name__)


def _checkpoint(path: str) -> tuple[ModelConfig, bytes, bool] | None:
    """(config, weights identity, whether the checkpoint is quantized already) of a GGUF file or HF
    directory; None for a dummy model."""
    if path.startswith(DUMMY_PREFIX):
        return None
    config, _, identity = read_gguf(path) if path.endswith(".gguf") else read_hf_dir(path)
    return config, identity, checkpoint_quantization(path) is not None


class ModelCheck:
    """One per router: `await prepare()` before serving, then `check(node)` before any request goes there."""

    def __init__(self, model_path: str, tokenizer: Tokenizer) -> None:
        self._path = model_path
        self._tokenizer = tokenizer
        self._checkpoint: tuple[ModelConfig, bytes, bool] | None = None
        self._fingerprints: dict[tuple[str, int, str], str] = {}
        self._verdicts: dict[tuple[NodeId, int], str | None] = {}
        """(node id, epoch) -> None when it agrees, else the refusal message."""

    async def prepare(self) -> None:
        """Reads the router's checkpoint headers (config, weights identity); fingerprints its tokenizer."""
        try:
            self._checkpoint = await asyncio.to_thread(_checkpoint, self._path)
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s to check the nodes' model fingerprint: %s", self._path, exc)
        await asyncio.to_thread(lambda: self._tokenizer.fingerprint)

    def check(self, node: NodeInfo) -> None:
        """ModelMismatch when the node serves another model or tokenizer than ours."""
        key = (node.node_id, node.epoch)
        if key not in self._verdicts:
            self._verdicts[key] = self._verdict(node)
            if self._verdicts[key] is not None:
                log.error("%s", self._verdicts[key])
        message = self._verdicts[key]
        if message is not None:
            raise ModelMismatch(message)

    def _verdict(self, node: NodeInfo) -> str | None:
        mine = self._tokenizer.fingerprint
        theirs = node.tokenizer_fingerprint
        name = os.path.basename(os.path.normpath(self._path))
        if theirs and theirs != mine:
            return (
                f"the router's tokenizer ({name}, fingerprint {mine[:16]}) is not node {node.node_id}'s "
                f"(fingerprint {theirs[:16]}): start the router with the nodes' model"
            )
        expected = self._model_fingerprint(node.kv_layout.dtype, node.block_size, node.quantization)
        if expected is not None and expected != node.model_fingerprint:
            return (
                f"the router's model ({name}, fingerprint {expected[:16]}) is not node {node.node_id}'s "
                f"(model fingerprint {node.model_fingerprint[:16]}): start the router with the nodes' model"
            )
        return None

    def _model_fingerprint(self, kv_dtype: str, block_size: int, quantization: str) -> str | None:
        if self._checkpoint is None:
            return None
        key = (kv_dtype, block_size, quantization)
        if key not in self._fingerprints:
            config, identity, stored = self._checkpoint
            if quantization != "none" and not stored:  # quantized at load (shared/model/loader.py)
                identity = quantized_identity(identity, quantization)
            self._fingerprints[key] = model_fingerprint(
                config.to_dict(), identity, kv_dtype, block_size
            ).hex()
        return self._fingerprints[key]
