"""Training from the committed corpus (`flashdraft train --corpus`, `flashdraft.train.from_corpus`) and measuring
drafts on its held-out records (`flashdraft draft evaluate`), on tiny models: the way the shipped drafts since v15
were made, kept as a contract (budget, held-out and excluded records, snapshots, the mean with the start)."""

import json
import re
from pathlib import Path

import torch

from flashdraft import DFlashDraftModel
from flashdraft.cli import main
from flashdraft.train.corpus import export_records
from flashdraft.train.records import TrainingRecord
from train.test_corpus import SETTINGS, write_folder
from train.tiny_training import MASK, next_token, one_thread  # noqa: F401

from tiny import tiny_target, tiny_tokenizer

# The shipped drafts' recipe where it differs from `flashdraft train`'s defaults (the test's own settings follow).
RECIPE = ["--loss-weights", "acceptance", "--compute-dtype", "bfloat16", "--checkpoint-every", "1000000",
          "--keep-checkpoints", "1"]


def target_folder(path: Path) -> Path:
    target = tiny_target("llama", num_layers=4)
    target.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def corpus_folder(path: Path, count: int = 24, settings: dict = SETTINGS) -> Path:
    records = []
    for i in range(count):
        prompt = [5 + (i * 3 + k) % 20 for k in range(4)]
        response = [25 + i % 30]
        while len(response) < 14:
            response.append(5 + (next_token(response[-1]) - 5) % 55)
        records.append(TrainingRecord(id=f"pattern:{i}", source="pattern", input_ids=prompt + response,
                                      response_start=len(prompt)))
    export_records(write_folder(path.parent / f"{path.name}-work", records, settings), path, target="tiny",
                   command="test")
    return path


def draft_folder(path: Path, vocab=range(40, 70)) -> Path:
    target = tiny_target("llama", num_layers=4)
    torch.manual_seed(3)
    draft = DFlashDraftModel.for_target(target.config, num_layers=1, block_size=4, mask_token_id=MASK,
                                        target_layer_ids=[0, 1])
    draft.set_draft_vocab(list(vocab))
    draft.save_pretrained(path)
    return path


def test_training_on_the_corpus_fits_the_budget_leaves_the_held_out_records_out_and_writes_snapshots(
        tmp_path, capsys):
    source, corpus = target_folder(tmp_path / "target"), corpus_folder(tmp_path / "corpus")
    start = draft_folder(tmp_path / "draft")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("pattern:3\npattern:17\npattern:20\npattern:9\n")
    common = ["--target", str(source), "--corpus", str(corpus), "--heldout-ids", str(heldout), "--device", "cpu"]
    assert main(["train", "-o", str(tmp_path / "out"), *common, *RECIPE, "--init-draft", str(start), "--seconds", "60",
                 "--reserve", "0", "--epochs", "2", "--batch-size", "2", "--grad-accum", "2", "--num-anchors", "4",
                 "--lr", "3e-3", "--snapshots", "0.5"]) == 0
    printed = capsys.readouterr().out
    # 20 training records in global batches of 4: 5 steps an epoch, and the budget holds both epochs.
    assert "20 training records, 4 held out; global batch 4, 5 steps an epoch; 10 steps (" in printed
    assert "snapshots at [5]" in printed
    # A line a twentieth of the run (here every step, the last excepted), the snapshot's saying it was written.
    steps_reported = [int(m) for m in re.findall(r"^step (\d+)/10: loss \d+\.\d{3}, \d+ s, about \d+ s left",
                                                 printed, re.M)]
    assert steps_reported == list(range(1, 10))
    assert re.search(r"^step 5/10: .*; step-5 written$", printed, re.M)
    card = json.loads((tmp_path / "out" / "float32" / "training.json").read_text())
    assert card["data"] == {"pattern": {"sequences": 20, "tokens": 20 * 14}}
    assert card["summary"]["steps"] == 10 and card["settings"]["global batch (sequences)"] == 4
    assert card["command"].startswith("flashdraft train --target ") and "--corpus" in card["command"]
    # The shape is the starting draft's, not the options' defaults (block 16, 2 layers, 5 feature layers, 8192).
    for words in ("--draft-layers 1 ", "--block-size 4 ", "--feature-layers 0,1 ", "--draft-vocab-size 30 "):
        assert words in card["command"], words
    final = DFlashDraftModel.from_pretrained(tmp_path / "out" / "final")
    snapshot = DFlashDraftModel.from_pretrained(tmp_path / "out" / "step-5")
    first = DFlashDraftModel.from_pretrained(start)
    assert json.loads((tmp_path / "out" / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(final.draft_vocab_ids, torch.arange(40, 70))
    assert not torch.equal(final.fc.weight, first.fc.weight.to(torch.bfloat16).float())
    assert not torch.equal(final.fc.weight, snapshot.fc.weight)
    mean = DFlashDraftModel.from_pretrained(tmp_path / "out" / "mean")
    exact = (first.fc.weight + DFlashDraftModel.from_pretrained(tmp_path / "out" / "float32").fc.weight) / 2
    assert torch.equal(mean.fc.weight, exact.to(torch.bfloat16).float())
    # Two whole epochs: every training record was reached, none of the held-out ones.
    reached = (tmp_path / "out" / "reached.txt").read_text().splitlines()
    assert reached == sorted(f"pattern:{i}" for i in range(24) if i not in (3, 9, 17, 20))

    assert main(["draft", "evaluate", *common, "--prompts", "2", "--max-new-tokens", "8", str(start),
                 str(tmp_path / "out" / "final")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{start}: tau heldout ") and "held-out loss" in lines[1]
    losses = [float(line.split("held-out loss ")[1].split(",")[0]) for line in lines]
    assert losses[1] < losses[0]  # training on the pattern lowers the loss on held-out records of the same pattern
    heldout_taus = [float(line.split("tau heldout ")[1].split(";")[0]) for line in lines]
    assert all(1.0 <= t <= 4.0 for t in heldout_taus)  # tau counts the bonus token: 1..block size

    # Prompts outside the corpus (a .jsonl set beside the held-out one): each set gets its own tau, and the held-out
    # figures are those of the run without it.
    outside = tmp_path / "outside.jsonl"
    outside.write_text("".join(json.dumps({"prompt": f"tell me {word}"}) + "\n" for word in ("a", "b", "c")))
    assert main(["draft", "evaluate", *common, "--prompts", "2", "--max-new-tokens", "8", "--sets",
                 f"heldout,{outside}", str(start), str(tmp_path / "out" / "final")]) == 0
    again = capsys.readouterr().out.strip().splitlines()
    for line, before, tau in zip(again, lines, heldout_taus):
        assert re.fullmatch(rf"\S+: tau heldout {tau:.3f}, outside \d\.\d{{3}}; held-out loss .*", line), line
        assert line.split("; ")[1] == before.split("; ")[1]
    assert main(["draft", "evaluate", *common, "--sets", "heldout,nonesuch", str(start)]) == 2
    assert "unknown dataset 'nonesuch'" in capsys.readouterr().err

    excluded = tmp_path / "seen.txt"
    excluded.write_text("\n".join(f"pattern:{i}" for i in range(10)) + "\n")  # 8 of them training records
    assert main(["train", "-o", str(tmp_path / "again"), *common, *RECIPE,
                 "--init-draft", str(tmp_path / "out" / "final"), "--max-steps", "2", "--seed", "1", "--loss-chunk",
                 "8", "--batch-size", "2", "--grad-accum", "2", "--num-anchors", "4", "--exclude-ids", str(excluded),
                 "--snapshots", ""]) == 0
    assert "12 training records, 4 held out; global batch 4, 3 steps an epoch; 2 steps (given); snapshots at []" in (
        capsys.readouterr().out)
    again = json.loads((tmp_path / "again" / "float32" / "training.json").read_text())
    assert again["summary"]["steps"] == 2
    # The continued draft keeps the run behind its start (the first run's start had no training.json: none before).
    first = json.loads((tmp_path / "out" / "final" / "training.json").read_text())
    assert "runs" not in first
    assert [run["command"] for run in again["runs"]] == [first["command"]]
    assert again["runs"][0]["summary"] == first["summary"] and again["runs"][0]["what"].endswith("(final)")
    # 2 steps of 4 of the 12 records left reach 8 of them, sorted, and no excluded or held-out one.
    reached = (tmp_path / "again" / "reached.txt").read_text().splitlines()
    allowed = {f"pattern:{i}" for i in range(10, 24)} - {"pattern:17", "pattern:20"}
    assert len(set(reached)) == 8 and set(reached) <= allowed and reached == sorted(reached)
    assert main(["train", "-o", str(tmp_path / "none"), *common, "--init-draft", str(start)]) == 2
    assert "needs --seconds (a time budget) or --max-steps" in capsys.readouterr().err

    heldout.write_text("pattern:99\n")
    assert main(["draft", "evaluate", *common, str(start)]) == 2
    assert re.search("1 held-out ids are not in .*, e.g. pattern:99: the list belongs to another",
                     capsys.readouterr().err)


def test_a_continued_draft_can_take_a_vocabulary_chosen_again_from_the_corpus(tmp_path, capsys):
    from flashdraft.train.corpus import response_counts
    from flashdraft.train.loss import DraftVocabulary

    source = target_folder(tmp_path / "target")
    corpus = corpus_folder(tmp_path / "corpus", settings={**SETTINGS, "vocab_size": 96})  # the tiny target's
    start = draft_folder(tmp_path / "draft", vocab=range(5, 15))  # ten tokens, few of them in the answers
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("pattern:3\npattern:17\n")
    common = ["--target", str(source), "--corpus", str(corpus), "--heldout-ids", str(heldout), "--device", "cpu",
              *RECIPE, "--init-draft", str(start), "--max-steps", "1", "--batch-size", "2", "--num-anchors", "4",
              "--snapshots", ""]
    assert main(["train", "-o", str(tmp_path / "out"), *common, "--draft-vocab-corpus", str(corpus),
                 "--draft-vocab-size", "12"]) == 0
    counts = torch.from_numpy(response_counts(corpus, 96, exclude={"pattern:3", "pattern:17"}))
    chosen = DraftVocabulary.from_counts(counts, 12)
    before = DraftVocabulary.from_ids(list(range(5, 15)), 96)
    printed = capsys.readouterr().out
    assert (f"drafting vocabulary: the 12 tokens most frequent in {corpus}'s answers, {chosen.coverage(counts):.1%} "
            f"of their tokens (the start's covered {before.coverage(counts):.1%})") in printed
    for name in ("final", "mean", "float32"):  # the run's draft and its mean with the start draft over the new one
        assert DFlashDraftModel.from_pretrained(tmp_path / "out" / name).draft_vocab_ids.tolist() == (
            chosen.ids.tolist()), name
    card = json.loads((tmp_path / "out" / "float32" / "training.json").read_text())
    assert f"--draft-vocab-size 12 --draft-vocab-corpus {corpus}" in card["command"]
    # 0: the full vocabulary.
    assert main(["train", "-o", str(tmp_path / "full"), *common, "--draft-vocab-corpus", str(corpus),
                 "--draft-vocab-size", "0"]) == 0
    assert "drafting vocabulary: the full one" in capsys.readouterr().out
    assert DFlashDraftModel.from_pretrained(tmp_path / "full" / "final").draft_vocab_ids is None


def test_a_progress_line_says_the_time_left_at_this_process_pace(monkeypatch):
    from flashdraft.train import from_corpus

    monkeypatch.setattr(from_corpus.time, "perf_counter", lambda: 130.0)
    # Resumed at step 100 at t=100: 30 s for 10 steps, so 3 s a step for the 40 left.
    assert from_corpus.progress_line(110, 150, 2.34567, 95.4, (100, 100.0)) == (
        "step 110/150: loss 2.346, 95 s, about 120 s left")
    assert from_corpus.progress_line(110, 150, 2.0, 95.0, (100, 100.0), "step-110 written").endswith(
        "about 120 s left; step-110 written")


def test_a_budgeted_run_killed_midway_resumes_with_its_first_starts_step_count(tmp_path, monkeypatch, capsys):
    from flashdraft.train import from_corpus, trainer

    source, corpus = target_folder(tmp_path / "target"), corpus_folder(tmp_path / "corpus")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("pattern:3\npattern:17\npattern:20\npattern:9\n")
    command = ["train", "-o", str(tmp_path / "out"), "--target", str(source), "--corpus", str(corpus),
               "--heldout-ids", str(heldout), "--device", "cpu", *RECIPE[:4], "--checkpoint-every", "2",
               "--init-draft", str(draft_folder(tmp_path / "draft")), "--seconds", "1000", "--reserve", "0",
               "--epochs", "2", "--batch-size", "2", "--grad-accum", "2", "--num-anchors", "4"]
    # The probe says 100 s a step at the first start (9 steps of the budget), 50 s at the second (it would be the
    # 10 steps of two epochs): the second start keeps the first's 9.
    probes = iter([100.0, 50.0])
    monkeypatch.setattr(from_corpus, "probe_step_seconds", lambda *args: next(probes))
    original = trainer.Trainer.train_step

    def killed_after_step_5(self):
        result = original(self)
        if self.step == 5:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(trainer.Trainer, "train_step", killed_after_step_5)
    assert main(command) == 130
    assert "; 9 steps (100.000 s a step" in capsys.readouterr().out
    monkeypatch.setattr(trainer.Trainer, "train_step", original)
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert "; 9 steps (planned at the first start, in " in printed
    assert re.search(r"^step 5/9: ", printed, re.M)  # resumed from the checkpoint of step 4
    assert not re.search(r"^step [1-4]/9: ", printed, re.M)
    assert json.loads((tmp_path / "out" / "float32" / "training.json").read_text())["summary"]["steps"] == 9
    assert next(probes) == 50.0  # the second start probed nothing


def test_a_corpus_runs_mistakes_are_refused_by_name_before_the_target_loads(tmp_path, capsys, monkeypatch):
    corpus, start = corpus_folder(tmp_path / "corpus"), draft_folder(tmp_path / "draft")
    ids = tmp_path / "ids.txt"
    ids.write_text("pattern:0\n")

    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded before the mistake was found")

    monkeypatch.setattr("flashdraft.train.from_corpus.load_target", no_target)
    base = ["train", "--target", "unused", "-o", str(tmp_path / "out"), "--device", "cpu", "--max-steps", "2"]
    mistakes = {
        ("--corpus", str(tmp_path), "--init-draft", str(start)): f"--corpus {tmp_path} holds no corpus (no manifest",
        ("--corpus", str(corpus), "--init-draft", str(tmp_path)): f"--init-draft {tmp_path} is not a draft folder",
        ("--corpus", str(corpus), "--init-draft", str(start), "--heldout-ids", str(tmp_path / "no.txt")):
            f"--heldout-ids {tmp_path / 'no.txt'}: no such file",
        ("--corpus", str(corpus), "--init-draft", str(start), "--exclude-ids", str(ids), "--exclude-ids",
         str(tmp_path / "no.txt")): f"--exclude-ids {tmp_path / 'no.txt'}: no such file",
        ("--corpus", str(corpus), "--init-draft", str(start), "--seconds", "0"): "--seconds must be above 0, got 0.0",
        ("--corpus", str(corpus), "--init-draft", str(start), "--step-seconds", "-2"): "--step-seconds must be above 0",
        ("--corpus", str(corpus), "--init-draft", str(start), "--reserve", "-1"): "--reserve must be at least 0",
        ("--corpus", str(corpus), "--init-draft", str(start), "--snapshots", "0.5,1"): "--snapshots takes fractions",
        ("--corpus", str(corpus), "--init-draft", str(start), "--snapshots", "half"): "--snapshots takes fractions",
    }
    for words, message in mistakes.items():
        assert main(base + list(words)) == 2, words
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    # a folder with a config.json but no weights: the full check, still before the target
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text((start / "config.json").read_text())
    assert main(base + ["--corpus", str(corpus), "--init-draft", str(tmp_path / "half")]) == 2
    assert "has no *.safetensors weights" in capsys.readouterr().err
    (tmp_path / "other.txt").write_text("elsewhere:1\n")
    assert main(base + ["--corpus", str(corpus), "--init-draft", str(start), "--heldout-ids",
                        str(tmp_path / "other.txt")]) == 2
    assert "1 held-out ids are not in" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    evaluate = ["draft", "evaluate", "--target", "unused", "--heldout-ids", str(ids), str(start)]
    assert main(evaluate + ["--corpus", str(tmp_path)]) == 2
    assert f"--corpus {tmp_path} holds no corpus" in capsys.readouterr().err
