"""Per-request engine state: tokens, block table, progress and status. The scheduler is its only writer.

Invariants (kept by the scheduler; `Scheduler.check_invariants` asserts them):
- all_token_ids == prompt_token_ids + output_token_ids; the prompt never changes, output only grows.
- block_hashes[i] is the chained hash of full block i of all_token_ids, for every full block, and only
  those (extended incrementally with `extend_block_hashes`, never recomputed).
- num_cached_tokens <= num_computed_tokens <= num_tokens + num_pending; a running request holds exactly
  ceil(num_computed_tokens / block_size) blocks after a step's schedule, one reference each; its first
  num_committed_blocks blocks are committed to the pool under block_hashes[:num_committed_blocks] (or
  are private duplicates of blocks the pool already holds under those hashes).
- A finished request holds no blocks.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.shared.engine.block_hash import hash_blocks
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.types import BlockHash, BlockId, FinishReason, RequestId


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    hash_seed: BlockHash
    """h_{-1} for this request's tenant (block_hash.hash_seed(fingerprint, cache_salt))."""
    priority: int = 0
    """Lower is scheduled earlier; ties go to the earlier arrival."""
    arrival_time: float = field(default_factory=time.monotonic)
    """Seconds on the engine's monotonic clock."""
    scheduled_time: float | None = None
    """When the scheduler first admitted it (same clock); its queue time ends here. None: never admitted
    (still waiting, or its prompt was prefilled on another node)."""
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[BlockId] = field(default_factory=list)
    """The block table: block i holds the KV of tokens [i * block_size, (i + 1) * block_size)."""
    num_computed_tokens: int = 0
    """Tokens whose KV is in block_ids (after the step now scheduled runs)."""
    num_cached_tokens: int = 0
    """Tokens of the last admission served from the prefix cache."""
    num_committed_blocks: int = 0
    num_pending: int = 0
    """Tokens launched steps sampled whose values the scheduler has not applied yet (overlap: 0 to 2)."""
    num_preemptions: int = 0
    """Times the scheduler preempted it (each one recomputes its KV)."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request; None for EOS, length or abort."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    """prompt + output, kept as one list so hashing and batching never concatenate per step."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(
                f"request {self.request_id!r}: prompt_token_ids is empty; at least 1 token needed"
            )
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """OpenAI-style: "stop", "length", "abort", or None while the request is live."""
        return _FINISH_REASONS.get(self.status)

    def append_output(self, token_ids: Sequence[int], block_size: int) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self.extend_block_hashes(block_size)

    def extend_block_hashes(self, block_size: int) -> None:
        """Hashes the blocks that became full since the last call (prompt blocks on the first call)."""
        start = len(self.block_hashes)
        if self.num_tokens // block_size > start:
            parent = self.block_hashes[-1] if start else None
            self.block_hashes.extend(
                hash_blocks(self.all_token_ids, block_size, self.hash_seed, start, parent)
            )
