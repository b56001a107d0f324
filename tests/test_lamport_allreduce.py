"""The Lamport all-reduce's logic (kernels/triton_allreduce.py) under Triton's interpreter on the CPU: two
ranks' buffers in one process, the kernels run one rank after the other. The first rank of a call pushes
its words and runs out of polls (its peer has not pushed yet); the second finds every word and must give
all_reduce + add_rms_norm's result. Also: the epoch advances once per call and wraps, and a word left from
an earlier call never passes as this call's."""

from __future__ import annotations

import pytest
import torch
from pdserve.kernels import triton_allreduce as ar
from pdserve.kernels.reference import ReferenceOps
from pdserve.tests.harness import triton_interpreter  # noqa: F401  (the interpreter, or a skip on CUDA)

pytestmark = pytest.mark.extras  # needs triton, the [gpu] extra: `make test-extras`

CAPACITY = 256  # pairs per source and slot


def _ranks(max_polls: int = 3) -> list[ar.LamportState]:
    bufs = [torch.zeros(2 * 2 * CAPACITY, dtype=torch.int64) for _ in range(2)]
    addresses = [b.data_ptr() for b in bufs]
    return [ar.LamportState.create(b, addresses, r, max_polls) for r, b in enumerate(bufs)]


def _epoch(st: ar.LamportState) -> int:
    return int(st.state[0])


def _reset_error(st: ar.LamportState) -> None:
    st.error[0] = 0


def test_fused_second_rank_gets_all_reduce_then_add_rms_norm_and_epochs_advance() -> None:
    torch.manual_seed(0)
    ranks = _ranks()
    ref = ReferenceOps()
    rows, cols = 3, 64
    weight = torch.randn(cols).to(torch.bfloat16)
    for call, order in enumerate(((1, 0), (0, 1), (1, 0))):
        parts = [torch.randn(rows, cols).to(torch.bfloat16) for _ in range(2)]
        residual = torch.randn(rows, cols).to(torch.bfloat16)
        results = {}
        for r in order:
            _reset_error(ranks[r])
            x, res = parts[r].clone(), residual.clone()
            results[r] = ar.all_reduce_add_rms_norm(ranks[r], x, res, weight, 1e-5)
        first, second = order
        assert ranks[first].failed()  # its peer had not pushed: it ran out of polls
        assert not ranks[second].failed()
        total = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
        want_res = residual.clone()
        want_normed, want_res = ref.add_rms_norm(total, want_res, weight, 1e-5)
        normed, res = results[second]
        assert torch.equal(res, want_res)
        torch.testing.assert_close(normed, want_normed, rtol=1.6e-2, atol=1e-2)
        assert _epoch(ranks[0]) == _epoch(ranks[1]) == call + 2


def test_plain_all_reduce_in_place_over_several_programs() -> None:
    torch.manual_seed(1)
    n = 2 * (2 * ar.PLAIN_PAIRS + 3)  # three programs, the last one partial
    bufs = [torch.zeros(2 * 2 * n, dtype=torch.int64) for _ in range(2)]
    addresses = [b.data_ptr() for b in bufs]
    big = [ar.LamportState.create(b, addresses, r, 3) for r, b in enumerate(bufs)]
    parts = [torch.randn(n).to(torch.bfloat16) for _ in range(2)]
    x1 = parts[1].clone()
    ar.all_reduce(big[1], x1)
    x0 = parts[0].clone()
    assert ar.all_reduce(big[0], x0) is x0
    assert torch.equal(x0, (parts[0].float() + parts[1].float()).to(torch.bfloat16))
    assert not big[0].failed() and _epoch(big[0]) == _epoch(big[1]) == 2


def test_a_stale_word_never_passes_as_this_calls() -> None:
    ranks = _ranks()
    x = [torch.ones(1, 8, dtype=torch.bfloat16) for _ in range(2)]
    # call 1 (slot 1): rank 1 reads before rank 0 pushes, so rank 0's epoch-1 words stay in rank 1's slot 1
    ar.all_reduce(ranks[1], x[1].clone())
    ar.all_reduce(ranks[0], x[0].clone())
    # call 2 (slot 0), in order
    ar.all_reduce(ranks[0], x[0].clone())
    ar.all_reduce(ranks[1], x[1].clone())
    # call 3 (slot 1 again): rank 1 alone finds only the epoch-1 words there, and must not take them
    _reset_error(ranks[1])
    ar.all_reduce(ranks[1], x[1].clone())
    assert ranks[1].failed()


def test_epoch_wraps_past_zero() -> None:
    ranks = _ranks()
    for st in ranks:
        st.state[0] = ar.EPOCH_WRAP - 1
    x = torch.ones(4, dtype=torch.bfloat16)
    ar.all_reduce(ranks[1], x.clone())
    got = ar.all_reduce(ranks[0], x.clone())
    assert torch.equal(got, torch.full((4,), 2.0, dtype=torch.bfloat16))
    assert _epoch(ranks[0]) == _epoch(ranks[1]) == 1


def test_fits_only_bf16_even_within_the_buffer() -> None:
    st = _ranks()[0]
    assert st.fits(torch.zeros(2 * CAPACITY, dtype=torch.bfloat16))
    assert not st.fits(torch.zeros(2 * CAPACITY + 2, dtype=torch.bfloat16))
    assert not st.fits(torch.zeros(7, dtype=torch.bfloat16))
    assert not st.fits(torch.zeros(8, dtype=torch.float16))
    assert not st.fits(torch.zeros(4, 8, dtype=torch.bfloat16)[:, :4])
