"""D's state of one accepted transfer, and the checks a DATA frame must pass against its reservation.

Invariants: `received[layer, j]` is set only once layer `layer` of reserved block j was handed to `on_data`;
a DATA frame is valid only if it names reserved destinations at their prompt positions, layers inside the
model and exactly the payload size its descriptors imply (`blocks_of` says what is wrong otherwise).
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from pdserve.kvtransfer.common import KVLayout, OpenReply, check_layers
from pdserve.kvtransfer.framing import FramedConnection
from pdserve.kvtransfer.messages import Complete, Data
from pdserve.shared.types import RequestId

Cols = slice | list[int]  # a DATA frame's columns among the reserved blocks


class OpenTransfer:
    """An OPEN that D accepted, until it completes or aborts (the receiver holds it in `_transfers`)."""

    def __init__(
        self, tid: RequestId, conn: FramedConnection, reply: OpenReply, deadline: float, layers: int
    ):
        self.tid = tid
        self.conn = conn
        self.reply = reply
        self.deadline = deadline
        self.lock = asyncio.Lock()
        self.done = False
        self.received = np.zeros((layers, len(reply.dst_block_ids)), dtype=np.bool_)  # [L, reserved]
        self.expiry: asyncio.Task[None] | None = None
        self.landing = 0  # DATA frames whose bytes are still landing (delivered by a task)
        self.complete: Complete | None = None  # COMPLETE, read while some DATA was still landing
        self._dst_ids: torch.Tensor | None = None  # [reserved] int64: dst_block_ids where payloads land

    def dst_ids(self, device: torch.device) -> torch.Tensor:
        """The reserved destination ids as one tensor on `device`, built at the first DATA (a frame's ids are
        then a slice of it: no tensor built from a list, no synchronous host-to-device copy per frame)."""
        if self._dst_ids is None or self._dst_ids.device != device:
            ids = torch.tensor(self.reply.dst_block_ids, dtype=torch.int64, pin_memory=device.type == "cuda")
            self._dst_ids = ids.to(device, non_blocking=True)
        return self._dst_ids

    def blocks_of(
        self, msg: Data, payload: torch.Tensor | None, layout: KVLayout
    ) -> tuple[torch.Tensor, Cols] | str:
        """(dst ids on the payload's device, reserved columns) of a valid DATA, or what is wrong with it."""
        n = len(msg.block_indices)
        if payload is None:
            return "DATA without payload"
        if n == 0 or not n == len(msg.src_blocks) == len(msg.dst_blocks):
            return f"DATA descriptor lists differ in length or are empty ({n}, {len(msg.dst_blocks)})"
        try:
            check_layers(msg.layer_start, msg.num_layers, layout)
            if payload.numel() != msg.num_layers * n * layout.layer_block_bytes:
                return f"DATA payload {payload.numel()} B != {msg.num_layers} layers x {n} blocks"
            cols = self.reply.columns(msg.block_indices, msg.dst_blocks)
        except ValueError as e:
            return f"DATA {e}"
        return self.dst_ids(payload.device)[cols], cols
