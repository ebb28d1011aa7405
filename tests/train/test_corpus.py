"""The corpus: regenerated records kept compact in the repository, exported and imported without loss."""

import json
import random

import numpy as np
import pytest

from flashdraft.train.corpus import (
    MANIFEST,
    corpus_ids,
    export_records,
    import_records,
    read_corpus,
    read_manifest,
    response_counts,
)
from flashdraft.train.records import ShardWriter, TrainingRecord, read_records, run_resumable

SETTINGS = {"stage": "regenerate", "model": "/somewhere/smollm2", "num_layers": 30, "hidden_size": 576,
            "vocab_size": 49152, "max_new_tokens": 512, "temperature": 0.0, "top_k": 0, "batch_size": 8, "seed": 0,
            "stop_token_ids": [2]}


def records(count: int, start: int = 0, vocab: int = 49152, seed: int = 0) -> list[TrainingRecord]:
    rng = random.Random(seed)
    made = []
    for i in range(start, start + count):
        prompt, response = rng.randint(5, 60), rng.randint(1, 300)
        made.append(TrainingRecord(id=f"src:{i}", source=rng.choice(["sharegpt", "math", "codeio"]),
                                   input_ids=[rng.randrange(vocab) for _ in range(prompt + response)],
                                   response_start=prompt))
    return made


def write_folder(folder, items, settings=SETTINGS):
    with ShardWriter(folder, settings) as writer:
        writer.write(items)
    return folder


def test_export_then_read_gives_the_same_records(tmp_path):
    made = records(40)
    added = export_records(write_folder(tmp_path / "work", made), tmp_path / "corpus", target="t", command="cmd",
                           target_sha256="abc")
    assert added == 40
    assert list(read_corpus(tmp_path / "corpus")) == made
    manifest = read_manifest(tmp_path / "corpus")
    assert manifest["target"] == "t" and manifest["target_sha256"] == "abc" and manifest["command"] == "cmd"
    assert "model" not in manifest["settings"]  # a path on one machine
    tokens = sum(len(r.input_ids) for r in made)
    assert manifest["totals"]["records"] == 40
    assert manifest["totals"]["response_tokens"] == sum(len(r.input_ids) - r.response_start for r in made)
    assert manifest["shards"][0]["tokens"] == tokens
    assert sum(manifest["totals"]["sources"].values()) == 40
    # Two bytes per token and a little: even random ids (which do not compress) stay close to it.
    assert manifest["totals"]["bytes"] < 2.2 * tokens + 2000


def test_export_is_additive_and_never_repeats_a_record(tmp_path):
    work, corpus = tmp_path / "work", tmp_path / "corpus"
    write_folder(work, records(10))
    assert export_records(work, corpus, target="t", command="c") == 10
    assert export_records(work, corpus, target="t", command="c") == 0
    write_folder(work, records(5, start=10))
    assert export_records(work, corpus, target="t", command="c") == 5
    manifest = read_manifest(corpus)
    assert [s["records"] for s in manifest["shards"]] == [10, 5]
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.npz", "shard-00001.npz"]
    assert corpus_ids(corpus) == {f"src:{i}" for i in range(15)}


def test_records_of_other_settings_are_refused(tmp_path):
    corpus = tmp_path / "corpus"
    export_records(write_folder(tmp_path / "a", records(3)), corpus, target="t", command="c")
    other = dict(SETTINGS, max_new_tokens=256, model="/elsewhere")
    with pytest.raises(ValueError, match="other settings than the corpus .differences: max_new_tokens"):
        export_records(write_folder(tmp_path / "b", records(3, start=3), other), corpus, target="t", command="c")


def test_only_regenerated_answers_are_kept(tmp_path):
    labelled = records(2)
    labelled[0].labels = labelled[0].input_ids[labelled[0].response_start :]
    with pytest.raises(ValueError, match="regenerated answers only"):
        export_records(write_folder(tmp_path / "w", labelled), tmp_path / "c", target="t", command="c")
    teacher = dict(SETTINGS, stage="teacher-forced")
    with pytest.raises(ValueError, match="does not hold regenerated records"):
        export_records(write_folder(tmp_path / "w2", records(2), teacher), tmp_path / "c", target="t", command="c")


def test_a_damaged_shard_is_named(tmp_path):
    corpus = tmp_path / "corpus"
    export_records(write_folder(tmp_path / "w", records(5)), corpus, target="t", command="c")
    shard = corpus / "shard-00000.npz"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-00000.npz does not match its checksum"):
        list(read_corpus(corpus))


def test_large_vocabularies_keep_32_bit_ids(tmp_path):
    made = records(3, vocab=151936)
    settings = dict(SETTINGS, vocab_size=151936)
    export_records(write_folder(tmp_path / "w", made, settings), tmp_path / "c", target="t", command="c")
    assert np.load(tmp_path / "c" / "shard-00000.npz")["tokens"].dtype == np.uint32
    assert list(read_corpus(tmp_path / "c")) == made


def test_imported_records_are_skipped_by_the_next_regeneration(tmp_path):
    corpus, work = tmp_path / "corpus", tmp_path / "new-machine"
    made = records(6)
    export_records(write_folder(tmp_path / "w", made), corpus, target="t", command="c")
    assert import_records(corpus, work, model="/here/smollm2") == 6
    assert json.loads((work / "meta.json").read_text())["model"] == "/here/smollm2"
    assert list(read_records(work)) == made
    assert import_records(corpus, work, model="/here/smollm2") == 0  # already there
    ids = [r.id for r in made] + ["src:100", "src:101"]
    processed = []

    def process(batch_number, batch):
        processed.extend(ids[i] for i in batch)
        return records(1, start=100 + len(processed) - 1)

    settings = dict(SETTINGS, model="/here/smollm2")
    run_resumable(ids, [10] * len(ids), work, settings, process, batch_size=1, bytes_per_record=10,
                  description="regenerating", progress=False)
    assert sorted(processed) == ["src:100", "src:101"]


def test_import_refuses_a_work_folder_of_other_settings(tmp_path):
    corpus = tmp_path / "corpus"
    export_records(write_folder(tmp_path / "w", records(2)), corpus, target="t", command="c")
    write_folder(tmp_path / "other", records(1, start=50), dict(SETTINGS, temperature=0.7))
    with pytest.raises(ValueError, match="differences: temperature"):
        import_records(corpus, tmp_path / "other", model="/here")


def test_response_counts_count_the_answers_only_and_leave_out_the_excluded_records(tmp_path):
    made = [TrainingRecord(id="a", source="math", input_ids=[7, 7, 3, 3, 3], response_start=2),
            TrainingRecord(id="b", source="math", input_ids=[9, 3, 5], response_start=1),
            TrainingRecord(id="c", source="math", input_ids=[1, 5, 5, 5, 5], response_start=1)]
    export_records(write_folder(tmp_path / "work", made), tmp_path / "corpus", target="t", command="cmd")
    counts = response_counts(tmp_path / "corpus", 49152)
    assert counts.shape == (49152,) and counts.sum() == 3 + 2 + 4  # prompts (7, 9, 1) not counted
    assert (counts[3], counts[5], counts[7], counts[9], counts[1]) == (4, 5, 0, 0, 0)
    held_out = response_counts(tmp_path / "corpus", 49152, exclude={"c"})
    assert (held_out[3], held_out[5]) == (4, 1)
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens, the target has 96"):
        response_counts(tmp_path / "corpus", 96)
    with pytest.raises(ValueError, match="holds no corpus"):
        response_counts(tmp_path / "nothing", 49152)


def test_an_empty_corpus_reads_as_empty(tmp_path):
    assert list(read_corpus(tmp_path)) == []
    assert import_records(tmp_path, tmp_path / "work", model="/here") == 0
    assert not (tmp_path / MANIFEST).exists()


def test_a_training_folder_holds_the_prompt_set_and_the_corpus_or_a_seeded_subset_of_it(tmp_path):
    from flashdraft.train import corpus as script

    corpus, regeneration = tmp_path / "corpus", tmp_path / "regeneration"
    export_records(write_folder(tmp_path / "made", records(12)), corpus, target="t", command="c", target_sha256="0")
    with pytest.raises(ValueError, match="no prompt set yet"):
        script.make_train_folder(corpus, regeneration, tmp_path / "all", None, model="/here")
    regeneration.mkdir()
    (regeneration / "prompts.jsonl").write_text("prompts\n")
    (regeneration / "prompts.json").write_text("{}\n")
    assert script.make_train_folder(corpus, regeneration, tmp_path / "all", None, model="/here") == 12
    assert (tmp_path / "all" / "prompts.jsonl").read_text() == "prompts\n"
    assert {r.id for r in read_records(tmp_path / "all" / "records-regenerate")} == {f"src:{i}" for i in range(12)}
    subsets = [script.make_train_folder(corpus, regeneration, tmp_path / name, 5, model="/here") for name in "ab"]
    drawn = [{r.id for r in read_records(tmp_path / name / "records-regenerate")} for name in "ab"]
    assert subsets == [5, 5] and len(drawn[0]) == 5 and drawn[0] == drawn[1]  # seeded: the same draw every time
    assert script.make_train_folder(corpus, regeneration, tmp_path / "a", 5, model="/here") == 5  # rerun: no repeats
    assert len(list(read_records(tmp_path / "a" / "records-regenerate"))) == 5
    script.make_train_folder(corpus, regeneration, tmp_path / "next", 5, model="/here", skip=5)
    script.make_train_folder(corpus, regeneration, tmp_path / "ten", 10, model="/here")
    following = {r.id for r in read_records(tmp_path / "next" / "records-regenerate")}
    ten = {r.id for r in read_records(tmp_path / "ten" / "records-regenerate")}
    assert len(following) == 5 and not following & drawn[0] and following | drawn[0] == ten  # the next 5 in order
    with pytest.raises(ValueError, match="--skip needs --records"):
        script.make_train_folder(corpus, regeneration, tmp_path / "bad", None, model="/here", skip=5)
    # --exclude leaves out what earlier folders hold: the same draw as --skip on an unchanged corpus, and after
    # the corpus grows, still none of the old records.
    assert script.make_train_folder(corpus, regeneration, tmp_path / "fresh", 5, model="/here",
                                    exclude=[tmp_path / "a"]) == 5
    assert {r.id for r in read_records(tmp_path / "fresh" / "records-regenerate")} == following
    export_records(write_folder(tmp_path / "more", records(8, start=12)), corpus, target="t", command="c",
                   target_sha256="0")
    script.make_train_folder(corpus, regeneration, tmp_path / "third", 6, model="/here",
                             exclude=[tmp_path / "a", tmp_path / "next"])
    third = {r.id for r in read_records(tmp_path / "third" / "records-regenerate")}
    assert len(third) == 6 and not third & (drawn[0] | following)
    listed = tmp_path / "draw.txt"  # the same exclusion from a file of ids (a shipped draft's draw)
    listed.write_text("".join(f"{i}\n" for i in sorted(drawn[0] | following)) + "\n")
    script.make_train_folder(corpus, regeneration, tmp_path / "third-listed", 6, model="/here", exclude=[listed])
    assert {r.id for r in read_records(tmp_path / "third-listed" / "records-regenerate")} == third
    with pytest.raises(ValueError, match="--exclude .* not a training folder"):
        script.make_train_folder(corpus, regeneration, tmp_path / "bad", 5, model="/here", exclude=[tmp_path / "no"])


def test_the_corpus_command_reports_the_corpus_and_refuses_unknown_targets(tmp_path, monkeypatch, capsys):
    from flashdraft.cli import main

    monkeypatch.setenv("FLASHDRAFT_HOME", str(tmp_path / "home"))
    export_records(write_folder(tmp_path / "made", records(3)), tmp_path / "c", target="t", command="c",
                   target_sha256="0")
    assert main(["corpus", "status", "--corpus", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert f"corpus {tmp_path / 'c'}: 3 records" in out
    assert "prompts-20000: no regeneration yet" in out and "regeneration: not running" in out
    assert main(["corpus", "status", "--target", "qwen2.5-coder-1.5b-instruct", "--corpus", str(tmp_path)]) == 0
    assert "qwen2.5-coder-1.5b-instruct/prompts-2000" in capsys.readouterr().out  # a new target's first step
    assert main(["corpus", "status", "--target", "qwen2.5-coder-0.5b-instruct", "--corpus", str(tmp_path)]) == 0
    assert "qwen2.5-coder-0.5b-instruct/prompts-30000" in capsys.readouterr().out  # its sixth step
    assert main(["corpus", "status", "--target", "nosuch"]) == 2
    assert "unknown target 'nosuch'" in capsys.readouterr().err
    assert main(["corpus", "pause", "--corpus", str(tmp_path / "c")]) == 1
    assert "no regeneration runs in" in capsys.readouterr().err
    for threads in ("0", "100000"):
        assert main(["corpus", "regenerate", "--corpus", str(tmp_path / "c"), "--threads", threads]) == 2
        assert "--threads must be between 1 and the" in capsys.readouterr().err
    for action in ("regenerate", "status"):  # 0 is no step (it once meant the target's current one)
        with pytest.raises(SystemExit):
            main(["corpus", action, "--corpus", str(tmp_path / "c"), "--num-prompts", "0"])
        assert "argument --num-prompts: '0' is not an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "home" / "corpus").exists()  # refused before any work


def test_stop_ends_a_paused_regeneration_and_returns_once_it_has(tmp_path, capsys):
    import os
    import signal
    import subprocess
    import sys

    from flashdraft.cli import main

    work = tmp_path / "work"
    work.mkdir()
    # A stand-in for a background regeneration: a process in a session of its own whose starter has exited, as
    # `regenerate` leaves it (the shell is the group's leader; the sleeper, its member, is reaped by the system).
    starter = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' &"],
                               start_new_session=True)
    group = starter.pid
    starter.wait()
    try:
        (work / "regenerate.pid").write_text(f"{group}\n")
        args = ["--work-dir", str(work), "--corpus", str(tmp_path / "c")]
        assert main(["corpus", "pause", *args]) == 0
        assert main(["corpus", "stop", *args]) == 0  # SIGTERM reaches it although it was stopped
        assert f"stopped process group {group}" in capsys.readouterr().err
        with pytest.raises(ProcessLookupError):  # already gone when `stop` returned
            os.killpg(group, 0)
        assert main(["corpus", "stop", *args]) == 1
        assert "no regeneration runs in" in capsys.readouterr().err
    finally:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_regeneration_runs_on_the_threads_it_is_given(tmp_path):
    from flashdraft.train.corpus import regeneration_arguments

    for threads in (1, 2):
        arguments = regeneration_arguments("smollm2-135m-instruct", tmp_path, 5000, threads)
        assert arguments[arguments.index("--threads") + 1] == str(threads)
    assert "--threads" in regeneration_arguments("smollm2-135m-instruct", tmp_path, 5000)


def test_steps_past_the_default_mix_add_the_second_turns_and_take_every_pool_whole(tmp_path):
    from flashdraft.train.config import PipelineConfig
    from flashdraft.train.corpus import (
        CODE_FUNCTIONS_STEP,
        DEFAULT_MIX_STEP,
        check_follow_up_step,
        prompt_mix_arguments,
    )

    assert prompt_mix_arguments(DEFAULT_MIX_STEP) == []  # the settings of the steps made before stay the same
    arguments = prompt_mix_arguments(28000)
    assert arguments[arguments.index("--sources") + 1].split(",") == [
        "sharegpt", "leetcode", "codeio", "math", "sharegpt-turn2"]
    assert prompt_mix_arguments(CODE_FUNCTIONS_STEP - 1) == arguments  # the step of 28,000 keeps its settings
    later = prompt_mix_arguments(CODE_FUNCTIONS_STEP)
    assert later[later.index("--sources") + 1].split(",") == [
        "sharegpt", "leetcode", "codeio", "math", "sharegpt-turn2", "pyfunctions"]
    with pytest.raises(ValueError, match=f"--num-prompts {CODE_FUNCTIONS_STEP + 1} or more"):
        check_follow_up_step(CODE_FUNCTIONS_STEP, {"sharegpt": CODE_FUNCTIONS_STEP, "leetcode": 0, "codeio": 0,
                                                   "math": 0, "sharegpt-turn2": 0, "pyfunctions": 1})
    config = PipelineConfig(output=tmp_path, sources=arguments[1], proportions=arguments[3])
    assert config.proportions["sharegpt-turn2"] > 0 and config.source_names()[-1] == "sharegpt-turn2"
    sizes = {"sharegpt": 100, "leetcode": 50, "codeio": 50, "math": 100, "sharegpt-turn2": 30}
    check_follow_up_step(330, sizes)
    check_follow_up_step(DEFAULT_MIX_STEP, sizes)
    with pytest.raises(ValueError, match="--num-prompts 30230 or more"):
        check_follow_up_step(DEFAULT_MIX_STEP + 1, {**sizes, "math": 30000})


def test_a_larger_step_holds_every_prompt_of_a_smaller_one():
    from flashdraft.train.prompts import mix_prompts, user_prompt

    pools = {name: [user_prompt(f"{name}:{i}", name, f"{name} question {i}") for i in range(count)]
             for name, count in {"a": 40, "b": 25, "new": 15}.items()}
    old = mix_prompts({k: pools[k] for k in "ab"}, {"a": 1, "b": 1}, 65)
    new = mix_prompts(pools, {"a": 1, "b": 1, "new": 1}, 80)
    assert {p.id for p in old} < {p.id for p in new} and len(new) == 80


def test_every_target_step_past_the_default_mix_takes_the_real_pools_whole():
    from flashdraft.train.corpus import (
        CODE_FUNCTIONS_PROPORTIONS,
        DEFAULT_MIX_STEP,
        PROMPT_STEPS,
        check_follow_up_step,
    )
    from flashdraft.train.sources import load_sources

    sizes = {name: len(prompts) for name, prompts in load_sources(tuple(CODE_FUNCTIONS_PROPORTIONS)).items()}
    assert sizes["sharegpt-turn2"] > 7000 and sizes["pyfunctions"] > 1000
    assert any(step > DEFAULT_MIX_STEP for step in PROMPT_STEPS.values())
    for step in PROMPT_STEPS.values():
        check_follow_up_step(step, sizes)
