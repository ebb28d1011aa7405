"""Regeneration and teacher-forced labels on tiny random targets: equal to the target's own `generate` and
forward, resumable after a kill, and the record folder guarded against mixed settings and full disks."""

import importlib
import json
import random
import shutil
import time

import pytest
import torch
from filelock import FileLock

from flashdraft.target import remember_engine
from flashdraft.train import records
from flashdraft.train.labels import label_responses
from flashdraft.train.prompts import Prompt, encode_prompt, user_prompt
from flashdraft.train.records import read_meta, read_records
from flashdraft.train.regenerate import regenerate, required_stop_token_ids

from tiny import greedy_reference, tiny_target, tiny_tokenizer

regenerate_module = importlib.import_module("flashdraft.train.regenerate")  # the package exports a function too

MAX_NEW = 12
TOKENIZER = tiny_tokenizer()


def random_prompts(count: int, seed: int = 0, with_response: bool = False) -> list[Prompt]:
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(f"w{rng.randrange(90)}" for _ in range(rng.randint(low, high)))

    return [user_prompt(f"p{i}", "test", words(1, 30), words(1, 20) if with_response else None) for i in range(count)]


def with_stop_token(model, prompts: list[Prompt]):
    """Make the target's EOS a token that ends some greedy responses early but not all, so that both finished
    rows leaving the batch and rows running to max_new_tokens are exercised."""
    outputs = [greedy_reference(model, encode_prompt(TOKENIZER, p), MAX_NEW) for p in prompts]
    for stop in range(5, model.config.vocab_size):
        ends_early = sum(stop in output[:-1] for output in outputs)
        if ends_early >= 2 and sum(stop not in output for output in outputs) >= 2:
            model.generation_config.eos_token_id = stop
            return model
    raise AssertionError("no token ends some responses but not others")


def responses(folder) -> dict[str, list[int]]:
    return {r.id: r.input_ids[r.response_start :] for r in read_records(folder)}


def shard_contents(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("shard-*.jsonl"))}


@pytest.mark.parametrize("arch, engine", [("llama", "auto"), ("qwen2", "auto"), ("llama", "transformers")])
def test_batched_regeneration_equals_greedy_generate_per_prompt(tmp_path, arch, engine):
    prompts = random_prompts(7)
    model = with_stop_token(tiny_target(arch, seed=1), prompts)
    remember_engine(model, engine)  # the engine's continuous batches; transformers' forward's left-padded ones
    stats = regenerate(model, TOKENIZER, prompts, tmp_path, max_new_tokens=MAX_NEW, batch_size=3, progress=False)
    got = responses(tmp_path)
    stops = required_stop_token_ids(model, TOKENIZER)  # the generation config's end token and the tokenizer's
    for prompt in prompts:
        assert got[prompt.id] == greedy_reference(model, encode_prompt(TOKENIZER, prompt), MAX_NEW, stops)
    lengths = [len(r) for r in got.values()]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW
    assert (stats.written, stats.already_done, stats.tokens) == (7, 0, sum(lengths))
    assert stats.prompt_tokens == sum(len(encode_prompt(TOKENIZER, p)) for p in prompts)


def test_records_hold_prompt_ids_then_response(tmp_path):
    prompts = random_prompts(3)
    model = tiny_target(seed=2)
    regenerate(model, TOKENIZER, prompts, tmp_path, max_new_tokens=4, batch_size=2, progress=False)
    by_id = {r.id: r for r in read_records(tmp_path)}
    for prompt in prompts:
        record = by_id[prompt.id]
        prompt_ids = encode_prompt(TOKENIZER, prompt)
        assert record.input_ids[: record.response_start] == prompt_ids
        assert record.response_start == len(prompt_ids)
        assert record.response_labels == record.input_ids[record.response_start :]
        assert record.labels is None and record.source == "test"
    assert read_meta(tmp_path)["stage"] == "regenerate"


def test_top_k_of_regeneration_ranks_the_greedy_token_first(tmp_path):
    model = tiny_target(seed=3)
    regenerate(model, TOKENIZER, random_prompts(4), tmp_path, max_new_tokens=5, top_k=3, batch_size=2, progress=False)
    for record in read_records(tmp_path):
        response = record.input_ids[record.response_start :]
        assert [ids[0] for ids in record.topk_ids] == response
        assert all(len(ids) == 3 and p[0] >= p[1] >= p[2] > 0 for ids, p in zip(record.topk_ids, record.topk_probs))


def test_sampling_is_reproducible_from_the_seed(tmp_path):
    model, prompts = tiny_target(seed=4), random_prompts(5)

    def run(name, seed):
        regenerate(
            model,
            TOKENIZER,
            prompts,
            tmp_path / name,
            max_new_tokens=8,
            temperature=1.5,
            seed=seed,
            batch_size=2,
            progress=False,
        )
        return responses(tmp_path / name)

    assert run("a", seed=7) == run("b", seed=7)
    assert run("a", seed=7) != run("c", seed=8)


class Killed(Exception):
    pass


def test_resumed_regeneration_writes_the_same_shards_as_an_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(regenerate_module, "GROUP_BATCHES", 1)  # a group of 2 prompts: 5 writes
    prompts = random_prompts(9)
    model = with_stop_token(tiny_target(seed=1), prompts)
    settings = dict(max_new_tokens=MAX_NEW, batch_size=2, records_per_shard=3, progress=False)
    regenerate(model, TOKENIZER, prompts, tmp_path / "whole", **settings)

    real_write, calls = records.ShardWriter.write, []

    def write_then_die(self, batch_records):
        calls.append(len(batch_records))
        if len(calls) == 3:
            raise Killed
        real_write(self, batch_records)

    monkeypatch.setattr(records.ShardWriter, "write", write_then_die)
    with pytest.raises(Killed):
        regenerate(model, TOKENIZER, prompts, tmp_path / "resumed", **settings)
    monkeypatch.setattr(records.ShardWriter, "write", real_write)
    last_shard = sorted((tmp_path / "resumed").glob("shard-*.jsonl"))[-1]
    with last_shard.open("a") as handle:  # a line the kill cut off half-way
        handle.write('{"id": "p5", "source": "te')

    stats = regenerate(model, TOKENIZER, prompts, tmp_path / "resumed", **settings)
    assert stats.already_done == 4 and stats.written == 5
    assert shard_contents(tmp_path / "resumed") == shard_contents(tmp_path / "whole")
    assert len(shard_contents(tmp_path / "whole")) == 3  # 9 records, 3 per shard


def test_a_time_limit_stops_between_batches_and_a_later_run_continues(tmp_path, monkeypatch):
    monkeypatch.setattr(regenerate_module, "GROUP_BATCHES", 1)  # a group of 2 prompts: 5 writes
    prompts = random_prompts(9)
    model = tiny_target(seed=1)
    settings = dict(max_new_tokens=4, batch_size=2, records_per_shard=3, progress=False)
    regenerate(model, TOKENIZER, prompts, tmp_path / "whole", **settings)

    real_write = records.ShardWriter.write

    def slow_write(self, batch_records):  # each batch takes a second: two start within 1.5 s, the third does not
        time.sleep(1.0)
        real_write(self, batch_records)

    monkeypatch.setattr(records.ShardWriter, "write", slow_write)
    stats = regenerate(model, TOKENIZER, prompts, tmp_path / "limited", time_limit=1.5, **settings)
    assert (stats.written, stats.remaining) == (4, 5)
    monkeypatch.setattr(records.ShardWriter, "write", real_write)
    assert regenerate(model, TOKENIZER, prompts, tmp_path / "limited", time_limit=0, **settings).written == 0
    stats = regenerate(model, TOKENIZER, prompts, tmp_path / "limited", **settings)
    assert (stats.already_done, stats.written, stats.remaining) == (4, 5, 0)
    assert shard_contents(tmp_path / "limited") == shard_contents(tmp_path / "whole")


def test_a_finished_run_does_nothing_when_called_again(tmp_path):
    model, prompts = tiny_target(seed=5), random_prompts(3)
    regenerate(model, TOKENIZER, prompts, tmp_path, max_new_tokens=3, progress=False)
    before = shard_contents(tmp_path)
    stats = regenerate(model, TOKENIZER, prompts, tmp_path, max_new_tokens=3, progress=False)
    assert (stats.written, stats.already_done) == (0, 3)
    assert shard_contents(tmp_path) == before


def test_a_folder_made_with_other_settings_is_refused(tmp_path):
    model, prompts = tiny_target(seed=5), random_prompts(2)
    regenerate(model, TOKENIZER, prompts, tmp_path, max_new_tokens=3, progress=False)
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        regenerate(model, TOKENIZER, prompts, tmp_path, max_new_tokens=4, progress=False)


def test_a_folder_in_use_by_another_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "LOCK_WAIT_SECONDS", 0.2)
    with FileLock(str(tmp_path / ".lock")):
        with pytest.raises(ValueError, match="another run is writing"):
            regenerate(tiny_target(), TOKENIZER, random_prompts(1), tmp_path, max_new_tokens=2, progress=False)


def test_a_run_beside_one_that_holds_the_records_briefly_waits_for_it(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(records, "LOCK_WAIT_SECONDS", 10.0)
    held, release = threading.Event(), threading.Event()

    def hold():  # the other run (an A/B's other arm), which lets go a moment later
        with FileLock(str(tmp_path / ".lock")):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    threading.Timer(0.5, release.set).start()
    began = time.monotonic()
    stats = regenerate(tiny_target(), TOKENIZER, random_prompts(1), tmp_path, max_new_tokens=2, progress=False)
    holder.join()
    assert time.monotonic() - began >= 0.4 and stats.written == 1  # it waited, then wrote


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match="cannot write to"):
        regenerate(tiny_target(), TOKENIZER, random_prompts(1), tmp_path / "taken", max_new_tokens=2, progress=False)


def test_a_full_disk_is_reported_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(records.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(ValueError, match="GB free"):
        regenerate(tiny_target(), TOKENIZER, random_prompts(3), tmp_path, max_new_tokens=2, progress=False)
    assert not list(tmp_path.glob("shard-*"))


def test_an_empty_prompt_set_is_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        regenerate(tiny_target(), TOKENIZER, [], tmp_path, max_new_tokens=2, progress=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_labels_are_the_argmax_of_a_plain_forward(tmp_path, arch):
    model, prompts = tiny_target(arch, seed=6), random_prompts(6, with_response=True)
    stats = label_responses(model, TOKENIZER, prompts, tmp_path, top_k=4, batch_size=4, progress=False)
    labelled = {r.id: r for r in read_records(tmp_path)}
    assert stats.written == 6 and read_meta(tmp_path)["stage"] == "labels"
    for prompt in prompts:
        record = labelled[prompt.id]
        prompt_ids = encode_prompt(TOKENIZER, prompt)
        response_ids = TOKENIZER(prompt.response, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        assert record.input_ids == prompt_ids + response_ids and record.response_start == len(prompt_ids)
        with torch.no_grad():
            logits = model(torch.tensor([record.input_ids])).logits[0, record.response_start - 1 : -1]
        assert record.labels == logits.argmax(-1).tolist()
        probs, ids = torch.softmax(logits, -1).topk(4)
        assert record.topk_ids == ids.tolist()
        torch.testing.assert_close(torch.tensor(record.topk_probs), probs, atol=1e-5, rtol=0)


def test_labels_cut_long_responses_and_skip_prompts_without_one(tmp_path):
    prompts = random_prompts(4, with_response=True) + random_prompts(2, seed=1)
    prompts[-2:] = [user_prompt(f"bare{i}", "test", p.text) for i, p in enumerate(prompts[-2:])]
    stats = label_responses(tiny_target(), TOKENIZER, prompts, tmp_path, max_response_tokens=3, progress=False)
    labelled = list(read_records(tmp_path))
    assert sorted(r.id for r in labelled) == ["p0", "p1", "p2", "p3"] and stats.written == 4
    assert all(len(r.labels) == len(r.input_ids) - r.response_start <= 3 for r in labelled)


def test_labels_need_at_least_one_response(tmp_path):
    with pytest.raises(ValueError, match="none of the prompts has a response"):
        label_responses(tiny_target(), TOKENIZER, random_prompts(2), tmp_path, progress=False)


def test_resumed_labelling_writes_the_same_shards(tmp_path, monkeypatch):
    model, prompts = tiny_target(seed=7), random_prompts(7, with_response=True)
    settings = dict(batch_size=2, records_per_shard=4, progress=False)
    label_responses(model, TOKENIZER, prompts, tmp_path / "whole", **settings)
    real_write = records.ShardWriter.write

    def write_then_die_after_four(self, batch_records):
        real_write(self, batch_records)
        if len(self.done_ids) >= 4:
            raise Killed

    monkeypatch.setattr(records.ShardWriter, "write", write_then_die_after_four)
    with pytest.raises(Killed):
        label_responses(model, TOKENIZER, prompts, tmp_path / "resumed", **settings)
    monkeypatch.setattr(records.ShardWriter, "write", real_write)
    stats = label_responses(model, TOKENIZER, prompts, tmp_path / "resumed", **settings)
    assert stats.already_done == 4
    assert shard_contents(tmp_path / "resumed") == shard_contents(tmp_path / "whole")
    meta = json.loads((tmp_path / "resumed" / "meta.json").read_text())
    assert meta["max_response_tokens"] == 256 and meta["batch_size"] == 2  # 256: flashdraft train's default
