"""The model worker and the engine, in process on tiny random models: queue bounds, cancellation, failures,
stop ids, and output equal to `flashdraft.generate`'s."""

import asyncio

import pytest

import flashdraft
from flashdraft.sampling import SamplingParams
from flashdraft.serve.worker import (
    Cancelled,
    Engine,
    Failed,
    Finished,
    Job,
    QueueFull,
    ShuttingDown,
    TextDelta,
    Worker,
)

from tiny import tiny_draft, tiny_target, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
EOT = TOKENIZER.eos_token_id
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    target = tiny_target(max_positions=512)
    return Engine.from_models(target, TOKENIZER, tiny_draft(target, block_size=4), name="tiny", block_size=4)


def job(prompt, max_tokens=8, stop=(), loop=None) -> Job:
    return Job(list(prompt), max_tokens, GREEDY, None, list(stop), loop or asyncio.get_running_loop())


async def collect(j: Job, timeout: float = 60) -> tuple[str, object]:
    text = []
    while True:
        event = await asyncio.wait_for(j.events.get(), timeout)
        if isinstance(event, TextDelta):
            text.append(event.text)
        else:
            return "".join(text), event


def test_stop_ids_come_from_tokenizer_and_generation_config():
    target = tiny_target()
    target.generation_config.eos_token_id = [7, 9]
    engine = Engine.from_models(target, TOKENIZER, None, name="tiny")
    assert engine.stop_token_ids == {EOT, 7, 9}
    assert engine.block_size == 1


def test_block_size_adapts_by_default_with_a_draft():
    target = tiny_target(max_positions=512)
    assert Engine.from_models(target, TOKENIZER, tiny_draft(target, block_size=4), name="tiny").block_size == "auto"


def test_block_size_above_one_needs_proposals():
    with pytest.raises(ValueError, match="needs proposals"):
        Engine.from_models(tiny_target(), TOKENIZER, None, name="tiny", block_size=4)
    with pytest.raises(ValueError, match="needs a draft"):
        Engine.from_models(tiny_target(), TOKENIZER, None, name="tiny", proposals="hybrid")
    with pytest.raises(ValueError, match="proposals must be one of"):
        Engine.from_models(tiny_target(), TOKENIZER, None, name="tiny", proposals="ngram")


def test_proposals_are_hybrid_with_a_draft_and_lookup_needs_none():
    target = tiny_target()
    assert Engine.from_models(target, TOKENIZER, tiny_draft(target), name="tiny").proposals == "hybrid"
    assert Engine.from_models(target, TOKENIZER, None, name="tiny").proposals is None
    lookup = Engine.from_models(target, TOKENIZER, tiny_draft(target), name="tiny", proposals="lookup")
    assert lookup.proposals == "lookup" and lookup.draft is None and lookup.block_size == "auto"


def test_draft_for_another_target_is_refused_at_start():
    draft = tiny_draft(tiny_target(num_layers=6))
    with pytest.raises(ValueError, match="layers"):
        Engine.from_models(tiny_target(num_layers=4), TOKENIZER, draft, name="tiny")


def test_chat_prompt_uses_the_chat_template(engine):
    ids = engine.chat_prompt([{"role": "user", "content": "w1 w2"}])
    assert TOKENIZER.convert_ids_to_tokens(ids) == ["<user>", "w1", "w2", "<eot>", "<assistant>"]


def test_token_prompt_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        engine.text_prompt([5, 96])


def test_queue_is_bounded(engine):
    async def main():
        worker = Worker(engine, max_queue=2)  # not started: nothing leaves the queue
        worker.submit(job([5]))
        worker.submit(job([6]))
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            worker.submit(job([7]))
        assert worker.queued == 2

    asyncio.run(main())


def test_output_equals_generate_and_stops_at_end_of_turn(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "w42 w45 w48"}])  # answered in 17 tokens and <eot>
    reference = flashdraft.generate(
        engine.target, engine.draft, prompt, max_new_tokens=40, stop_token_ids=engine.stop_token_ids, block_size=4
    )

    async def main():
        worker = Worker(engine, max_queue=4)
        worker.start()
        try:
            j = job(prompt, max_tokens=40)
            worker.submit(j)
            return await collect(j)
        finally:
            worker.stop()

    text, finished = asyncio.run(main())
    assert text == TOKENIZER.decode(reference.tokens, skip_special_tokens=True)
    assert isinstance(finished, Finished)
    assert finished.completion_tokens == len(reference.tokens)
    assert finished.finish_reason == reference.stop_reason == "stop"
    assert reference.tokens[-1] == EOT
    assert finished.statistics.acceptance_lengths == reference.acceptance_lengths
    assert finished.statistics.block_size == 4
    assert finished.statistics.proposals == "hybrid"
    assert finished.statistics.tokens_by_source == reference.tokens_by_source
    assert sum(finished.statistics.tokens_by_source.values()) == finished.completion_tokens


def test_cancelled_jobs_leave_the_queue_or_stop_and_the_worker_goes_on(engine):
    async def main():
        worker = Worker(engine, max_queue=3)
        skipped, long, short = job([5, 6]), job([7, 8], max_tokens=400), job([9], max_tokens=3)
        for j in (skipped, long, short):
            worker.submit(j)
        worker.cancel(skipped)
        assert (worker.queued, worker.cancelled) == (2, 1)  # its place is free at once
        worker.submit(job([10]))  # so a third job fits again
        worker.start()
        try:
            first = await asyncio.wait_for(long.events.get(), 60)
            assert isinstance(first, TextDelta)
            worker.cancel(long)
            text, finished = await collect(short)
            assert isinstance(finished, Finished) and finished.completion_tokens == 3
            assert worker.cancelled == 2
            return long
        finally:
            worker.stop()

    long = asyncio.run(main())
    # The long job stopped within a round of its cancellation: far fewer events than its 400 tokens.
    assert long.events.qsize() < 20


def test_a_failing_job_does_not_end_the_worker(engine):
    async def main():
        worker = Worker(engine, max_queue=4)
        bad, good = job([5, 1000]), job([5], max_tokens=2)  # 1000 is outside the vocabulary
        worker.submit(bad)
        worker.submit(good)
        worker.start()
        try:
            return await collect(bad), await collect(good), worker.failed
        finally:
            worker.stop()

    (_, failure), (_, finished), failed = asyncio.run(main())
    assert isinstance(failure, Failed) and "vocabulary" in failure.message
    assert isinstance(finished, Finished) and finished.completion_tokens == 2
    assert failed == 1


def test_jobs_still_waiting_at_shutdown_fail_with_their_own_code(engine):
    async def main():
        worker = Worker(engine, max_queue=2)  # not started: the job is still waiting when the server stops
        waiting = job([5])
        worker.submit(waiting)
        worker.stop()
        return await collect(waiting)

    _, failure = asyncio.run(main())
    assert failure == Failed("the server is shutting down", code="shutting_down")


def test_every_cancelled_job_ends_its_events(engine):
    # Whoever waits on a job's events (a request handler) must be let go: a job's last event is its answer,
    # a failure or Cancelled, never nothing.
    async def main():
        worker = Worker(engine, max_queue=3)
        running, waiting = job([7, 8], max_tokens=400), job([9])
        worker.submit(running)
        worker.submit(waiting)
        worker.start()
        try:
            assert isinstance(await asyncio.wait_for(running.events.get(), 60), TextDelta)
            worker.cancel(waiting)
            worker.cancel(running)
            return (await collect(waiting, timeout=10))[1], (await collect(running, timeout=10))[1]
        finally:
            worker.stop()

    assert asyncio.run(main()) == (Cancelled(), Cancelled())


def test_stopping_fails_the_running_job_at_once_and_refuses_new_ones(engine):
    async def main():
        worker = Worker(engine, max_queue=2)
        running = job([7, 8], max_tokens=400)
        worker.submit(running)
        worker.start()
        assert isinstance(await asyncio.wait_for(running.events.get(), 60), TextDelta)
        worker.stop(wait=False)  # as on SIGTERM: requests get their answer now, not when they would have ended
        _, failure = await collect(running, timeout=10)
        with pytest.raises(ShuttingDown, match="the server is shutting down"):
            worker.submit(job([5]))
        worker.stop()
        return failure

    assert asyncio.run(main()) == Failed("the server is shutting down", code="shutting_down")


# ------------------------------------------------------------------------------------------ the batched worker


def test_the_batched_worker_answers_each_job_as_the_serial_one_does(engine):
    """Jobs stepped together (some joining while others run, one with a stop string, one whose client leaves):
    every text and token count equals the serial worker's; the departed job's row is freed, the queue bound holds."""
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 9, 10, 11, 12], [13, 14], [15], [16, 17, 18]]

    async def run(max_batch_size):
        worker = Worker(engine, max_queue=8, max_batch_size=max_batch_size)
        jobs = [job(prompt, max_tokens=12 + 3 * i) for i, prompt in enumerate(prompts)]
        stopping = job([5, 6, 7], max_tokens=30, stop=["w3"])
        leaving = job([20, 21], max_tokens=400)
        for j in jobs[:3] + [leaving]:
            worker.submit(j)
        worker.start()
        try:
            first = await asyncio.wait_for(leaving.events.get(), 60)  # the leaving job runs now
            assert isinstance(first, TextDelta)
            for j in jobs[3:] + [stopping]:  # join while the others run
                worker.submit(j)
            worker.cancel(leaving)
            answers = [await collect(j) for j in jobs + [stopping]]
            _, last = await collect(leaving)
            assert isinstance(last, Cancelled) and worker.cancelled == 1
            for _ in range(500):  # the serial worker clears its running job just after the last event
                if worker.running_count == 0:
                    break
                await asyncio.sleep(0.01)
            assert worker.running_count == 0
            return [(text, event.completion_tokens, event.finish_reason) for text, event in answers]
        finally:
            worker.stop()

    batched, serial = asyncio.run(run(4)), asyncio.run(run(1))
    assert batched == serial
    assert batched[-1][2] == "stop"


def test_max_batch_size_is_checked(engine):
    with pytest.raises(ValueError, match="max_batch_size"):
        Worker(engine, max_queue=4, max_batch_size=0)


def test_departed_clients_free_their_rows_and_the_memory_stays_flat(engine):
    """Three rounds of streams whose clients leave after their first text: every row is freed (in the batch, its
    prefill and the draft's cache) and the caches never hold more than the batch's rows at the longest request's
    length: what they reach depends on how the rounds interleave with the clients, a leak would grow past it."""

    def allocated(batch):  # (rows, positions) each engine cache holds room for, and the per-row caches left
        caches = (batch.cache.engine_cache, batch.prefill_cache.engine_cache)
        return [tuple(cache.keys.shape[i] for i in (1, 3)) if cache is not None and cache.keys is not None
                else (0, 0) for cache in caches] + [len(batch.cache.caches), len(batch.prefill_cache.caches)]

    async def main():
        worker = Worker(engine, max_queue=8, max_batch_size=4)
        worker.start()
        sizes = []
        try:
            for round_ in range(3):
                jobs = [job([5 + round_, 6 + i, 7], max_tokens=400) for i in range(6)]  # 2 of them wait at first
                for j in jobs:
                    worker.submit(j)
                for j in jobs:
                    assert isinstance(await asyncio.wait_for(j.events.get(), 60), TextDelta)
                    worker.cancel(j)
                for j in jobs:
                    assert (await collect(j, timeout=10))[1] == Cancelled()
                for _ in range(500):
                    if worker.running_count == 0 and len(worker._batch) == 0:
                        break
                    await asyncio.sleep(0.01)
                batch = worker._batch
                assert worker.running_count == 0 and len(batch) == 0
                assert len(batch.cache) == len(batch.prefill_cache) == 0
                assert batch.draft_cache is None or batch.draft_cache.lengths == []
                sizes.append(allocated(batch))
            return sizes, worker.cancelled
        finally:
            worker.stop()

    sizes, cancelled = asyncio.run(main())
    assert cancelled == 18
    for decoding, prefill, rows, prefill_rows in sizes:  # 4 rows; 3 prompt + 400 tokens fit 512 positions
        assert decoding[0] <= 4 and prefill[0] <= 4 and decoding[1] <= 512 and prefill[1] <= 512
        assert rows == prefill_rows == 0


def test_a_failure_outside_the_forwards_fails_the_jobs_not_the_batched_worker(engine, monkeypatch):
    """Freeing a departed client's row failed once (a bug since fixed): the running jobs are answered Failed and the
    next job is served, where the worker thread had died and every later request waited forever."""
    from flashdraft.batching import Batch

    calls = []
    cancel = Batch.cancel

    def failing_once(batch, sequence):
        calls.append(sequence)
        if len(calls) == 1:
            raise IndexError("index 2 is out of bounds")
        cancel(batch, sequence)

    monkeypatch.setattr(Batch, "cancel", failing_once)

    async def main():
        worker = Worker(engine, max_queue=4, max_batch_size=4)
        worker.start()
        try:
            leaving, staying = job([7, 8], max_tokens=400), job([9, 10], max_tokens=400)
            worker.submit(leaving)
            worker.submit(staying)
            for j in (leaving, staying):
                assert isinstance(await asyncio.wait_for(j.events.get(), 60), TextDelta)
            worker.cancel(leaving)
            _, failure = await collect(staying)
            after = job([5], max_tokens=2)
            worker.submit(after)
            return failure, await collect(after)
        finally:
            worker.stop()

    failure, (_, finished) = asyncio.run(main())
    assert isinstance(failure, Failed) and "out of bounds" in failure.message
    assert isinstance(finished, Finished) and finished.completion_tokens == 2
