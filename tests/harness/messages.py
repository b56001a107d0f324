"""One example of every KV-transfer message, and of the node protocol's request and reply messages, for the
round-trip and fuzz tests."""

from __future__ import annotations

from pdserve.kvtransfer.common import KVLayout
from pdserve.kvtransfer.messages import (
    Abort,
    Ack,
    Auth,
    Complete,
    Data,
    Error,
    Hello,
    Message,
    Open,
    OpenOk,
    OpenRefusal,
    Ping,
    Ready,
)
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import (
    AbortRequest,
    NodeGenerateRequest,
    NodeInfoReply,
    PrefillRequest,
    PrefillResult,
    StepOutput,
    TokenLogprob,
    TopLogprob,
)
from pdserve.shared.types import BlockHash, FirstToken, NodeId, RequestId
from pdserve.shared.wire import JsonMessage

LAYOUT = KVLayout(30, 3, 64, 16, "bfloat16", tp_size=2)
EXAMPLES: list[Message] = [
    Hello(1, "decode-0", b"\x01" * 32, LAYOUT, b"\x02" * 32, True, b"\x03" * 32, 5.0),
    Hello(1, "prefill-0", b"fp", KVLayout(2, 1, 8, 4, "float32"), b"\x04" * 32, False),
    Auth(b"\x05" * 32),
    Ready(),
    Error("layout", "layout.block_size: local 16, peer 32"),
    Open(RequestId("req-1"), (BlockHash(b"\x06" * 32), BlockHash(b"\x07" * 32)), 3, 1.7e9 + 0.25),
    OpenOk("req-1", 2, (5, 9)),
    OpenRefusal("req-1", "need 3 blocks, 2 free"),
    Data("req-1", 4, 2, (2, 3), (11, 12), (5, 9)),
    Complete("req-1", FirstToken(42, -0.5, ((1, -1.0),))),
    Ack("req-1"),
    Abort("req-1", "deadline passed"),
    Ping(),
]

SAMPLING = SamplingParams(max_tokens=8, temperature=0.7, stop=("x",), logprobs=2, seed=3)
NODE_EXAMPLES: list[JsonMessage] = [
    NodeGenerateRequest(RequestId("r"), (1, 2, 3), SAMPLING, "salt", 1e9, NodeId("p0")),
    PrefillRequest(RequestId("r"), (1, 2), SAMPLING, None, 1e9, NodeId("d0"), "127.0.0.1:9000"),
    PrefillResult(RequestId("r"), 42, 10, 6, 2),
    StepOutput(
        RequestId("r"),
        (5,),
        "a",
        (TokenLogprob(5, "a", -0.5, (97,), (TopLogprob("b", 6, -1.0, None),)),),
        "stop",
        3,
        1,
        0,
    ),
    AbortRequest(RequestId("r")),
    NodeInfoReply(NodeId("d0"), "decode", "m", 2048, 16),
]
