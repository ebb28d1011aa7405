"""`flashdraft train` end to end on a tiny target folder: every stage, caching and resume, the output folder and
model card, the exact command, help text on every option, and clear errors for bad input. The command is
`run_pipeline` on a `PipelineConfig`: the same settings in Python train the same bytes."""

import argparse
import json
import re
import shlex
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch

from flashdraft.cli import build_parser, main
from flashdraft.commands.train import config_from_args
from flashdraft.draft import DFlashDraftModel, check_draft_folder
from flashdraft.train import PipelineConfig, run_pipeline
from flashdraft.train.config import default_of, exact_command, flag, format_setting
from flashdraft.train.records import read_records
from train.tiny_training import one_thread  # noqa: F401

from tiny import tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    model = tiny_target("llama", seed=0)
    model.generation_config.eos_token_id = 2  # <eot>
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def prompt_file(path, count=14, with_response=False):
    lines = []
    for i in range(count):
        record = {"id": f"p{i}", "prompt": " ".join(f"w{(i * 7 + j) % 90}" for j in range(3 + i % 5))}
        if with_response:
            record["response"] = " ".join(f"w{(i * 3 + j) % 90}" for j in range(6 + i % 4))
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def train_args(target_folder, tmp_path, *extra):
    return [
        "train", "--target", str(target_folder), "-o", str(tmp_path / "draft"), "--work-dir", str(tmp_path / "work"),
        "--prompts", str(tmp_path / "prompts.jsonl"), "--skip-eval-check", "--feature-layers", "0,2",
        "--draft-layers", "1", "--block-size", "4", "--max-new-tokens", "10", "--max-steps", "4", "--num-anchors", "4",
        "--grad-accum", "1", "--batch-size", "2", "--heldout", "2", "--eval-every", "2", "--eval-prompts", "2",
        "--eval-max-new-tokens", "6", "--checkpoint-every", "2", "--device", "cpu", *extra,
    ]


def test_trains_a_draft_end_to_end_and_resumes_cached(target_folder, tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl")
    args = train_args(target_folder, tmp_path, "--draft-vocab-size", "0")
    assert main(args) == 0
    output = tmp_path / "draft"
    check_draft_folder(output)
    draft = DFlashDraftModel.from_pretrained(output)
    assert (draft.block_size, draft.target_layer_ids, draft.mask_token_id) == (4, [0, 2], 1)  # <mask> is id 1
    assert draft.draft_vocab_ids is None
    readme = (output / "README.md").read_text()
    assert "flashdraft train --target" in readme and "--max-steps 4" in readme
    assert "file: 12 sequences" in readme  # 14 prompts, 2 held out
    assert "heldout: tau" in readme
    training = json.loads((output / "training.json").read_text())
    assert training["summary"]["steps"] == 4
    assert [e["step"] for e in training["summary"]["evaluations"]] == [2, 4]
    work = tmp_path / "work"
    assert len(list((work / "records-regenerate").glob("shard-*.jsonl"))) == 1
    assert len(list(work.glob("features-*"))) == 1
    first = (output / "model.safetensors").read_bytes()

    # Run again: every stage is found done, the run is complete, the same draft is written.
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "0 new records, 14 already done" in err
    assert (output / "model.safetensors").read_bytes() == first


def test_teacher_forced_and_regenerated_with_distillation_and_reduced_vocabulary(target_folder, tmp_path):
    prompt_file(tmp_path / "prompts.jsonl", with_response=True)
    args = train_args(target_folder, tmp_path, "--labels", "both", "--store-top-k", "4", "--distill-weight", "0.5",
                      "--draft-vocab-size", "32", "--features", "online")
    assert main(args) == 0
    draft = DFlashDraftModel.from_pretrained(tmp_path / "draft")
    assert draft.draft_vocab_ids.numel() == 32
    readme = (tmp_path / "draft" / "README.md").read_text()
    assert "32 most frequent" in readme and "teacher forcing" in readme
    work = tmp_path / "work"
    assert (work / "records-teacher-forced").is_dir() and (work / "records-regenerate").is_dir()
    assert not list(work.glob("features-*"))  # online: nothing stored


def test_the_drafting_vocabulary_can_come_from_a_corpus(target_folder, tmp_path):
    from flashdraft.train.corpus import export_records
    from flashdraft.train.records import ShardWriter, TrainingRecord

    # A corpus whose answers use tokens 50-57 only: the run's own labels would choose others.
    answers = [TrainingRecord(id=f"c{i}", source="math", input_ids=[5, 6] + [50 + (i + j) % 8 for j in range(12)],
                              response_start=2) for i in range(6)]
    settings = {"stage": "regenerate", "vocab_size": 96}
    with ShardWriter(tmp_path / "records", settings) as writer:
        writer.write(answers)
    export_records(tmp_path / "records", tmp_path / "corpus", target="tiny", command="cmd")
    prompt_file(tmp_path / "prompts.jsonl")
    args = train_args(target_folder, tmp_path, "--draft-vocab-size", "8", "--features", "online",
                      "--draft-vocab-corpus", str(tmp_path / "corpus"))
    assert main(args) == 0
    draft = DFlashDraftModel.from_pretrained(tmp_path / "draft")
    assert draft.draft_vocab_ids.tolist() == list(range(50, 58))
    assert f"--draft-vocab-corpus {tmp_path / 'corpus'}" in (tmp_path / "draft" / "README.md").read_text()
    # The corpus grows (now tokens 60-67 lead): the run resumes with the vocabulary it chose, not a new one.
    more = [TrainingRecord(id=f"d{i}", source="math", input_ids=[5, 6] + [60 + (i + j) % 8 for j in range(30)],
                           response_start=2) for i in range(12)]
    with ShardWriter(tmp_path / "more", settings) as writer:
        writer.write(more)
    export_records(tmp_path / "more", tmp_path / "corpus", target="tiny", command="cmd")
    assert main(args) == 0
    assert DFlashDraftModel.from_pretrained(tmp_path / "draft").draft_vocab_ids.tolist() == list(range(50, 58))

    with pytest.raises(ValueError, match="holds no corpus"):
        config_from_args(build_parser().parse_args(train_args(target_folder, tmp_path, "--draft-vocab-corpus",
                                                               str(tmp_path / "records"))))


def test_until_stops_after_a_stage(target_folder, tmp_path):
    prompt_file(tmp_path / "prompts.jsonl")
    assert main(train_args(target_folder, tmp_path, "--until", "labels")) == 0
    work = tmp_path / "work"
    assert (work / "prompts.jsonl").is_file() and (work / "records-regenerate").is_dir()
    assert not list(work.glob("features-*")) and not (work / "runs").exists()
    assert not (tmp_path / "draft" / "config.json").exists()


def test_label_minutes_zero_trains_on_the_records_so_far(target_folder, tmp_path, capsys, monkeypatch):
    import importlib

    regenerate_module = importlib.import_module("flashdraft.train.regenerate")  # the package exports a function too
    prompt_file(tmp_path / "prompts.jsonl")
    assert main(train_args(target_folder, tmp_path, "--label-minutes", "0")) == 2  # nothing labelled yet
    assert "holds no training records" in capsys.readouterr().err
    # Labelling is interrupted (Ctrl-C) after its first batch of 8 prompts (a group of one batch).
    monkeypatch.setattr(regenerate_module, "GROUP_BATCHES", 1)
    decode_continuously, batches = regenerate_module.decode_continuously, []

    def interrupted_after_one_batch(*args, **kwargs):
        if batches:
            raise KeyboardInterrupt
        batches.append(1)
        return decode_continuously(*args, **kwargs)

    monkeypatch.setattr(regenerate_module, "decode_continuously", interrupted_after_one_batch)
    assert main(train_args(target_folder, tmp_path, "--until", "labels", "--data-batch-size", "8")) == 130
    monkeypatch.undo()
    assert main(train_args(target_folder, tmp_path, "--label-minutes", "0", "--data-batch-size", "8")) == 0
    assert "training on the records as they are" in capsys.readouterr().err
    assert len(list(read_records(tmp_path / "work" / "records-regenerate"))) == 8
    # Records made with other label settings (a corpus's answer length) are trained on when nothing is labelled...
    other = ("--label-minutes", "0", "--data-batch-size", "8", "--max-new-tokens", "12", "--run-name", "other",
             "-o", str(tmp_path / "other-draft"))
    assert main(train_args(target_folder, tmp_path, *other)) == 0
    assert (tmp_path / "other-draft" / "config.json").is_file()
    assert len(list(read_records(tmp_path / "work" / "records-regenerate"))) == 8
    # ... and refused when the run would add records to them.
    assert main(train_args(target_folder, tmp_path, *other[4:])) == 2
    assert "holds records made with other settings (differences: max_new_tokens" in capsys.readouterr().err


def run_failing(args, capsys):
    assert main(args) == 2
    return capsys.readouterr().err


def test_bad_input_is_reported_before_any_work(target_folder, tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text("")
    assert "prompt set is empty" in run_failing(train_args(target_folder, tmp_path), capsys)
    prompt_file(tmp_path / "prompts.jsonl")
    err = run_failing(train_args(target_folder, tmp_path, "--feature-layers", "1,7"), capsys)
    assert "feature layers [7] do not exist: the target has 4 layers" in err
    err = run_failing(train_args(target_folder, tmp_path, "--feature-layers", "5"), capsys)
    assert "repeat a layer" in err  # 5 layers cannot spread over a 4-layer target
    err = run_failing(train_args(target_folder, tmp_path, "--distill-weight", "1"), capsys)
    assert "add --store-top-k K" in err
    err = run_failing(train_args(target_folder, tmp_path, "--mask-token-id", "500"), capsys)
    assert "outside the target's vocabulary" in err
    err = run_failing(train_args(target_folder, tmp_path, "--label-minutes", "-1"), capsys)
    assert "--label-minutes must be at least 0, got -1" in err
    (tmp_path / "blocker").write_text("a file where a folder should be")
    err = run_failing(train_args(target_folder, tmp_path) + ["-o", str(tmp_path / "blocker" / "draft")], capsys)
    assert "cannot write the draft" in err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    err = run_failing(train_args(target_folder, tmp_path) + ["-o", str(tmp_path / "taken")], capsys)
    assert "not a draft folder" in err
    err = run_failing(train_args(target_folder, tmp_path, "--eval-sets", "heldout,mt-bench2"), capsys)
    assert "unknown dataset 'mt-bench2'" in err
    assert not (tmp_path / "work" / "records-regenerate").exists()  # none of these started the data stages


def test_a_prompt_file_overlapping_an_evaluation_set_is_refused(target_folder, tmp_path, capsys):
    from flashdraft.train.decontaminate import load_eval_sets

    [gsm8k] = load_eval_sets(names=("gsm8k",))
    question = gsm8k.items[0][1]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Please solve: " + question}) + "\n")
    args = [a for a in train_args(target_folder, tmp_path) if a != "--skip-eval-check"]
    err = run_failing(args, capsys)
    assert "overlaps evaluation data" in err and "gsm8k" in err


def train_parser():
    parser = build_parser()
    return parser, next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]


def test_every_option_has_help_and_the_exact_command_reproduces_the_config(tmp_path):
    parser, train = train_parser()
    for action in train._actions:
        assert action.help, action.dest
    args = parser.parse_args(["train", "-o", str(tmp_path / "d"), "--prompts", str(tmp_path / "a.jsonl"),
                              "--init-from-target", "--skip-eval-check", "--lr", "0.001", "--feature-layers", "3,",
                              "--sources", "math", "--proportions", "math=2", "--eval-sets", "heldout,gsm8k"])
    config = config_from_args(args)
    assert (config.feature_layers, config.sources, config.proportions) == ((3,), ("math",), {"math": 2.0})
    command = exact_command(config)
    assert command.startswith("flashdraft train ") and "--init-from-target" in command
    assert config_from_args(parser.parse_args(shlex.split(command)[1:])) == config


def test_a_switch_takes_both_spellings_whatever_its_default(tmp_path):
    """Commands written under another default keep running: `--no-init-from-target` (the default since the init
    A/B) and `--init-from-target` both parse."""
    parser, _ = train_parser()
    base = ["train", "-o", str(tmp_path / "d")]
    assert config_from_args(parser.parse_args(base)).init_from_target is False
    assert config_from_args(parser.parse_args([*base, "--init-from-target"])).init_from_target is True
    assert config_from_args(parser.parse_args([*base, "--no-init-from-target"])).init_from_target is False
    assert config_from_args(parser.parse_args([*base, "--no-skip-eval-check"])).skip_eval_check is False


def test_the_command_line_defaults_are_the_configs_and_the_trainers(tmp_path):
    """One place for every default: the options', TrainConfig's and the data stages' all come from PipelineConfig."""
    import inspect

    from flashdraft.train.labels import label_responses
    from flashdraft.train.loss import DEFAULT_CHUNK
    from flashdraft.train.regenerate import regenerate  # (the package's `regenerate` may be the module by now)
    from flashdraft.train.trainer import TrainConfig

    parser, train = train_parser()
    args = parser.parse_args(["train", "-o", str(tmp_path / "d")])
    defaults = PipelineConfig(output=tmp_path / "d")
    assert config_from_args(args) == defaults
    options = {action.dest: action for action in train._actions}
    for item in fields(PipelineConfig):  # the help shows the default the option has
        if item.metadata["shown"] is None and default_of(item) not in (None, MISSING):
            assert f"(default: {format_setting(default_of(item))})" in options[item.name].help, item.name
    assert defaults.train_config() == TrainConfig()
    assert (TrainConfig().grad_accum, TrainConfig().eval_every, TrainConfig().eval_max_new_tokens) == (4, 500, 128)
    assert defaults.loss_chunk == DEFAULT_CHUNK
    for function, length in ((regenerate, "max_new_tokens"), (label_responses, "max_response_tokens")):
        parameters = inspect.signature(function).parameters
        assert parameters[length].default == defaults.max_new_tokens == 256
        assert parameters["top_k"].default == defaults.store_top_k
        assert parameters["batch_size"].default == defaults.data_batch_size


def test_a_config_parses_the_command_line_text_forms_and_refuses_bad_settings_when_made(tmp_path):
    config = PipelineConfig(output=str(tmp_path / "d"), prompts=str(tmp_path / "a.jsonl"), feature_layers="4",
                            sources="none", proportions={"math": 1}, eval_sets="heldout, gsm8k")
    assert config.prompts == (tmp_path / "a.jsonl",) and config.output == tmp_path / "d"
    assert (config.feature_layers, config.sources, config.proportions) == (4, (), {"math": 1.0})
    assert config.eval_sets == ("heldout", "gsm8k")
    bad = {"labels": ("made-up", "--labels must be one of regenerate, teacher-forced, both"),
           "feature_layers": ("1,x", "--feature-layers takes a count or a comma list"),
           "proportions": ("math", "--proportions takes name=weight pairs"),
           "sources": ("math,poetry", "unknown prompt sources ['poetry']"),
           "distill_weight": (0.5, "add --store-top-k K"),
           "grad_accum": (0, "--grad-accum must be at least 1, got 0"),
           "gamma": (0.0, "--gamma must be above 0, got 0.0"),
           "eval_sets": ("heldout,made-up", "unknown dataset 'made-up'")}
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            PipelineConfig(output=tmp_path / "d", **{name: value})


def test_the_old_top_k_spelling_names_the_new_option(tmp_path, capsys):
    for spelling in (["--top-k", "4"], ["--top-k=4"], ["--top-k"]):
        with pytest.raises(SystemExit) as exit:
            main(["train", "-o", str(tmp_path / "d"), *spelling])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--top-k is now --store-top-k" in err, err


def test_the_pipeline_in_python_trains_the_same_bytes_as_the_command(target_folder, tmp_path):
    prompt_file(tmp_path / "prompts.jsonl", with_response=True)
    args = train_args(target_folder, tmp_path, "--labels", "both", "--store-top-k", "4", "--distill-weight", "0.5",
                      "--draft-vocab-size", "32", "--eval-every", "0", "--seed", "3")
    assert main(args) == 0
    by_command = (tmp_path / "draft" / "model.safetensors").read_bytes()
    card_command = json.loads((tmp_path / "draft" / "training.json").read_text())["command"]
    config = config_from_args(build_parser().parse_args(args))
    assert config_from_args(build_parser().parse_args(shlex.split(card_command)[1:])) == config

    torch.manual_seed(5)  # whatever the process drew before, the seed decides
    config = PipelineConfig(
        target=str(target_folder), output=tmp_path / "py-draft", work_dir=tmp_path / "py-work",
        prompts=[tmp_path / "prompts.jsonl"], skip_eval_check=True, feature_layers=[0, 2], draft_layers=1,
        block_size=4, max_new_tokens=10, max_steps=4, num_anchors=4, grad_accum=1, batch_size=2, heldout=2,
        eval_every=0, eval_prompts=2, eval_max_new_tokens=6, checkpoint_every=2, device="cpu", labels="both",
        store_top_k=4, distill_weight=0.5, draft_vocab_size=32, seed=3,
    )
    summary = run_pipeline(config)
    assert summary.steps == 4
    assert (tmp_path / "py-draft" / "model.safetensors").read_bytes() == by_command
    assert run_pipeline(PipelineConfig(**{**vars(config), "until": "labels"})) is None  # cached: nothing to do


def readme_training_section() -> str:
    """The training guide's section on `flashdraft train` (once the README's)."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    return guide[guide.index("## Training a draft: `flashdraft train`"):guide.index("## The shipped draft")]


def test_the_readme_python_example_is_the_readme_try_it_first_command(monkeypatch, tmp_path):
    import flashdraft.train

    section = readme_training_section()
    example = re.search(r"```python\n(from flashdraft.train import PipelineConfig, run_pipeline\n.*?)```", section,
                        re.S).group(1)
    called = []
    monkeypatch.setattr(flashdraft.train, "run_pipeline", called.append)
    exec(example, {})
    command = re.search(r"^(flashdraft train -o tiny-draft .*?)$\n(?!\s)", section, re.S | re.M).group(1)
    args = build_parser().parse_args(shlex.split(command.replace("\\\n", " "))[1:])
    assert called == [config_from_args(args)]


def test_trained_draft_decodes_losslessly(target_folder, tmp_path):
    import flashdraft
    from flashdraft.models import load_draft, load_target

    from tiny import greedy_reference

    prompt_file(tmp_path / "prompts.jsonl")
    assert main(train_args(target_folder, tmp_path, "--draft-vocab-size", "32", "--eval-sets", "heldout")) == 0
    model, _ = load_target(str(target_folder))
    draft = load_draft(str(tmp_path / "draft"))
    prompt = [5, 9, 11, 30]
    result = flashdraft.generate(model, draft, prompt, max_new_tokens=20)
    assert result.tokens == greedy_reference(model, prompt, 20)
    assert torch.is_tensor(draft.draft_vocab_ids)


def test_init_draft_starts_from_an_earlier_draft_and_must_match_it_but_for_the_block_size(
        target_folder, tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl")
    assert main(train_args(target_folder, tmp_path, "--draft-vocab-size", "0")) == 0
    first = DFlashDraftModel.from_pretrained(tmp_path / "draft")
    later = train_args(target_folder, tmp_path, "--draft-vocab-size", "0", "--run-name", "more", "--lr", "1e-12",
                       "--eval-every", "0", "--init-draft", str(tmp_path / "draft")) + ["-o", str(tmp_path / "d2")]
    assert main(later) == 0
    second = DFlashDraftModel.from_pretrained(tmp_path / "d2")
    # The continued draft carries the run it started from, and says so in its model card.
    before = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert "runs" not in before
    runs = json.loads((tmp_path / "d2" / "training.json").read_text())["runs"]
    assert runs == [{"what": "the draft continued from (draft)", "command": before["command"],
                     "summary": before["summary"], "settings": before["settings"], "data": before["data"]}]
    assert "## Earlier runs" in (tmp_path / "d2" / "README.md").read_text()
    for name, tensor in first.state_dict().items():
        assert torch.allclose(second.state_dict()[name], tensor, atol=1e-6), name
    err = run_failing(later + ["--feature-layers", "0,1", "--run-name", "mismatch"], capsys)
    assert "--init-draft" in err and "(1, [0, 2], 1)" in err and "(1, [0, 1], 1)" in err
    # More layers grow the draft: the earlier one's layer first, the added one silent at the start.
    assert main(later[:-1] + [str(tmp_path / "d3"), "--run-name", "grown", "--draft-layers", "2"]) == 0
    grown = DFlashDraftModel.from_pretrained(tmp_path / "d3")
    assert grown.config.num_hidden_layers == 2
    for name, tensor in first.state_dict().items():
        assert torch.allclose(grown.state_dict()[name], tensor, atol=1e-6), name
    assert grown.layers[1].mlp.down_proj.weight.abs().max() < 1e-6  # lr 1e-12: still as it started
    fewer = train_args(target_folder, tmp_path, "--draft-vocab-size", "0", "--run-name", "fewer", "--draft-layers",
                       "1", "--init-draft", str(tmp_path / "d3"))
    err = run_failing(fewer + ["-o", str(tmp_path / "x")], capsys)
    assert "--draft-layers at least the earlier draft's" in err
    # Another block size takes the same weights; the new draft decodes with the new size.
    assert main(later[:-1] + [str(tmp_path / "d8"), "--run-name", "block8", "--block-size", "8"]) == 0
    third = DFlashDraftModel.from_pretrained(tmp_path / "d8")
    assert (third.block_size, first.block_size) == (8, 4)
    for name, tensor in first.state_dict().items():
        assert torch.allclose(third.state_dict()[name], tensor, atol=1e-6), name


def files_of(folder):
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_run_with_other_prompts_in_the_same_work_folder_changes_nothing_and_the_first_resumes(
        target_folder, tmp_path, capsys, monkeypatch):
    from flashdraft.train.records import exclusive
    from flashdraft.train.trainer import Trainer

    prompt_file(tmp_path / "prompts.jsonl")
    first = train_args(target_folder, tmp_path, "--draft-vocab-size", "0")
    train_step = Trainer.train_step

    def interrupted_at_step_3(self):
        if self.step == 2:
            raise KeyboardInterrupt  # after the checkpoint of step 2
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_step_3)
    assert main(first) == 130
    monkeypatch.undo()
    work = tmp_path / "work"
    before = files_of(work)
    assert "runs/default/checkpoints/step-00000002.pt" in before

    # Another prompt set, with the same ids: refused before anything is written, under any run name.
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"other w{i} w{i + 1}"}) + "\n"
                                                  for i in range(10)))
    other = [str(tmp_path / "other.jsonl") if a == str(tmp_path / "prompts.jsonl") else a for a in first]
    for extra in ([], ["--run-name", "other", "-o", str(tmp_path / "other-draft")]):
        err = run_failing(other + extra, capsys)
        assert f"the work folder {work} holds the data of other prompt settings (differences: files" in err
        assert "give this run its own --work-dir" in err
    # A run already training there (its lock held) refuses a second one with the same run name.
    with exclusive(work / "runs" / "default" / ".lock", "held by the test"):
        assert "another run is training in" in run_failing(first, capsys)
    assert files_of(work) == before
    assert not (tmp_path / "other-draft").exists()

    assert main(first) == 0  # the first run resumes from its checkpoint and finishes
    captured = capsys.readouterr()
    assert "0 new records, 14 already done" in captured.err
    assert "resuming" in captured.out and "from step 2 of 4" in captured.out
    assert json.loads((tmp_path / "draft" / "training.json").read_text())["summary"]["steps"] == 4

    # With its own work folder, the other prompt set trains.
    assert main(other + ["--work-dir", str(tmp_path / "other-work"), "-o", str(tmp_path / "other-draft")]) == 0


def test_the_same_command_trains_the_same_draft(target_folder, tmp_path):
    prompt_file(tmp_path / "prompts.jsonl")
    drafts = []
    for name in ("a", "b"):
        args = train_args(target_folder, tmp_path, "--draft-vocab-size", "0", "--max-steps", "2", "--eval-every", "0",
                          "--work-dir", str(tmp_path / f"work-{name}"), "-o", str(tmp_path / f"draft-{name}"))
        torch.manual_seed(len(drafts))  # whatever the process drew before, --seed decides
        assert main(args) == 0
        drafts.append((tmp_path / f"draft-{name}" / "model.safetensors").read_bytes())
    assert drafts[0] == drafts[1]


def test_train_seed_replicates_a_run_in_the_same_work_folder_on_the_same_data(target_folder, tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl")
    base = train_args(target_folder, tmp_path, "--draft-vocab-size", "0", "--max-steps", "2", "--eval-every", "0")
    assert main(base) == 0
    default = (tmp_path / "draft" / "model.safetensors").read_bytes()
    work = tmp_path / "work"
    stores = sorted(work.glob("features-*"))
    drafts = {}
    for seed in ("0", "1"):
        capsys.readouterr()
        out = tmp_path / f"draft-s{seed}"
        # --seed 1 would be refused here (another prompt mix); --train-seed 1 is not: only the training changes.
        assert main(base + ["--train-seed", seed, "--run-name", f"s{seed}", "-o", str(out)]) == 0
        assert "0 new records, 14 already done" in capsys.readouterr().err
        assert f"--train-seed {seed}" in (out / "README.md").read_text()
        drafts[seed] = (out / "model.safetensors").read_bytes()
    assert sorted(work.glob("features-*")) == stores  # the same sequences, held-out split and features
    assert drafts["0"] == default
    assert drafts["1"] != default


def test_a_command_is_refused_while_another_writes_the_same_data(target_folder, tmp_path, capsys, monkeypatch):
    from flashdraft.train import records
    from flashdraft.train.records import exclusive

    monkeypatch.setattr(records, "LOCK_WAIT_SECONDS", 0.2)  # the wait for a lock held only briefly

    prompt_file(tmp_path / "prompts.jsonl")
    work = tmp_path / "work"
    with exclusive(work / ".prompts.lock", "held by the test"):
        err = run_failing(train_args(target_folder, tmp_path, "--until", "prompts"), capsys)
    assert f"another run is preparing the prompts in {work}: wait for it to finish" in err
    assert not (work / "prompts.jsonl").exists()
    assert main(train_args(target_folder, tmp_path, "--until", "prompts")) == 0
    with exclusive(work / "records-regenerate" / ".lock", "held by the test"):
        before = files_of(work)
        err = run_failing(train_args(target_folder, tmp_path, "--until", "labels"), capsys)
    assert "another run is writing to" in err
    assert files_of(work) == before


def test_a_run_folder_resumes_only_with_the_settings_it_was_trained_with(target_folder, tmp_path, capsys):
    """The same command with another learning rate (and more) into the same run folder is refused, naming every
    difference and the ways out, rather than resuming the finished run and labelling it with the new settings."""
    prompt_file(tmp_path / "prompts.jsonl")
    base = train_args(target_folder, tmp_path, "--draft-vocab-size", "0", "--max-steps", "2", "--eval-every", "0",
                      "--lr", "0.0006")
    assert main(base) == 0
    output = tmp_path / "draft"
    before = files_of(output)
    run_dir = tmp_path / "work" / "runs" / "default"
    assert json.loads((run_dir / "run.json").read_text())["settings"]["--lr"] == "0.0006"

    capsys.readouterr()
    err = run_failing(base + ["--lr", "0.01", "--draft-layers", "2", "--max-steps", "3"], capsys)
    assert f"the run folder {run_dir} holds a run with other settings" in err
    for difference in ("--lr 0.0006 there, 0.01 now", "--draft-layers 1 there, 2 now", "--max-steps 2 there, 3 now"):
        assert difference in err
    assert "--run-name" in err and str(run_dir / "run.json") in err
    assert err.count("\n") == 1  # one line, no traceback
    assert files_of(output) == before  # nothing relabelled

    # A checkpoint without run.json (an earlier flashdraft): the trainer's own check names the draft's shape.
    (run_dir / "run.json").unlink()
    err = run_failing(base + ["--draft-layers", "2"], capsys)
    assert "holds a run with other settings (differences: draft)" in err and '"layers": 1' in err
    assert "Traceback" not in err and "unexpected" not in err.lower()

    assert main(base) == 0  # the same settings resume the run: the same draft
    assert files_of(output)["model.safetensors"] == before["model.safetensors"]
    other = tmp_path / "other-draft"  # the other settings, as a run of their own
    assert main(base + ["--lr", "0.01", "--run-name", "lr-0.01", "-o", str(other)]) == 0
    assert (other / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert "--lr 0.01" in json.loads((other / "training.json").read_text())["command"]


def test_every_ranged_number_is_refused_below_its_range_when_the_config_is_made(tmp_path):
    ranged = [item for item in fields(PipelineConfig) if {"at_least", "above"} & set(item.metadata)]
    assert {"threads", "max_new_tokens", "heldout", "gamma", "draft_vocab_size", "seed"} <= {i.name for i in ranged}
    for item in ranged:
        bound = item.metadata.get("at_least", item.metadata.get("above"))
        below = bound - 1 if "at_least" in item.metadata else bound
        word = "at least" if "at_least" in item.metadata else "above"
        with pytest.raises(ValueError, match=re.escape(f"{flag(item)} must be {word} {bound}, got {below}")):
            PipelineConfig(output=tmp_path / "d", **{item.name: below})
        PipelineConfig(output=tmp_path / "d", **{item.name: bound + 1})  # inside the range: accepted


def test_a_mistyped_init_draft_is_refused_when_the_config_is_made(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"--init-draft {tmp_path / 'v1'} is not a draft folder")):
        PipelineConfig(output=tmp_path / "d", init_draft=tmp_path / "v1")
