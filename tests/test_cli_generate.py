"""`flashdraft generate` on tiny saved models: streamed text equals the target's own greedy answer."""

import pytest

from flashdraft.cli import main
from flashdraft.text import encode_chat
from tiny import greedy_reference, tiny_draft, tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, tokenizer = tiny_target("qwen3", seed=5), tiny_tokenizer()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_draft(target, block_size=4).save_pretrained(root / "draft")
    return root, target, tokenizer


def expected_text(target, tokenizer, prompt, max_new_tokens, chat=True):
    messages = [{"role": "user", "content": prompt}]
    ids = encode_chat(tokenizer, messages, chat_template=chat)
    tokens = greedy_reference(target, ids, max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("extra", [[], ["--block-size", "1"], ["--block-size", "3"], ["--no-chat-template"]])
def test_generate_streams_the_target_greedy_answer(folders, capsys, extra):
    root, target, tokenizer = folders
    code = main(["generate", "w3 w4 w5", "--target", str(root / "target"), "--draft", str(root / "draft"),
                 "--max-new-tokens", "24", *extra])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == expected_text(target, tokenizer, "w3 w4 w5", 24, chat="--no-chat-template" not in extra) + "\n"
    assert "tokens | tau" in err and "tokens/s" in err


def test_sampling_with_a_seed_is_reproducible(folders, capsys):
    root, _, _ = folders
    args = ["generate", "w7 w8", "--target", str(root / "target"), "--draft", str(root / "draft"),
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "16"]
    outputs = []
    for _ in range(2):
        assert main(args) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_bad_input_is_reported_without_a_traceback(folders, capsys):
    root, _, _ = folders
    base = ["--target", str(root / "target"), "--draft", str(root / "draft")]
    cases = [
        (["generate", "   ", *base], "the prompt is empty"),
        (["generate", "w1", *base, "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["generate", "w1", *base, "--max-new-tokens", "-2"], "max_new_tokens must be an integer >= 0"),
        (["generate", "w1", "--target", str(root / "missing"), "--block-size", "1"], "neither an existing folder"),
        (["generate", "w1", "--target", str(root / "target"), "--draft", str(root / "target")], "is not a DFlash draft"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_help_is_there_for_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--target", "--draft", "--temperature", "--top-p", "--top-k", "--max-new-tokens",
                   "--block-size", "--seed"):
        assert option in out
