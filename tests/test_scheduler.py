"""Scheduler over the real BlockPool, no model: a fake step (tests/harness/scheduler.py) writes token ids into
a simulated KV store so every scenario also checks that cached and preserved blocks hold the tokens they
claim to hold."""

from __future__ import annotations

import pytest
from pdserve.shared.engine.block_pool import BlockPool
from pdserve.shared.engine.request import RequestStatus
from pdserve.shared.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.shared.types import RequestId
from pdserve.tests.harness.scheduler import EOS, Harness


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end() -> None:
    h = Harness(num_blocks=64, budget=32)
    a = h.add("a", list(range(10, 110)), max_tokens=3)
    chunks = []
    for _ in range(4):
        out, _ = h.step()
        (s,) = out.scheduled
        chunks.append((s.start, s.num_new_tokens, s.samples))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert a.output_token_ids == [100]
    assert h.run() == ["a"]
    assert a.output_token_ids == [100, 101, 102] and a.finish_reason == "length"
    assert h.sched.stats.computed_prompt_tokens == 100 and h.sched.stats.computed_tokens == 102
    h.assert_all_free()


def test_decodes_go_first_and_share_the_budget_with_a_prefill() -> None:
    h = Harness(num_blocks=64, budget=16)
    a = h.add("a", [5, 6, 7], max_tokens=10)
    h.step()
    b = h.add("b", list(range(10, 50)), max_tokens=2)
    out, _ = h.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 15)]
    out, _ = h.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 15)]
    assert b.num_computed_tokens == 30 and not b.output_token_ids
    h.run()
    assert a.finish_reason == b.finish_reason == "length"
    h.assert_all_free()


def test_max_num_seqs_limits_the_running_set() -> None:
    h = Harness(num_blocks=64, max_num_seqs=2)
    for i in range(4):
        h.add(f"r{i}", [1, 2, 3, i + 10], max_tokens=3)
    out, _ = h.step()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert h.run() == ["r0", "r1", "r2", "r3"]
    h.assert_all_free()


def test_shared_512_token_prefix_computes_only_the_new_tokens() -> None:
    h = Harness(num_blocks=200, block_size=16, budget=2048)
    prefix = [(7 * i) % 4000 + 3 for i in range(512)]
    a = h.add("a", [*prefix, 11, 12, 13], max_tokens=2)
    h.run()
    stats = h.sched.stats
    assert (stats.computed_prompt_tokens, stats.cached_prompt_tokens) == (515, 0)
    b = h.add("b", [*prefix, 21, 22, 23, 24, 25], max_tokens=2)
    h.step()
    assert b.num_cached_tokens == 512
    assert (stats.computed_prompt_tokens, stats.cached_prompt_tokens) == (520, 512)
    h.run()
    assert a.output_token_ids == b.output_token_ids == [100, 101]
    h.assert_all_free()


def test_prefix_hit_while_the_owner_runs_and_the_last_token_is_always_computed() -> None:
    h = Harness(num_blocks=64, block_size=4)
    prompt = list(range(20, 32))  # exactly 3 full blocks
    a = h.add("a", prompt, max_tokens=8)
    h.step()  # a's prompt blocks are committed by this step's update
    b = h.add("b", prompt, max_tokens=8)
    out, _ = h.step()
    assert b.num_cached_tokens == 8  # blocks 0-1; block 2 holds the last prompt token, computed again
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 12, 1),
        ("b", 8, 4),
    ]
    h.run()
    assert a.output_token_ids == b.output_token_ids
    h.assert_all_free()


def test_preemption_releases_newest_first_and_resume_recomputes_prompt_and_output() -> None:
    h = Harness(num_blocks=8, block_size=4)
    a = h.add("a", list(range(10, 22)), max_tokens=10)  # 12 + 10 tokens: up to 6 blocks
    b = h.add("b", list(range(30, 42)), max_tokens=10)
    preempted: list[RequestId] = []
    seen_preempted_b_output: list[int] = []
    for _ in range(200):
        if not h.sched.has_unfinished():
            break
        out, _ = h.step()
        preempted += out.preempted_ids
        if out.preempted_ids and not seen_preempted_b_output:
            assert b.status is RequestStatus.PREEMPTED and b.block_ids == []
            seen_preempted_b_output = list(b.output_token_ids)
            assert seen_preempted_b_output  # the output survives preemption
    assert preempted and preempted[0] == "b"
    assert "a" not in preempted
    expected = [100 + i for i in range(10)]
    assert a.output_token_ids == expected and b.output_token_ids == expected
    assert h.sched.stats.preemptions == len(preempted)
    h.assert_all_free()


def test_priority_orders_admission_and_chooses_the_preemption_victim() -> None:
    h = Harness(num_blocks=64, max_num_seqs=1)
    h.add("late", [1, 2, 3], max_tokens=2, priority=5)
    h.add("urgent", [4, 5, 6], max_tokens=2, priority=-1)
    h.add("normal", [7, 8, 9], max_tokens=2, priority=0)
    assert h.run() == ["urgent", "normal", "late"]
    h.assert_all_free()

    h = Harness(num_blocks=8, block_size=4)
    old_low = h.add("old_low", list(range(10, 22)), max_tokens=10, priority=1)
    new_high = h.add("new_high", list(range(30, 42)), max_tokens=10, priority=0)
    preempted: list[RequestId] = []
    while h.sched.has_unfinished():
        preempted += h.step()[0].preempted_ids
    assert preempted and set(preempted) == {"old_low"}
    assert len(old_low.output_token_ids) == len(new_high.output_token_ids) == 10
    h.assert_all_free()


def test_stops_eos_stop_tokens_ignore_eos_and_finish() -> None:
    h = Harness(num_blocks=64)
    eos = h.add("eos", [1, 2, 3], max_tokens=9)
    stop = h.add("stop", [1, 2, 4], max_tokens=9, stop_token_ids=(77,))
    ign = h.add("ign", [1, 2, 5], max_tokens=2, ignore_eos=True)
    text = h.add("text", [1, 2, 6], max_tokens=9)
    _, fin = h.step({"eos": EOS, "stop": 77, "ign": EOS})
    assert {r.request_id for r in fin} == {"eos", "stop"}
    assert (eos.status, eos.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    assert (stop.finish_reason, stop.stop_reason) == ("stop", 77)
    assert ign.output_token_ids == [EOS] and not ign.is_finished
    assert h.sched.finish(RequestId("text"), "\n\n") is text
    assert (text.finish_reason, text.stop_reason) == ("stop", "\n\n")
    assert h.sched.finish(RequestId("text"), "\n\n") is None
    h.run()
    assert ign.finish_reason == "length"
    h.assert_all_free()


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "preempted", "between"])
def test_abort_frees_everything_on_every_path(when: str) -> None:
    h = Harness(num_blocks=8, block_size=4, budget=8)
    a = h.add("a", list(range(10, 22)), max_tokens=10)
    b = h.add("b", list(range(30, 42)), max_tokens=10)
    target = {"waiting": b, "mid_prefill": a, "decoding": a, "preempted": b, "between": a}[when]
    steps = {"waiting": 0, "mid_prefill": 1, "decoding": 4}.get(when, 0)
    for _ in range(steps):
        h.step()
    if when == "preempted":
        while b.status is not RequestStatus.PREEMPTED:
            h.step()
    if when == "between":  # aborted after schedule(), before update(): update skips it
        out = h.sched.schedule()
        assert h.sched.abort(RequestId("a")) is a
        h.sched.update(out, {s.request.request_id: 100 for s in out.scheduled if s.samples})
    else:
        assert h.sched.abort(target.request_id) is target
    assert target.status is RequestStatus.FINISHED_ABORTED and target.block_ids == []
    assert h.sched.abort(target.request_id) is None
    h.check()
    h.run()
    h.assert_all_free()


def test_add_prefilled_takes_remote_blocks_and_commits_the_prompt() -> None:
    h = Harness(num_blocks=16, block_size=4)
    prompt = list(range(40, 50))  # 10 tokens: 2 full blocks + 2 tokens
    blocks = h.pool.reserve(3)
    h.pool.fill_done(blocks)
    for pos, tok in enumerate(prompt):
        h.kv[(blocks[pos // 4], pos % 4)] = tok
    req = h.request("d", prompt, max_tokens=3)
    h.sched.add_prefilled(req, blocks, 0, 100)
    assert h.pool.match_prefix(req.block_hashes) == blocks[:2]
    out, _ = h.step()
    assert [(s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [(10, 1, True)]
    h.run()
    assert req.output_token_ids == [100, 101, 102]
    h.assert_all_free()

    first_is_eos = h.request("e", prompt, max_tokens=3)
    eos_blocks = h.pool.reserve(3)
    h.pool.fill_done(eos_blocks)
    h.sched.add_prefilled(first_is_eos, eos_blocks, 0, EOS)
    assert first_is_eos.finish_reason == "stop" and not h.sched.has_unfinished()
    h.assert_all_free()

    # max_tokens=1: the prefilling node sampled the only token; the request ends here and frees it all
    one = h.request("one", prompt, max_tokens=1)
    one_blocks = h.pool.reserve(3)
    h.pool.fill_done(one_blocks)
    h.sched.add_prefilled(one, one_blocks, 0, 100)
    assert one.finish_reason == "length" and one.output_token_ids == [100]
    h.assert_all_free()


def test_refuses_what_can_never_run() -> None:
    h = Harness(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks, the pool has 4"):
        h.add("big", list(range(16)), max_tokens=2)
    h.add("x", [1, 2], max_tokens=2)
    with pytest.raises(ValueError, match="already live"):
        h.add("x", [1, 2], max_tokens=2)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=8), BlockPool(4, 16))
    assert h.sched.abort(RequestId("x")) is not None
    h.assert_all_free()


def test_prefilled_blocks_waiting_behind_a_blocked_head_are_released_rather_than_deadlock() -> None:
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=1)
    fresh = h.add("fresh", list(range(10, 22)), max_tokens=2)  # needs 3 blocks
    holder = h.request("holder", list(range(30, 54)), max_tokens=2, priority=1)
    holder_blocks = h.pool.reserve(6)
    h.pool.fill_done(holder_blocks)
    for pos, tok in enumerate(holder.prompt_token_ids):
        h.kv[(holder_blocks[pos // 4], pos % 4)] = tok
    h.sched.add_prefilled(holder, holder_blocks, 0, 100)
    out, _ = h.step()
    assert out.preempted_ids == ("holder",) and holder.block_ids == []
    assert [s.request.request_id for s in out.scheduled] == ["fresh"]
    assert h.run() == ["fresh", "holder"]
    assert holder.output_token_ids == [100, 101] and fresh.output_token_ids == [100, 101]
    h.assert_all_free()
