"""`flashdraft generate` on tiny saved models: streamed text equals the target's own greedy answer."""

import pytest
import torch

from flashdraft.cli import main
from flashdraft.commands.generate import statistics_line
from flashdraft.decoding import GenerationResult
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


@pytest.mark.parametrize("extra", [[], ["--block-size", "1"], ["--block-size", "3"], ["--no-chat-template"],
                                   ["--proposals", "dflash"], ["--proposals", "lookup", "--block-size", "6"],
                                   ["--engine", "transformers"], ["--engine", "flashdraft", "--block-size", "3"]])
def test_generate_streams_the_target_greedy_answer(folders, capsys, extra):
    root, target, tokenizer = folders
    code = main(["generate", "w3 w4 w5", "--target", str(root / "target"), "--draft", str(root / "draft"),
                 "--max-new-tokens", "24", *extra])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == expected_text(target, tokenizer, "w3 w4 w5", 24, chat="--no-chat-template" not in extra) + "\n"
    assert err.startswith(f"Loading {root / 'target'} ...\n")  # one line while torch and the models load
    assert "[24 tokens" in err and "tokens/s" in err
    if extra == ["--block-size", "1"]:
        assert "no speculation (block size 1)" in err
    else:  # the tokens each source gave
        assert "24 tokens (target " in err


def test_lookup_runs_without_loading_a_draft(folders, capsys, monkeypatch):
    import flashdraft.models

    root, target, tokenizer = folders
    monkeypatch.setattr(flashdraft.models, "load_draft", lambda *args, **kwargs: pytest.fail("a draft was loaded"))
    assert main(["generate", "w3 w4 w3 w4", "--target", str(root / "target"), "--proposals", "lookup",
                 "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert out == expected_text(target, tokenizer, "w3 w4 w3 w4", 24) + "\n"
    assert "lookup" in err


def test_statistics_line_says_when_speculation_was_off():
    result = GenerationResult(tokens=list(range(40)), acceptance_lengths=[3] + [1] * 30 + [2],
                              block_sizes=[8] + [1] * 30 + [8])
    line = statistics_line(result, speculating=True)
    assert "speculation off in 30 of 32 rounds, where no proposal was expected to pay on this machine" in line
    assert "(tau 2.50 in the 2 rounds that speculated)" in line
    speculated = GenerationResult(tokens=list(range(9)), acceptance_lengths=[3, 5], block_sizes=[8, 8])
    assert "| tau 4.00 |" in statistics_line(speculated, speculating=True)
    plain = GenerationResult(tokens=[1, 2], acceptance_lengths=[1], block_sizes=[1])
    assert "| no speculation (block size 1) |" in statistics_line(plain, speculating=False)
    one = GenerationResult(tokens=[7], stop_reason="length")
    assert statistics_line(one, speculating=True).startswith("[1 token (target 1) | no round after the first token |")


def test_verbose_prints_every_round(folders, capsys):
    root, _, _ = folders
    assert main(["generate", "w3 w4", "--target", str(root / "target"), "--draft", str(root / "draft"),
                 "--block-size", "3", "--max-new-tokens", "10", "--verbose"]) == 0
    err = capsys.readouterr().err
    rounds = err.split("[rounds, block size:tokens yielded: ")[1].split("]")[0].split()
    sizes = [int(r.split(":")[0]) for r in rounds]
    yielded = [int(r.split(":")[1]) for r in rounds]
    assert all(size <= 3 for size in sizes) and 1 <= sum(yielded) + 1 and all(1 <= y <= 3 for y in yielded)


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
        (["generate", "w1", "--target", str(root / "missing"), "--block-size", "1"], "neither an existing folder"),
        (["generate", "w1", "--target", str(root), "--block-size", "1"], "has no config.json"),
        (["generate", "w1", *base[:2], "--draft", str(root / "missing")], "draft '"),
        (["generate", "w1", "--target", str(root / "target"), "--draft", str(root / "target")],
         "is not a DFlash draft"),
        (["generate", "w1", *base, "--device", "nosuch"], "unknown device 'nosuch': devices here are cpu"),
        (["generate", "w1", *base, "--engine", "flashdraft", "--dtype", "bfloat16"],
         "the flashdraft engine cannot run this target: torch.bfloat16 on cpu"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["   "], "argument prompt: the prompt is empty"),
    (["w1\udcff"], "argument prompt: the prompt is not valid UTF-8 text (undecodable bytes from character 2)"),
    (["w1", "--system", "\udce9t\udce9"], "argument --system: the system message is not valid UTF-8 text"),
    (["w1", "--temperature", "nan"], "argument --temperature: 'nan' is not a temperature: give a finite number >= 0"),
    (["w1", "--temperature", "inf"], "argument --temperature: 'inf' is not a temperature"),
    (["w1", "--temperature", "-0.5"], "argument --temperature: '-0.5' is not a temperature"),
    (["w1", "--top-p", "1.5"], "argument --top-p: '1.5' is not a nucleus mass: give a number in (0, 1]"),
    (["w1", "--top-p", "nan"], "argument --top-p: 'nan' is not a nucleus mass"),
    (["w1", "--top-k", "-1"], "argument --top-k: '-1' is not an integer >= 0"),
    (["w1", "--max-new-tokens", "-2"], "argument --max-new-tokens: '-2' is not an integer >= 1"),
    (["w1", "--proposals", "ngram"], "argument --proposals: invalid choice: 'ngram'"),
])
def test_bad_arguments_are_refused_by_the_parser(argv, message, capsys):
    """Undecodable text arrives from the shell as lone surrogates (Python's surrogateescape), as written here."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_asking_for_the_draft_alone_without_one_says_how_to_get_one(folders, capsys):
    root, _, _ = folders
    assert main(["generate", "w1", "--target", str(root / "target"), "--proposals", "dflash"]) == 2
    err = capsys.readouterr().err
    assert "--proposals dflash needs a draft, and none is shipped for" in err and "flashdraft train" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_block_size_below_one_is_refused_by_the_parser(command, capsys):
    argv = [command, "w1"] if command == "generate" else [command]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--block-size", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --block-size: '0' is neither an integer >= 1 (1 = no speculation) nor auto" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_an_unavailable_device_is_one_line(folders, capsys):
    root, _, _ = folders
    assert main(["generate", "w1", "--target", str(root / "target"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("flashdraft generate: error: device 'cuda' is not available here (this torch sees cpu): "
                           "pick one of those")


def test_help_is_there_for_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--target", "--draft", "--temperature", "--top-p", "--top-k", "--max-new-tokens",
                   "--block-size", "--proposals", "--seed"):
        assert option in out


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--block-size", "x", "hi"], "argument --block-size: 'x' is neither an integer"),
    (["generate", "--temperature", "nan", "hi"], "'nan' is not a temperature"),
    (["generate", "--target", "nosuchmodel", "hi"], "target 'nosuchmodel' is neither an existing folder"),
    (["serve", "--target", "nosuchmodel"], "target 'nosuchmodel' is neither an existing folder"),
    (["bench", "--target", "nosuchmodel"], "target 'nosuchmodel' is neither an existing folder"),
    (["generate", "--draft", "no/such/draft", "hi"], "draft 'no/such/draft' is neither an existing folder"),
    (["--version"], "flashdraft 0."),
    (["generate", "--help"], "--max-new-tokens"),
])
def test_help_and_argument_errors_load_neither_torch_nor_transformers(argv, message):
    """`flashdraft --help`, argument errors and unknown models answer at once: the parser is built from light modules
    only, and a command checks its arguments, target and draft before it imports torch."""
    import subprocess
    import sys

    code = ("import sys, flashdraft.cli as cli\n"
            f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert process.stderr.splitlines()[-1] == "[]", process.stderr
    assert message in process.stdout + process.stderr
