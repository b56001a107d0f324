"""Hypothesis drives random add / add_prefilled / step / finish / abort sequences through the scheduler and
the real BlockPool; after every operation the pool's and the scheduler's invariants hold, the KV store
holds the tokens every request relies on, and at the end the pool is back to all free."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdserve.shared.engine.block_pool import NoFreeBlocks
from pdserve.shared.types import RequestId
from pdserve.tests.harness.scheduler import EOS, Harness

# Prompts from a 3-token alphabet over short prefixes, so prefix hits are frequent.
prompts = st.lists(st.sampled_from([5, 6, 7]), min_size=1, max_size=6).map(lambda p: p * 3)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, 8), st.integers(0, 2)),
        st.tuples(st.just("prefilled"), prompts, st.integers(2, 6), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(0, 3), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("finish"), st.integers(0, 30), st.integers(0, 0), st.integers(0, 0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(6, 24),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 5),
    overlap=st.booleans(),
)
def test_random_operations_keep_every_invariant(
    ops: list[tuple[str, object, int, int]], num_blocks: int, budget: int, max_num_seqs: int, overlap: bool
) -> None:
    """`overlap`: each step is scheduled before the previous one's tokens are applied (async scheduling)."""
    h = Harness(num_blocks, block_size=4, max_num_seqs=max_num_seqs, budget=budget, overlap=overlap)
    ids: list[str] = []
    for n, (kind, arg, x, y) in enumerate(ops):
        if kind == "add":
            assert isinstance(arg, list)
            req = h.request(f"r{n}", arg, max_tokens=x, priority=y)
            try:
                h.sched.add(req)
                ids.append(req.request_id)
            except ValueError:
                assert -(-(len(arg) + x - 1) // 4) > num_blocks
        elif kind == "prefilled":
            assert isinstance(arg, list)
            req = h.request(f"r{n}", arg, max_tokens=x, priority=y)
            need = -(-len(arg) // 4)
            if -(-(len(arg) + x - 1) // 4) > num_blocks:
                continue
            try:
                blocks = h.pool.reserve(need)
            except NoFreeBlocks:
                continue
            h.pool.fill_done(blocks)
            for pos, tok in enumerate(arg):
                h.kv[(blocks[pos // 4], pos % 4)] = tok
            h.sched.add_prefilled(req, blocks, 0, EOS if y == 2 else 100)
            ids.append(req.request_id)
        elif kind == "step":
            live = [r for r in h.sched.running if r.output_token_ids]
            h.step({r.request_id: EOS for r in live[:1]} if arg == 0 else None)
            if x == 0 and live:
                h.sched.finish(live[-1].request_id, "stop string")
        elif ids:
            assert isinstance(arg, int)
            rid = RequestId(ids[arg % len(ids)])
            if kind == "abort":
                h.sched.abort(rid)
            else:
                h.sched.finish(rid, "stop string")
        h.check()
    h.run(limit=5000)
    h.assert_all_free()
    # A drained pool can hand every block out again.
    h.pool.release(h.pool.allocate(num_blocks)[::-1])
    h.pool.check_invariants()
