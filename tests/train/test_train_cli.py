"""`flashdraft train` end to end on a tiny target folder: every stage, caching and resume, the output folder and
model card, the exact command, help text on every option, and clear errors for bad input."""

import argparse
import json

import pytest
import torch

from flashdraft.cli import build_parser, main
from flashdraft.commands.train import exact_command
from flashdraft.draft import DFlashDraftModel, check_draft_folder
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
    args = train_args(target_folder, tmp_path, "--labels", "both", "--top-k", "4", "--distill-weight", "0.5",
                      "--draft-vocab-size", "32", "--features", "online")
    assert main(args) == 0
    draft = DFlashDraftModel.from_pretrained(tmp_path / "draft")
    assert draft.draft_vocab_ids.numel() == 32
    readme = (tmp_path / "draft" / "README.md").read_text()
    assert "32 most frequent" in readme and "teacher forcing" in readme
    work = tmp_path / "work"
    assert (work / "records-teacher-forced").is_dir() and (work / "records-regenerate").is_dir()
    assert not list(work.glob("features-*"))  # online: nothing stored


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
    assert "the training set is empty" in capsys.readouterr().err
    # Labelling is interrupted (Ctrl-C) after its first batch of 8 prompts.
    generate_batch, batches = regenerate_module.generate_batch, []

    def interrupted_after_one_batch(*args, **kwargs):
        if batches:
            raise KeyboardInterrupt
        batches.append(1)
        return generate_batch(*args, **kwargs)

    monkeypatch.setattr(regenerate_module, "generate_batch", interrupted_after_one_batch)
    assert main(train_args(target_folder, tmp_path, "--until", "labels", "--data-batch-size", "8")) == 130
    monkeypatch.undo()
    assert main(train_args(target_folder, tmp_path, "--label-minutes", "0", "--data-batch-size", "8")) == 0
    assert "ran out with 6 prompts left" in capsys.readouterr().err
    assert len(list(read_records(tmp_path / "work" / "records-regenerate"))) == 8


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
    assert "--top-k" in err
    err = run_failing(train_args(target_folder, tmp_path, "--mask-token-id", "500"), capsys)
    assert "outside the target's vocabulary" in err
    assert "--label-minutes must be >= 0" in run_failing(train_args(target_folder, tmp_path, "--label-minutes", "-1"),
                                                          capsys)
    (tmp_path / "blocker").write_text("a file where a folder should be")
    err = run_failing(train_args(target_folder, tmp_path) + ["-o", str(tmp_path / "blocker" / "draft")], capsys)
    assert "cannot write the draft" in err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    err = run_failing(train_args(target_folder, tmp_path) + ["-o", str(tmp_path / "taken")], capsys)
    assert "not a draft folder" in err
    assert not (tmp_path / "work" / "records-regenerate").exists()  # none of these started the data stages


def test_a_prompt_file_overlapping_an_evaluation_set_is_refused(target_folder, tmp_path, capsys):
    from flashdraft.train.decontaminate import gsm8k_prompts

    question = gsm8k_prompts()[0]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Please solve: " + question}) + "\n")
    args = [a for a in train_args(target_folder, tmp_path) if a != "--skip-eval-check"]
    err = run_failing(args, capsys)
    assert "overlaps evaluation data" in err and "gsm8k" in err


def test_every_option_has_help_and_the_exact_command_reproduces_the_arguments(tmp_path):
    parser = build_parser()
    train_parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    for action in train_parser._actions:
        assert action.help, action.dest
    args = parser.parse_args(["train", "-o", str(tmp_path / "d"), "--prompts", "a.jsonl", "--no-init-from-target",
                              "--skip-eval-check", "--lr", "0.001"])
    command = exact_command(args, train_parser)
    assert command.startswith("flashdraft train ") and "--no-init-from-target" in command
    again = parser.parse_args(__import__("shlex").split(command)[1:])
    assert {k: v for k, v in vars(again).items() if k != "func"} == {k: v for k, v in vars(args).items() if k != "func"}


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


def test_init_draft_starts_from_an_earlier_draft_and_must_match_it(target_folder, tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl")
    assert main(train_args(target_folder, tmp_path, "--draft-vocab-size", "0")) == 0
    first = DFlashDraftModel.from_pretrained(tmp_path / "draft")
    later = train_args(target_folder, tmp_path, "--draft-vocab-size", "0", "--run-name", "more", "--lr", "1e-12",
                       "--eval-every", "0", "--init-draft", str(tmp_path / "draft")) + ["-o", str(tmp_path / "d2")]
    assert main(later) == 0
    second = DFlashDraftModel.from_pretrained(tmp_path / "d2")
    for name, tensor in first.state_dict().items():
        assert torch.allclose(second.state_dict()[name], tensor, atol=1e-6), name
    err = run_failing(later + ["--block-size", "8"], capsys)
    assert "--init-draft" in err and "(1, 8, [0, 2], 1)" in err


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


def test_a_command_is_refused_while_another_writes_the_same_data(target_folder, tmp_path, capsys):
    from flashdraft.train.records import exclusive

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
