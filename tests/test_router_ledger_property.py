"""Hypothesis state machine over the router's in-flight ledger (router/admission.py): any interleaving of
book, prefill_done, release and cancel (a release before anything ran, as when the handler refuses a placed
request) against a model of what each live booking holds.

After every step the ledger's per-node load is exactly the model's sum and never negative; repeated
prefill_done or release changes nothing; once every booking is released, every count is back to zero and
the ledger holds no entry.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from pdserve.router.admission import AdmissionConfig, Ledger, Load
from pdserve.shared.types import NodeId
from pdserve.tests.harness.bookings import Held, expected_load

NODES = tuple(NodeId(n) for n in ("p0", "p1", "d0", "d1"))


class LedgerMachine(RuleBasedStateMachine):
    bookings = Bundle("bookings")

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(AdmissionConfig(max_requests_per_node=3))
        self.held: list[Held] = []

    @rule(
        target=bookings,
        decode=st.sampled_from(NODES[2:]),
        prefill=st.none() | st.sampled_from(NODES[:2]),
        tokens=st.integers(0, 5000),
    )
    def book(self, decode: NodeId, prefill: NodeId | None, tokens: int) -> Held:
        held = Held(self.ledger.book(decode, prefill, tokens), decode, prefill, tokens)
        self.held.append(held)
        return held

    @rule(held=bookings)
    def prefill_done(self, held: Held) -> None:
        held.booking.prefill_done()
        held.prefilling = False

    @rule(held=bookings)
    def release(self, held: Held) -> None:
        held.booking.release()
        held.prefilling = held.live = False

    @rule(held=consumes(bookings))
    def cancel(self, held: Held) -> None:
        with held.booking:  # the context manager releases on exit, whatever ran before
            pass
        held.prefilling = held.live = False

    @invariant()
    def counts_are_the_models(self) -> None:
        for node in NODES:
            requests, tokens = expected_load(self.held, node)
            assert self.ledger.load(node) == Load(requests, tokens)
            assert self.ledger.full(node) == (requests >= 3)

    def teardown(self) -> None:
        for held in self.held:
            held.booking.release()
        assert all(self.ledger.load(node) == Load() for node in NODES)
        assert not self.ledger._counts, "a node with nothing booked keeps no entry"


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
