"""The micro-batcher a GPU server puts in front of its model: concurrent requests scored in one call, each caller
getting its own answer, a full batch not waiting for the window, a failing request failing alone."""

import asyncio

import pytest

from common.serving.microbatch import MicroBatcher


class Recorder:
    def __init__(self, fail_on=None):
        self.calls, self.fail_on = [], fail_on

    def __call__(self, items):
        self.calls.append(list(items))
        if self.fail_on in items:
            raise ValueError(f"cannot answer {self.fail_on}")
        return [item * 10 for item in items]


def gathered(batcher, items):
    async def run():
        return await asyncio.gather(*(batcher.submit(item) for item in items), return_exceptions=True)

    return asyncio.run(asyncio.wait_for(run(), timeout=10))


def test_concurrent_requests_are_scored_in_one_call_and_each_gets_its_own_answer():
    handle = Recorder()
    batcher = MicroBatcher(handle, window_s=0.05)
    assert gathered(batcher, range(8)) == [item * 10 for item in range(8)]
    assert handle.calls == [list(range(8))] and (batcher.batches, batcher.requests) == (1, 8)


def test_a_full_batch_runs_without_waiting_for_the_window():
    handle = Recorder()
    batcher = MicroBatcher(handle, window_s=60, max_size=4)  # a window the test would time out in
    assert gathered(batcher, range(8)) == [item * 10 for item in range(8)]
    assert handle.calls == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_request_that_cannot_be_answered_fails_alone():
    handle = Recorder(fail_on=3)
    answers = gathered(MicroBatcher(handle, window_s=0.01), [1, 2, 3, 4])
    assert answers[:2] == [10, 20] and answers[3] == 40
    assert isinstance(answers[2], ValueError) and str(answers[2]) == "cannot answer 3"
    assert handle.calls[0] == [1, 2, 3, 4]  # tried together first, then one at a time


def test_requests_after_a_batch_form_the_next_one():
    handle = Recorder()
    batcher = MicroBatcher(handle, window_s=0.01)

    async def two_waves():
        first = await asyncio.gather(*(batcher.submit(item) for item in (1, 2)))
        return first, await asyncio.gather(*(batcher.submit(item) for item in (3, 4, 5)))

    assert asyncio.run(two_waves()) == ([10, 20], [30, 40, 50])
    assert handle.calls == [[1, 2], [3, 4, 5]]


@pytest.mark.parametrize(("window", "size"), [(-0.001, 4), (0.002, 0)])
def test_a_bad_setting_is_refused(window, size):
    with pytest.raises(ValueError, match="micro-batching needs"):
        MicroBatcher(Recorder(), window_s=window, max_size=size)
