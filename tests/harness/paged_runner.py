"""`PagedRunner`: drives a `LlamaModel` the way the model runner does (per-sequence block tables into one
small paged KV cache, ReferenceOps), so model tests can compare its logits with Hugging Face's without an
engine."""

from __future__ import annotations

import torch
from pdserve.kernels.ops import AttentionMetadata
from pdserve.kernels.reference import ReferenceOps
from pdserve.shared.model.model import LlamaModel

BLOCK = 8


class PagedRunner:
    """Drives the model like a model runner: per-sequence block tables into one small paged cache."""

    def __init__(self, model: LlamaModel, n_blocks: int = 24) -> None:
        cfg = model.config
        self.model = model
        self.kv = torch.zeros(cfg.num_layers, 2, n_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.free = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: list[list[int]] = []
        self.lens: list[int] = []
        self.hooked: list[int] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def step(self, chunks: dict[int, torch.Tensor]) -> torch.Tensor:
        """chunks: {seq: new token ids} -> logits [sum of chunk lengths, V]."""
        ids, pos, slots, starts, seq_lens = [], [], [], [0], []
        for s, toks in chunks.items():
            start = self.lens[s]
            self.lens[s] += len(toks)
            while len(self.tables[s]) * BLOCK < self.lens[s]:
                self.tables[s].append(self.free.pop())
            p = torch.arange(start, self.lens[s])
            table = torch.tensor(self.tables[s])
            ids.append(toks)
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            starts.append(starts[-1] + len(toks))
            seq_lens.append(self.lens[s])
        width = max(len(self.tables[s]) for s in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, s in enumerate(chunks):
            tables[row, : len(self.tables[s])] = torch.tensor(self.tables[s])
        meta = AttentionMetadata(
            positions=torch.cat(pos),
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
            rope=self.model.rope,
        )
        self.hooked.clear()
        with torch.inference_mode():
            hidden = self.model(torch.cat(ids), self.kv, meta, ReferenceOps(), self.hooked.append)
            return self.model.compute_logits(hidden)
