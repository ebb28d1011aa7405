"""llama.cpp as a benchmark peer, against fake llama.cpp tools (small scripts printing what the real ones print): the
commands they get, how their output is read, the metrics made of it, the messages when llama.cpp is missing, the
build and the draft export; and one slow test running the real tools on the default target."""

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from flashdraft.bench.llama_cpp import LlamaCppPeer, parse_output
from flashdraft.bench.methods import DecodeSettings, LlamaCpp, build_methods
from flashdraft.bench.metrics import summarize, texts_agree
from flashdraft.bench.report import markdown_table
from flashdraft.bench.runner import Record
from flashdraft.cli import main
from flashdraft.llama_cpp import build_llama_cpp, export_draft_gguf, find_llama_cpp, target_gguf

from tiny import tiny_tokenizer

# What llama-completion prints on stderr (its timings) and llama-speculative-simple after its answer, as their
# format strings write them (spaces inside the parentheses shortened).
COMPLETION_LOG = """\
llama_perf_context_print:        load time =     152.24 ms
llama_perf_context_print: prompt eval time =      50.00 ms /     3 tokens (16.67 ms per token, 60.00 tokens per second)
llama_perf_context_print:        eval time =     200.00 ms /     4 runs   (50.00 ms per token, 20.00 tokens per second)
llama_perf_context_print:       total time =     260.00 ms /     7 tokens
"""
SPECULATIVE_LOG = """\
main: encoded    3 tokens in    0.050 seconds, speed:   60.000 t/s
main: decoded    6 tokens in    0.150 seconds, speed:   40.000 t/s

main: n_draft   = 7
main: n_predict = 6
main: n_drafted = 7
main: n_accept  = 4
main: accept    = 57.143%

llama_perf_context_print:        eval time =     140.00 ms /     2 runs   (70.00 ms per token, 14.29 tokens per second)
"""

FAKE_TOOL = """#!{python}
import json, pathlib, sys
here = pathlib.Path(__file__).parent
tool = pathlib.Path(sys.argv[0]).name
args = sys.argv[1:]
(here / (tool + ".args.json")).write_text(json.dumps(args))
prompt = pathlib.Path(args[args.index("-bf") + 1]).read_text(encoding="utf-8")
answer = (here / "answer.txt").read_text(encoding="utf-8")
if tool == "llama-completion":
    sys.stdout.write(prompt + answer + "<eot> [end of text]\\n" + "\\n\\n")
    sys.stderr.write({completion!r})
else:
    sys.stdout.write("\\n\\n" + prompt + answer + "\\n\\n" + "\\n\\n")
    sys.stderr.write({speculative!r})
"""


def fake_llama_cpp(root: Path, answer: str, tools=("llama-completion", "llama-lookup", "llama-speculative-simple")):
    """A llama.cpp folder whose build/bin tools are `FAKE_TOOL`, all answering `answer`."""
    bin_folder = root / "build" / "bin"
    bin_folder.mkdir(parents=True)
    (bin_folder / "answer.txt").write_text(answer, encoding="utf-8")
    for name in tools:
        path = bin_folder / name
        path.write_text(FAKE_TOOL.format(python=sys.executable, completion=COMPLETION_LOG, speculative=SPECULATIVE_LOG))
        path.chmod(0o755)
    return find_llama_cpp(root)


def test_completion_output_is_read_as_printed():
    output = parse_output("llama-completion", "w1 w2w5 w6\nw7<eot> [end of text]\n\n\n", COMPLETION_LOG, "w1 w2",
                          ("<eot>",))
    assert output.text == "w5 w6\nw7" and output.ended
    assert (output.prompt_tokens, output.prefill_seconds) == (3, 0.05)
    assert (output.decoded_tokens, output.decode_seconds) == (4, 0.2)  # "eval time", not "prompt eval time"
    assert (output.drafted, output.accepted, output.tau) == (0, 0, 1.0)
    # an answer cut by the token budget has no end mark; its own trailing newline stays
    cut = parse_output("llama-completion", "w1w5\n\n\n", COMPLETION_LOG, "w1")
    assert (cut.text, cut.ended) == ("w5\n", False)


def test_speculative_output_drops_the_echoed_prompt_and_the_stop_token():
    prompt = "<user> say \\t <eot> <assistant>"
    stdout = "\n\n" + prompt + "w5 w6<eot>\n\n\n\n"
    output = parse_output("llama-speculative-simple", stdout, SPECULATIVE_LOG, prompt, ("<eot>",))
    assert output.text == "w5 w6" and output.ended
    # llama-speculative-simple prints no stop token: fewer tokens decoded than the budget say the model ended
    unmarked = "\n\n" + prompt + "w5 w6\n\n\n\n"
    assert parse_output("llama-speculative-simple", unmarked, SPECULATIVE_LOG, prompt, (), 8).ended
    assert not parse_output("llama-speculative-simple", unmarked, SPECULATIVE_LOG, prompt, (), 5).ended
    assert (output.prompt_tokens, output.prefill_seconds, output.decoded_tokens, output.decode_seconds) == \
        (3, 0.05, 6, 0.15)
    # 6 tokens, 4 of them accepted proposals: 2 rounds, tau 3
    assert (output.drafted, output.accepted, output.tau) == (7, 4, 3.0)
    with pytest.raises(ValueError, match="did not echo the prompt"):
        parse_output("llama-lookup", "\n\nsomething else w5\n\n\n\n", SPECULATIVE_LOG, prompt)
    with pytest.raises(ValueError, match="printed no 'n_accept' line"):
        parse_output("llama-lookup", stdout, SPECULATIVE_LOG.replace("n_accept", "n_other"), prompt)


def test_missing_llama_cpp_is_one_line_naming_the_build_command(tmp_path, capsys):
    with pytest.raises(ValueError) as missing:
        find_llama_cpp(tmp_path / "none", ("llama-completion",))
    assert "does not exist" in str(missing.value) and "flashdraft llama-cpp build" in str(missing.value)
    fake_llama_cpp(tmp_path / "partial", "w5", tools=("llama-completion",))
    with pytest.raises(ValueError, match=r"llama-lookup is not built in .*partial/build/bin: build it with "
                                         r"`flashdraft llama-cpp build --dir "):
        find_llama_cpp(tmp_path / "partial", ("llama-completion", "llama-lookup"))

    # the benchmark says it before any model loads, in one line, without a traceback
    code = main(["bench", "--methods", "llama.cpp-lookup", "--llama-cpp", str(tmp_path / "partial"),
                 "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1 and "Traceback" not in error
    assert "llama-lookup is not built" in error and "flashdraft llama-cpp build" in error
    assert main(["llama-cpp", "show", "--llama-cpp", str(tmp_path / "partial")]) == 2
    assert "llama-speculative-simple: not built" in capsys.readouterr().out
    assert main(["bench", "--methods", "llama.cpp", "--temperature", "0.7", "--llama-cpp",
                 str(tmp_path / "partial")]) == 2
    assert "greedy only" in capsys.readouterr().err


def test_methods_run_the_tools_on_the_prompt_text_unchanged(tmp_path):
    tokenizer = tiny_tokenizer()
    eot = tokenizer.convert_tokens_to_ids("<eot>")
    llama = fake_llama_cpp(tmp_path / "llama.cpp", "w5 w6 w7 w8")
    peer = LlamaCppPeer(llama, tmp_path / "target.gguf", tmp_path / "draft.gguf", threads=2)
    methods = build_methods(["llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash"], target=None, tokenizer=tokenizer,
                            draft=object(), llama_cpp=peer)
    assert [method.name for method in methods] == ["ar", "llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash"]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "w1 w2 w3"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    input_ids = torch.tensor([prompt_ids])
    settings = DecodeSettings(max_new_tokens=3, temperature=0.0, stop_token_ids=(eot,))
    bin_folder = llama.folder / "build" / "bin"
    for method in methods[1:]:
        tokens = method.generate(input_ids, settings, seed=0)
        assert tokens == tokenizer.encode("w5 w6 w7", add_special_tokens=False)  # cut to the budget
        assert method.text == "w5 w6 w7 w8"  # as printed: compared by prefix (metrics.texts_agree)
        args = json.loads((bin_folder / f"{method.tool}.args.json").read_text())
        assert args[args.index("-m") + 1] == str(tmp_path / "target.gguf")
        assert args[args.index("-n") + 1] == "3" and args[args.index("--temp") + 1] == "0"
        assert args[args.index("-t") + 1] == "2" and "--no-escape" in args
        assert "-f" not in args  # llama.cpp drops the trailing newline of a -f file; -bf reads it as it is
        assert int(args[args.index("-c") + 1]) >= len(prompt_ids) + 3
    completion, lookup, dflash = methods[1:]
    assert {"-no-cnv", "--special"} <= set(json.loads((bin_folder / "llama-completion.args.json").read_text()))
    assert (completion.seconds, completion.first_token_seconds, completion.decode_tokens) == (0.25, 0.05, 4)
    assert (completion.drafted, completion.accepted) == (0, 0)
    lookup_args = json.loads((bin_folder / "llama-lookup.args.json").read_text())
    assert lookup_args[lookup_args.index("--spec-draft-n-max") + 1] == "8"
    dflash_args = json.loads((bin_folder / "llama-speculative-simple.args.json").read_text())
    assert dflash_args[dflash_args.index("-md") + 1] == str(tmp_path / "draft.gguf")
    assert dflash_args[dflash_args.index("--spec-type") + 1] == "draft-dflash"
    assert dflash_args[dflash_args.index("--spec-draft-n-max") + 1] == "7"
    assert (dflash.seconds, dflash.decode_tokens, dflash.drafted, dflash.accepted) == (0.2, 6, 7, 4)

    with pytest.raises(ValueError, match="greedy only"):
        completion.generate(input_ids, DecodeSettings(3, 0.5, (eot,)), seed=0)
    with pytest.raises(ValueError, match="need llama.cpp's tools"):
        build_methods(["llama.cpp"], target=None, tokenizer=tokenizer)


def test_prompt_file_keeps_backslashes_and_special_tokens(tmp_path):
    tokenizer = tiny_tokenizer()
    llama = fake_llama_cpp(tmp_path / "llama.cpp", "w5")
    method = LlamaCpp("llama.cpp-lookup", LlamaCppPeer(llama, tmp_path / "t.gguf", None, 1), tokenizer)
    tokenizer.add_tokens(["a\\tb"])  # a word holding a backslash sequence that llama.cpp would otherwise unescape
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "w1 a\\tb"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    # the fake echoes the prompt it read; reading it back as the answer's prefix proves it arrived unchanged
    assert method.generate(torch.tensor([ids]), DecodeSettings(4, 0.0, ()), seed=0) == \
        tokenizer.encode("w5", add_special_tokens=False)
    args = json.loads((llama.folder / "build" / "bin" / "llama-lookup.args.json").read_text())
    assert "--no-escape" in args and "a\\tb" in tokenizer.decode(ids)


def _record(method, tokens, text, seconds=1.0, sample="h0", ended=False, **counted):
    return Record("humaneval", sample, 0, method, 5, tokens, seconds, 0.2, [] if counted else [1] * len(tokens),
                  {}, text, bool(counted), **counted, ended=ended)


def test_texts_agree_up_to_the_budget_not_past_an_end():
    cut = _record("ar", [1, 2], "w1 w2")
    assert texts_agree(cut, _record("llama.cpp-lookup", [1, 2], "w1 w2 w3", decode_tokens=3, accepted=1))
    assert texts_agree(cut, _record("llama.cpp", [1, 2], "w1 w2", decode_tokens=1, accepted=0))
    ended = _record("ar", [1, 2], "w1 w2", ended=True)
    assert not texts_agree(ended, _record("llama.cpp", [1, 2, 3], "w1 w2 w3", decode_tokens=2, accepted=0))
    assert not texts_agree(cut, _record("llama.cpp", [1, 4], "w1 w4", decode_tokens=1, accepted=0))


def test_metrics_compare_printed_text_and_count_rounds():
    records = [
        _record("ar", [1, 2, 3, 4, 5], "w1 w2 w3 w4 w5"),
        _record("llama.cpp", [1, 2, 3, 4, 5], "w1 w2 w3 w4 w5", decode_tokens=4, drafted=0, accepted=0),
        _record("llama.cpp-lookup", [1, 2, 3, 4, 5], "w1 w2 w3 w4 w5", decode_tokens=8, drafted=7, accepted=6),
        _record("llama.cpp-dflash", [1, 2, 9], "w1 w2 w9", seconds=0.6, decode_tokens=4, drafted=7, accepted=2),
    ]
    by_method = {summary.method: summary for summary in summarize(records, greedy=True)}
    # decode tok/s from the tool's own count: 4 tokens / 0.8 s; tau 1 for plain decoding
    assert by_method["llama.cpp"].decode_tokens_per_second == pytest.approx(5.0)
    assert by_method["llama.cpp"].tau == 1.0
    assert by_method["llama.cpp-lookup"].tau == pytest.approx(8 / 2)  # 8 tokens in 2 rounds
    assert (by_method["llama.cpp-lookup"].drafted, by_method["llama.cpp-lookup"].accepted) == (7, 6)
    assert by_method["llama.cpp-dflash"].tau == pytest.approx(2.0)
    assert by_method["llama.cpp-dflash"].speedup == pytest.approx((4 / 0.4) / (4 / 0.8))
    # compared by text against ar and against llama.cpp's plain decoding
    assert [by_method[m].differs_from_ar for m in ("llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash")] == [0, 0, 1]
    assert by_method["llama.cpp-dflash"].differs_from_llama_cpp == 1
    assert by_method["ar"].differs_from_llama_cpp == 0
    table = markdown_table(list(by_method.values())).splitlines()
    assert table[0].endswith("| differs from ar | differs from llama.cpp |")
    assert table[-1].endswith("| 2.00 | n/a | 1 | 1 |")
    assert "differs from llama.cpp" not in markdown_table(summarize(records[:1], greedy=True))


def test_export_runs_the_converter_with_its_gguf_py(tmp_path):
    sources = tmp_path / "llama.cpp"
    (sources / "gguf-py").mkdir(parents=True)
    (sources / "convert_hf_to_gguf.py").write_text(
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "if 'broken' in args[0]:\n"
        "    sys.exit('ValueError: no DFlash here')\n"
        "out = args[args.index('--outfile') + 1]\n"
        "open(out, 'w').write(json.dumps({'args': args, 'path': os.environ['PYTHONPATH']}))\n"
    )
    for name in ("draft", "target", "broken"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    llama = find_llama_cpp(sources)
    written = export_draft_gguf(tmp_path / "draft", tmp_path / "target", tmp_path / "out" / "d.gguf", llama)
    seen = json.loads(written.read_text())
    assert seen["args"][0] == str(tmp_path / "draft")
    assert seen["args"][seen["args"].index("--target-model-dir") + 1] == str(tmp_path / "target")
    assert seen["args"][seen["args"].index("--outtype") + 1] == "f16"
    assert seen["path"].split(os.pathsep)[0] == str(sources.resolve() / "gguf-py")
    with pytest.raises(ValueError, match="converter failed on .*broken .*no DFlash here"):
        export_draft_gguf(tmp_path / "broken", tmp_path / "target", tmp_path / "b.gguf", llama)
    assert not list(tmp_path.glob("b.gguf*"))
    with pytest.raises(ValueError, match="holds no llama.cpp sources"):
        find_llama_cpp(tmp_path / "draft").converter  # noqa: B018


def test_export_without_sentencepiece_names_the_extra(tmp_path, monkeypatch):
    for name in ("draft", "target"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # what an import of an absent package meets
    with pytest.raises(ValueError, match=r"needs sentencepiece: pip install 'flashdraft\[llama-cpp\]'"):
        export_draft_gguf(tmp_path / "draft", tmp_path / "target", tmp_path / "d.gguf", None)
    assert not (tmp_path / "d.gguf").exists()


def test_export_gguf_command(tmp_path, capsys):
    from bench.tiny_bench import save_tiny_bench_folders

    save_tiny_bench_folders(tmp_path, [])
    sources = tmp_path / "llama.cpp"
    (sources / "gguf-py").mkdir(parents=True)
    (sources / "convert_hf_to_gguf.py").write_text(
        "import sys\nargs = sys.argv[1:]\nopen(args[args.index('--outfile') + 1], 'w').write(' '.join(args))\n")
    out = tmp_path / "draft.gguf"
    assert main(["draft", "export-gguf", str(tmp_path / "draft"), "--target", str(tmp_path / "target"), "-o",
                 str(out), "--outtype", "q8_0", "--llama-cpp", str(sources)]) == 0
    written = out.read_text().split()
    assert written[0] == str(tmp_path / "draft") and written[written.index("--outtype") + 1] == "q8_0"
    assert written[written.index("--target-model-dir") + 1] == str(tmp_path / "target")
    assert f"wrote {out}" in capsys.readouterr().out
    assert main(["draft", "export-gguf", str(tmp_path / "draft"), "-o", str(out), "--llama-cpp",
                 str(tmp_path / "none")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "flashdraft llama-cpp build" in error


def test_build_unpacks_the_sdist_and_builds_only_the_benchmark_tools(tmp_path, monkeypatch):
    # an sdist holding a vendored llama.cpp, and a cmake that records its calls and "builds" the targets named
    vendored = tmp_path / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    (vendored / "gguf-py").mkdir(parents=True)
    (vendored / "convert_hf_to_gguf.py").write_text("")
    (vendored.parent.parent / "setup.py").write_text("")
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(tmp_path / "sdist" / "llama_cpp_python-0.3.36", arcname="llama_cpp_python-0.3.36")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "cmake").write_text(
        f"#!{sys.executable}\nimport json, os, pathlib, sys\nargs = sys.argv[1:]\n"
        f"open({str(tmp_path / 'cmake.log')!r}, 'a').write(json.dumps(args) + '\\n')\n"
        "if '--build' in args:\n"
        "    out = pathlib.Path(args[args.index('--build') + 1]) / 'bin'\n"
        "    out.mkdir(parents=True, exist_ok=True)\n"
        "    for name in args[args.index('--target') + 1:]:\n"
        "        (out / name).write_text(''); (out / name).chmod(0o755)\n"
    )
    (tools / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    llama = build_llama_cpp(tmp_path / "built", jobs=2, sdist=sdist)
    assert (llama.folder / "convert_hf_to_gguf.py").is_file() and not (llama.folder / "setup.py").exists()
    configure, build = [json.loads(line) for line in (tmp_path / "cmake.log").read_text().splitlines()]
    assert "-DGGML_NATIVE=ON" in configure and "-DLLAMA_CURL=OFF" in configure
    assert build[build.index("-j") + 1] == "2"
    assert build[build.index("--target") + 1:] == ["llama-completion", "llama-lookup", "llama-speculative-simple",
                                                   "llama-bench"]
    assert llama.tool("llama-lookup") == llama.folder / "build" / "bin" / "llama-lookup"
    assert json.loads((llama.folder / ".flashdraft-build.json").read_text())["sources"] == str(sdist)
    # a second build reuses the unpacked sources; a folder holding something else is refused
    build_llama_cpp(tmp_path / "built", jobs=1, sdist=tmp_path / "absent.tar.gz")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no llama.cpp sources"):
        build_llama_cpp(tmp_path / "other", sdist=sdist)


def test_split_target_gguf_is_concatenated_once_and_checked(tmp_path, monkeypatch):
    import dataclasses
    import hashlib

    import flashdraft.models as models

    parts = [tmp_path / "part01.bin", tmp_path / "part02.bin"]
    parts[0].write_bytes(b"GGUF" + b"a" * 100)
    parts[1].write_bytes(b"b" * 50)
    whole = parts[0].read_bytes() + parts[1].read_bytes()
    entry = dataclasses.replace(models.REGISTRY["qwen2.5-coder-0.5b-instruct"], name="split-test",
                                gguf_size=len(whole), gguf_sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(models, "registered_model", lambda name: entry)
    monkeypatch.setattr(models, "locate_files", lambda given: parts)
    path = target_gguf("split-test")
    assert path.read_bytes() == whole and path.parent.parent == models.cache_home()
    parts[1].write_bytes(b"c" * 50)  # an assembled file of the right size is not assembled again
    assert target_gguf("split-test").read_bytes() == whole
    path.unlink()
    with pytest.raises(ValueError, match="not the pinned"):
        target_gguf("split-test")
    assert not list(path.parent.glob("split-test*"))


def _llama_cpp_for_tests() -> Path | None:
    """A built llama.cpp: $FLASHDRAFT_LLAMA_CPP, else the user's default folder (the tests' own home is empty)."""
    import platformdirs

    folder = Path(os.environ.get("FLASHDRAFT_LLAMA_CPP") or Path(platformdirs.user_cache_dir("flashdraft")) /
                  "llama.cpp")
    try:
        find_llama_cpp(folder, ("llama-completion", "llama-lookup", "llama-speculative-simple"))
        find_llama_cpp(folder).converter  # noqa: B018
    except ValueError:
        return None
    return folder


@pytest.mark.slow
def test_the_three_llama_cpp_methods_on_the_default_target(tmp_path, smollm2_folder):
    folder = _llama_cpp_for_tests()
    if folder is None:
        pytest.skip("llama.cpp is not built: run `flashdraft llama-cpp build` (or set FLASHDRAFT_LLAMA_CPP)")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "add", "prompt": "Write a Python function that adds two numbers."}) + "\n")
    # the whole command: the draft is converted into the tests' own FLASHDRAFT_HOME, the outputs into tmp_path
    code = main(["bench", "--methods", "llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash", "--datasets", str(prompts),
                 "--max-new-tokens", "16", "--llama-cpp", str(folder), "--output-dir", str(tmp_path / "out")])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["llama_cpp"]["version"].startswith("version:")
    summaries = {summary["method"]: summary for summary in results["summary"]}
    assert set(summaries) == {"ar", "llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash"}
    records = {record["method"]: record for record in results["records"]}
    for name in ("llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash"):
        record = records[name]
        assert record["tokens_from_text"] and record["text"] and 0 < len(record["tokens"]) <= 16
        assert record["decode_tokens"] > 0 and summaries[name]["decode_tokens_per_second"] > 0
        assert summaries[name]["differs_from_ar"] in (0, 1) and summaries[name]["speedup"] is not None
    assert summaries["llama.cpp"]["tau"] == 1.0 and records["llama.cpp"]["accepted"] == 0
    assert records["llama.cpp-dflash"]["drafted"] > 0 and summaries["llama.cpp-dflash"]["tau"] >= 1.0
    # prompt lookup is lossless: llama.cpp's own plain decoding's text (the DFlash one is reported, not required)
    assert summaries["llama.cpp-lookup"]["differs_from_llama_cpp"] == 0
    assert summaries["llama.cpp-dflash"]["differs_from_llama_cpp"] in (0, 1)
