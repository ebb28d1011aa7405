"""Incremental detokenisation and stop strings (`flashdraft.text.IncrementalText`), exactly."""

import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flashdraft.text import INCOMPLETE, IncrementalText

from tiny import tiny_tokenizer

MULTIBYTE = "héllo 🙂 wörld 日本"


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ASCII only, so every non-ASCII character is split over several tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    backend.train_from_iterator(["hello world the stop end"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def feed(text: IncrementalText, rounds: list[list[int]]) -> tuple[list[str], bool]:
    deltas, stopped = [], False
    for tokens in rounds:
        delta, stopped = text.add(tokens)
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(text.finish())
    return deltas, stopped


def test_multibyte_characters_are_never_split(byte_tokenizer):
    ids = byte_tokenizer(MULTIBYTE)["input_ids"]
    assert len(ids) > len(MULTIBYTE)  # some characters really span several tokens
    deltas, stopped = feed(IncrementalText(byte_tokenizer), [[token] for token in ids])
    assert not stopped
    assert "".join(deltas) == MULTIBYTE
    assert not any(INCOMPLETE in delta for delta in deltas)
    # The emoji's four byte tokens arrive one at a time but leave as one piece.
    assert "🙂" in deltas


def test_rounds_of_several_tokens_give_the_same_text(byte_tokenizer):
    ids = byte_tokenizer(MULTIBYTE)["input_ids"]
    rounds = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    deltas, _ = feed(IncrementalText(byte_tokenizer), rounds)
    assert "".join(deltas) == MULTIBYTE


def test_special_tokens_are_not_shown(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    deltas, _ = feed(IncrementalText(byte_tokenizer), [byte_tokenizer("hello")["input_ids"] + [eos]])
    assert "".join(deltas) == "hello"


def test_stop_string_ends_the_text_before_it(byte_tokenizer):
    ids = byte_tokenizer("hello world the end")["input_ids"]
    deltas, stopped = feed(IncrementalText(byte_tokenizer, ["the"]), [[token] for token in ids])
    assert stopped
    assert "".join(deltas) == "hello world "


def test_text_that_may_start_a_stop_string_is_held_back(byte_tokenizer):
    text = IncrementalText(byte_tokenizer, ["world peace"])
    delta, stopped = text.add(byte_tokenizer("hello world")["input_ids"])
    assert (delta, stopped) == ("hello ", False)  # "world" could still become "world peace"
    delta, stopped = text.add(byte_tokenizer(" the")["input_ids"])
    assert (delta, stopped) == ("world the", False)  # it did not: released
    assert text.finish() == ""


def test_held_back_tail_is_released_when_generation_ends(byte_tokenizer):
    text = IncrementalText(byte_tokenizer, ["hello world"])
    delta, _ = text.add(byte_tokenizer("the hello")["input_ids"])
    assert delta == "the "
    assert text.finish() == "hello"


def test_earliest_of_several_stop_strings_wins(byte_tokenizer):
    ids = byte_tokenizer("hello stop world end")["input_ids"]
    deltas, stopped = feed(IncrementalText(byte_tokenizer, ["end", "world", "stop"]), [ids])
    assert stopped
    assert "".join(deltas) == "hello "


def test_stop_string_spanning_rounds(byte_tokenizer):
    rounds = [byte_tokenizer(piece)["input_ids"] for piece in ("hello wo", "rld", " the")]
    deltas, stopped = feed(IncrementalText(byte_tokenizer, ["world"]), rounds)
    assert stopped
    assert "".join(deltas) == "hello "


def test_word_level_tokenizer_joins_words_with_spaces():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("w1 w2 w3")["input_ids"]
    deltas, stopped = feed(IncrementalText(tokenizer, ["w3"]), [[token] for token in ids])
    assert stopped
    assert "".join(deltas) == "w1 w2 "


def test_text_module_needs_no_server_packages():
    # `flashdraft generate` uses IncrementalText and must work without the serve extra.
    code = ("import sys; sys.modules.update(fastapi=None, starlette=None, uvicorn=None); "
            "import flashdraft.text, flashdraft.commands.generate, flashdraft.cli; flashdraft.cli.build_parser()")
    subprocess.run([sys.executable, "-c", code], check=True)
