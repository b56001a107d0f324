"""router/migration.py's bookkeeping, pure: the continuation's prompt is the prompt plus exactly the streamed
tokens, max_tokens what remains, and later steps are reported as the original request would report them."""

from __future__ import annotations

from pdserve.router.migration import Continuation
from pdserve.shared.engine.sampling_params import SamplingParams
from pdserve.shared.node.node_protocol import StepOutput
from pdserve.shared.types import RequestId


def step(tokens: tuple[int, ...], completion: int, prompt: int, cached: int) -> StepOutput:
    return StepOutput(RequestId("r"), tokens, "x" * len(tokens), None, None, prompt, completion, cached)


def test_migration_continues_from_the_streamed_tokens() -> None:
    cont = Continuation((1, 2, 3), SamplingParams(max_tokens=10, temperature=0.7, seed=5))
    assert cont.record(step((7,), 1, 3, 2)) == step((7,), 1, 3, 2)  # first attempt: unchanged
    cont.record(step((8, 9), 3, 3, 2))
    assert cont.eligible(1)
    prompt, sampling = cont.migrate()
    assert prompt == (1, 2, 3, 7, 8, 9) and sampling.max_tokens == 7 and sampling.seed == 5
    assert not cont.eligible(1) and cont.eligible(2)
    # the next node counts from its own start, on the longer prompt, with its own cache
    assert cont.record(step((4,), 1, 6, 0)) == step((4,), 4, 3, 2)
    assert cont.streamed == [7, 8, 9, 4]


def test_penalties_on_output_tokens_are_not_migrated() -> None:
    assert not Continuation((1,), SamplingParams(max_tokens=4, frequency_penalty=0.5)).eligible(3)
    assert not Continuation((1,), SamplingParams(max_tokens=4, presence_penalty=0.5)).eligible(3)
    assert not Continuation((1,), SamplingParams(max_tokens=4)).eligible(0)


def test_a_migration_keeps_what_remains_of_min_tokens() -> None:
    cont = Continuation((1, 2), SamplingParams(max_tokens=10, min_tokens=5))
    cont.record(step((7, 8), 2, 2, 0))
    assert cont.migrate()[1].min_tokens == 3  # two of the five were streamed before the node failed
    cont.record(step((9, 9, 9, 9), 4, 4, 0))
    assert cont.migrate()[1].min_tokens == 0
