"""benchmarks/tp_decode.py's GPU busy time: the union of the kernels' intervals on the timeline, which under
programmatic dependent launch (kernels overlap) is less than the sum of their durations."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from pdserve.benchmarks.tp_decode import busy_us


def test_overlapping_kernels_count_once() -> None:
    # a PDL chain: each kernel starts while its predecessor runs; then a gap; then one nested in another
    chain = [(0.0, 10.0), (8.0, 20.0), (15.0, 25.0)]
    nested = [(40.0, 50.0), (42.0, 45.0)]
    assert busy_us(chain + nested) == 25.0 + 10.0
    assert busy_us(reversed(chain + nested)) == 35.0  # the profiler's order does not matter


def test_disjoint_and_touching_kernels_sum() -> None:
    assert busy_us([(0.0, 1.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert busy_us([]) == 0.0


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=12))
def test_union_equals_the_covered_unit_steps(spans: list[tuple[int, int]]) -> None:
    intervals = [(float(start), float(start + length)) for start, length in spans]
    covered = {t for start, length in spans for t in range(start, start + length)}
    assert busy_us(intervals) == len(covered)
    assert busy_us(intervals) <= sum(end - start for start, end in intervals)
