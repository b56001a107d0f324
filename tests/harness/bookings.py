"""The model the ledger state machines (test_router_ledger_property.py, test_router_ledger_fleet.py) hold
the router's in-flight ledger to: each booking as the test made it, and what the live ones should count."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.admission import Booking
from pdserve.shared.types import NodeId


@dataclass
class Held:
    booking: Booking
    decode: NodeId
    prefill: NodeId | None
    tokens: int
    prefilling: bool = True
    live: bool = True


def expected_load(held: list[Held], node: NodeId) -> tuple[int, int]:
    """(requests, prompt tokens) the bookings put on `node`: a live booking is one request on its decode
    node, and one more on its prefill node until its prefill is done; its tokens count on the node that
    prefills it (the decode node when there is no prefill node) until then."""
    requests = sum(h.live and h.decode == node for h in held)
    requests += sum(h.prefilling and h.prefill == node for h in held)
    tokens = sum(h.tokens for h in held if h.prefilling and (h.prefill or h.decode) == node)
    return requests, tokens
