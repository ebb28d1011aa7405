"""The training pipeline: a target in, a trained DFlash draft out, in four cached and resumable stages.

    prompts   a prompt file and/or a seeded mix of built-in sources, checked against the evaluation sets
    labels    the target writes the responses (regenerate) and/or labels existing ones (teacher-forced)
    features  the target's hidden states of the feature layers, stored once on disk (offline) or skipped (online)
    train     the trainer: checkpoints, resume, evaluation by speculative decoding, best draft, model card

    from flashdraft.train import PipelineConfig, run_pipeline
    summary = run_pipeline(PipelineConfig(output="my-draft", num_prompts=24, max_steps=30))

Every stage caches its output in the work folder and continues where it stopped when run again with the same
settings; a finished stage is skipped. Under torchrun / accelerate launch only the train stage runs (every process
trains on its share of each batch); run the data stages first in one process (`until="features"`).

The settings and their defaults live in `config.py` (`PipelineConfig`, re-exported here). This module loads
nothing heavy at import; the stages import torch and the models when they run.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import cache_home, write_atomic
from .config import HELDOUT_SET, PipelineConfig, exact_command, run_identity
from .prompts import PROMPT_SETTINGS, PROMPTS_FILE

if TYPE_CHECKING:
    from .drafts import TrainSummary

__all__ = ["PipelineConfig", "run_pipeline"]

PROMPTS_LOCK = ".prompts.lock"
DRAFT_VOCAB_FILE = "draft_vocab_ids.json"  # in the run folder: the vocabulary a --draft-vocab-corpus run chose
RUN_SETTINGS = "run.json"  # in the run folder: the settings of the run its checkpoints belong to (`run_identity`)


# ---------------------------------------------------------------------- helpers


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _resolve_feature_layers(layers: int | tuple[int, ...], num_target_layers: int) -> list[int]:
    from ..draft import default_target_layer_ids
    from .features import check_feature_layers

    values = default_target_layer_ids(num_target_layers, layers) if isinstance(layers, int) else list(layers)
    check_feature_layers(values, num_target_layers)
    return values


def _mask_token_id(config: PipelineConfig, tokenizer, vocab_size: int) -> int:
    from ..models import REGISTRY

    mask = config.mask_token_id
    if mask is None and config.target in REGISTRY:
        mask = REGISTRY[config.target].mask_token_id
    if mask is None:
        mask = tokenizer.mask_token_id
    if mask is None:
        raise ValueError(
            "the target's tokenizer has no mask token: give --mask-token-id, a special token id that never occurs "
            "in text (e.g. an unused reserved token)"
        )
    if not 0 <= mask < vocab_size:
        raise ValueError(f"--mask-token-id {mask} is outside the target's vocabulary [0, {vocab_size})")
    return mask


def _draft_shape(draft) -> tuple:
    """What a draft's weights must agree on to be trained on. Not the block size: no weight depends on it (positions
    are rotary, the mask is one embedding), so a draft can be trained on at another block size."""
    return draft.config.num_hidden_layers, draft.target_layer_ids, draft.mask_token_id


def _say(message: str) -> None:
    print(f"[flashdraft train] {message}", file=sys.stderr, flush=True)


def work_folder(config: PipelineConfig) -> Path:
    """The work folder: the given one, else one per target under the flashdraft cache."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", config.target).strip("-")
    return (config.work_dir or cache_home() / "train" / slug).expanduser().resolve()


# ---------------------------------------------------------------------- stages


def prompt_settings(config: PipelineConfig) -> dict:
    """What makes the prompt set: the prompt files (by content), the built-in mix and the checks."""
    names = list(config.source_names())
    files = [path.expanduser().resolve() for path in config.prompts]
    settings = {
        "files": {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None for p in files},
        "sources": names,
        "proportions": config.proportions if names else {},
        "num_prompts": config.num_prompts if names else 0,
        "max_prompt_chars": config.max_prompt_chars,
        "seed": config.seed,
        "eval_check": not config.skip_eval_check,
    }
    return json.loads(json.dumps(settings))  # as it reads back from prompts.json


def _stored_settings(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def check_work_folder(work: Path, settings: dict) -> None:
    """Refuse, before anything is written, a work folder that holds the data of another prompt set: its records
    and features belong to those prompts, so a run that wrote there would mix two data sets (and leave the other
    run unable to resume)."""
    stored = _stored_settings(work / PROMPT_SETTINGS)
    if stored is not None and stored != settings:
        changed = sorted(k for k in stored.keys() | settings.keys() if stored.get(k) != settings.get(k))
        raise ValueError(
            f"the work folder {work} holds the data of other prompt settings (differences: {', '.join(changed)}; "
            f"see its {PROMPT_SETTINGS}): give this run its own --work-dir, or run it with those settings"
        )


def check_record_folders(config: PipelineConfig, work: Path, model, tokenizer) -> None:
    """Refuse, before anything is written, record folders made with other label settings. With --label-minutes 0
    no record is written, so records made otherwise (a corpus's: its answer length, its engine arithmetic) are
    trained on as they are."""
    if config.label_minutes == 0:
        return
    from .labels import label_settings
    from .records import settings_differences
    from .regenerate import regenerate_settings

    for kind in config.label_kinds():
        if kind == "regenerate":
            settings = regenerate_settings(model, tokenizer, max_new_tokens=config.max_new_tokens,
                                           temperature=config.temperature, top_k=config.store_top_k,
                                           batch_size=config.data_batch_size, seed=config.seed)
        else:
            settings = label_settings(model, tokenizer, max_response_tokens=config.max_new_tokens,
                                      top_k=config.store_top_k, batch_size=config.data_batch_size)
        changed = settings_differences(work / f"records-{kind}", settings)
        if changed:
            raise ValueError(
                f"{work / f'records-{kind}'} holds records made with other settings (differences: "
                f"{', '.join(changed)}; see its meta.json): give this run its own --work-dir, or run it with those "
                "settings"
            )


def check_run_folder(run_dir: Path, config: PipelineConfig) -> None:
    """Refuse to train into a run folder whose checkpoints belong to a run with other settings: resuming it would
    continue that run (or fail on its weights) and label the result with this command's settings. One message
    lists every setting that differs and the two ways out. A folder without checkpoints starts afresh."""
    from .checkpoints import CHECKPOINT_DIR

    path = run_dir / RUN_SETTINGS
    if not path.is_file() or not any((run_dir / CHECKPOINT_DIR).glob("step-*.pt")):
        return
    try:
        stored = json.loads(path.read_text())["settings"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is damaged: delete {run_dir} to train this run afresh, or give this run its own "
                         "--run-name") from None
    now = run_identity(config)
    changed = [option for option in dict.fromkeys([*stored, *now]) if stored.get(option) != now.get(option)]
    if changed:
        listed = "; ".join(f"{option} {stored.get(option, 'unset')} there, {now.get(option, 'unset')} now"
                           for option in changed)
        raise ValueError(
            f"the run folder {run_dir} holds a run with other settings ({listed}): it cannot be resumed with these. "
            f"Train this one as a new run with its own --run-name (or --work-dir), or resume that run with its own "
            f"settings (its command is in {path})"
        )


def stage_prompts(config: PipelineConfig, work: Path, settings: dict):
    """The prompt set, mixed and checked once, cached as prompts.jsonl with the settings that made it (written
    last: it marks the stage done). One run at a time builds it (a lock file)."""
    from .prompts import read_prompt_file
    from .records import exclusive

    path, settings_path = work / PROMPTS_FILE, work / PROMPT_SETTINGS
    if _stored_settings(settings_path) == settings:
        return read_prompt_file(path).prompts
    with exclusive(work / PROMPTS_LOCK, f"another run is preparing the prompts in {work}: wait for it to finish"):
        check_work_folder(work, settings)  # again: another run may have written its prompts since the first check
        if _stored_settings(settings_path) == settings:
            return read_prompt_file(path).prompts
        return _make_prompts(config, work, settings)


def _make_prompts(config: PipelineConfig, work: Path, settings: dict):
    from .decontaminate import EvalIndex, check_decontaminated, load_eval_sets, remove_overlaps
    from .prompts import mix_prompts, read_prompt_file, truncate_prompt, write_prompt_file
    from .sources import load_sources

    names = settings["sources"]
    files = [path.expanduser().resolve() for path in config.prompts]
    index = None if config.skip_eval_check else EvalIndex(load_eval_sets())
    prompts = []
    for file in files:
        read = read_prompt_file(file)
        if read.skipped:
            _say(f"{file}: skipped {len(read.skipped)} malformed line(s): "
                 + ", ".join(f"line {n} ({why})" for n, why in read.skipped[:10]))
        file_prompts = [truncate_prompt(p, config.max_prompt_chars) for p in read.prompts]
        if index is not None:
            check_decontaminated(file_prompts, index, name=str(file))
        prompts += file_prompts
    if names:
        pools = load_sources(names)
        if index is not None:
            for name in names:
                pools[name], overlaps = remove_overlaps(pools[name], index)
                if overlaps:
                    _say(f"source {name}: dropped {len(overlaps)} prompt(s) overlapping evaluation sets")
        proportions = {name: weight for name, weight in settings["proportions"].items() if name in names}
        prompts += mix_prompts(pools, proportions, config.num_prompts, seed=config.seed,
                               max_chars=config.max_prompt_chars)
    ids = Counter(p.id for p in prompts)
    repeated = [i for i, count in ids.items() if count > 1]
    if repeated:
        raise ValueError(f"prompt ids repeat across the prompt files: {repeated[:5]}: give each prompt a unique id")
    if not prompts:
        raise ValueError("the prompt set is empty: the prompt files hold no valid prompt")
    path, settings_path = work / PROMPTS_FILE, work / PROMPT_SETTINGS
    write_prompt_file(prompts, path)
    write_atomic(settings_path, json.dumps(settings, indent=2) + "\n")
    counts = Counter(p.source for p in prompts)
    _say(f"prompts: {len(prompts)} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) -> {path}")
    return prompts


def stage_labels(config: PipelineConfig, work: Path, model, tokenizer, prompts) -> None:
    """Target-written records for every prompt (each kind resumes on its own)."""
    if config.label_minutes == 0:
        _say("--label-minutes 0: training on the records as they are")
        return
    from .labels import label_responses
    from .regenerate import regenerate

    deadline = None if config.label_minutes is None else time.monotonic() + 60 * config.label_minutes
    for kind in config.label_kinds():
        folder = work / f"records-{kind}"
        time_limit = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if kind == "regenerate":
            stats = regenerate(model, tokenizer, prompts, folder, max_new_tokens=config.max_new_tokens,
                               temperature=config.temperature, top_k=config.store_top_k,
                               batch_size=config.data_batch_size, seed=config.seed, time_limit=time_limit)
        else:
            stats = label_responses(model, tokenizer, prompts, folder, max_response_tokens=config.max_new_tokens,
                                    top_k=config.store_top_k, batch_size=config.data_batch_size,
                                    time_limit=time_limit)
        _say(f"{kind}: {stats.written} new records, {stats.already_done} already done, "
             f"{stats.tokens_per_second:.0f} tokens/s -> {folder}")
        if stats.remaining:
            _say(f"{kind}: --label-minutes ran out with {stats.remaining} prompts left: training on the records so "
                 "far (run again to continue the labelling)")


def load_sequences(config: PipelineConfig, work: Path, prompts, tokenizer):
    """The records of the label stages for `prompts` as training sequences (ids prefixed by their kind), split
    into training and held-out sequences by a seeded hash. A record is used only when its prompt is the prompt of
    the set with its id, so records that are not of this prompt set (imported, or left by an earlier flashdraft
    that mixed prompt sets) are never trained on."""
    from .blocks import TrainingSequence
    from .prompts import encode_prompt
    from .records import read_records

    by_id = {prompt.id: prompt for prompt in prompts}
    sequences = []
    for kind in config.label_kinds():
        folder, outside = work / f"records-{kind}", 0
        for record in read_records(folder):
            prompt = by_id.get(record.id)
            if prompt is None:
                outside += 1
                continue
            if record.input_ids[: record.response_start] != encode_prompt(tokenizer, prompt):
                raise ValueError(
                    f"{folder} holds a record of prompt {record.id!r} made from another prompt text: the folder "
                    "mixes two prompt sets (an earlier flashdraft let that happen); delete it, or give this run its "
                    "own --work-dir"
                )
            record.id = f"{kind}/{record.id}"
            sequences.append(TrainingSequence.from_record(record, config.max_length))
        if outside:
            _say(f"{kind}: {outside} records of prompts outside this prompt set are left out")
    usable = [s for s in sequences if len(s.anchor_positions) > 0]
    if not usable:
        raise ValueError("no training record has a response of 2 tokens or more: the training set is empty")
    if config.heldout >= len(usable):
        raise ValueError(f"--heldout {config.heldout} leaves no training data out of {len(usable)} usable records")
    return split_heldout(usable, config.heldout, config.seed)


def split_heldout(sequences, count: int, seed: int):
    """(training, held-out): the held-out sequences are the `count` with the smallest seeded hash of their id, not
    a draw over all of them, so as the corpus grows a new record joins the held-out set only by displacing one and
    a record an earlier run trained on never becomes held out."""
    ranked = sorted((hashlib.sha256(f"{seed}:heldout:{s.id}".encode()).digest(), s.id) for s in sequences)
    heldout_ids = {sequence_id for _, sequence_id in ranked[:count]}
    return [s for s in sequences if s.id not in heldout_ids], [s for s in sequences if s.id in heldout_ids]


def data_counts(sequences) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for sequence in sequences:
        entry = counts.setdefault(sequence.source, {"sequences": 0, "tokens": 0})
        entry["sequences"] += 1
        entry["tokens"] += len(sequence) - sequence.response_start
    return dict(sorted(counts.items()))


def eval_prompt_sets(names: Sequence[str], count: int, tokenizer, heldout) -> dict[str, list[list[int]]]:
    """Token ids of the prompts to measure tau on, per set: the first `count` held-out records' prompts for
    HELDOUT_SET, the last `count` prompts of a built-in set or .jsonl file (the benchmark samples its first ones)."""
    from ..evaluation.datasets import get_dataset
    from ..text import encode_chat

    sets = {}
    for name in names:
        if name == HELDOUT_SET:
            sets[name] = [s.input_ids[: s.response_start].tolist() for s in heldout[:count]]
            continue
        samples = get_dataset(name).read()[-count:]
        sets[Path(name).stem if name.endswith(".jsonl") else name] = [
            encode_chat(tokenizer, sample.messages([])) for sample in samples
        ]
    return {name: prompts for name, prompts in sets.items() if prompts}


# ---------------------------------------------------------------------- the pipeline


def run_pipeline(config: PipelineConfig) -> TrainSummary | None:
    """Run the stages up to `config.until`, each cached in the work folder and resumed when run again, and write
    the kept draft to `config.output`. Returns the trainer's summary (None when stopping before the train stage).
    Everything that can be refused without running the target is refused before anything is written."""
    import torch

    from .distributed import cleanup, setup_distributed
    from .drafts import ensure_writable
    from .records import exclusive

    config = replace(config)  # parsed and checked again: a field may have been set after the config was made
    command = exact_command(config)
    train_config = config.train_config()
    if config.threads:
        torch.set_num_threads(config.threads)
    dist = setup_distributed(None if config.device == "auto" else config.device)
    distributed = dist.world_size > 1
    if distributed and config.until != "train":
        raise ValueError("under torchrun / accelerate launch only the train stage runs: run the data stages first "
                         "in one process with --until features")
    work = work_folder(config)
    output = config.output.expanduser().resolve()
    settings = None if distributed else prompt_settings(config)
    if config.init_draft is not None:  # read after the data stages: a damaged folder must fail before them
        from ..draft import check_draft_folder

        check_draft_folder(config.init_draft)
    if dist.is_main:
        if output.is_dir() and not (output / "config.json").is_file() and any(output.iterdir()):
            raise ValueError(f"{output} exists and is not a draft folder: choose an empty or new --output")
        if settings is not None:
            check_work_folder(work, settings)  # before anything is written
        ensure_writable(output, 200 << 20, "draft")
        ensure_writable(work, 1 << 30, "work folder")
    run_dir = work / "runs" / config.run_name
    # One command at a time trains a run folder (the data folders have locks of their own).
    lock = (exclusive(run_dir / ".lock", f"another run is training in {run_dir}: wait for it to finish, or give this "
                      "one another --run-name")
            if dist.is_main and config.until == "train" else nullcontext())
    try:
        with lock:
            if config.until == "train":
                check_run_folder(run_dir, config)  # before the target loads
            return _run_stages(config, command, train_config, dist, work, output, run_dir, settings)
    finally:
        cleanup()  # leaves the process group, when there is one


def _run_stages(config: PipelineConfig, command: str, train_config, dist, work: Path, output: Path, run_dir: Path,
                settings: dict | None) -> TrainSummary | None:
    """The stages, from loading the target to the written draft."""
    import torch

    from ..draft import DFlashDraftModel
    from ..models import load_target
    from ..rules import resolve_dtype
    from ..text import stop_token_ids
    from .corpus import response_counts
    from .distributed import barrier
    from .drafts import init_from_target, lineage, save_trained_draft, seed_everything, start_from_draft
    from .features import FeatureStore, OnlineFeatures, build_feature_store, engine_features_hint
    from .loss import DraftVocabulary, label_counts
    from .prompts import read_prompt_file
    from .trainer import Trainer

    dtype = resolve_dtype(config.dtype, dist.device.type)
    model, tokenizer = load_target(config.target, device=dist.device, dtype=dtype)
    if (hint := engine_features_hint(model)) is not None:
        _say(hint)
    text_config = model.config.get_text_config()
    layer_ids = _resolve_feature_layers(config.feature_layers, text_config.num_hidden_layers)
    mask_token_id = _mask_token_id(config, tokenizer, model.get_input_embeddings().weight.shape[0])

    distributed = dist.world_size > 1
    if not distributed:
        check_record_folders(config, work, model, tokenizer)  # before anything is written
        prompts = stage_prompts(config, work, settings)
        if config.until == "prompts":
            return None
        stage_labels(config, work, model, tokenizer, prompts)
        if config.until == "labels":
            return None
    else:
        if not (work / PROMPT_SETTINGS).is_file():
            raise ValueError(f"{work} holds no prompts: run the data stages first in one process with --until "
                             "features")
        prompts = read_prompt_file(work / PROMPTS_FILE).prompts
    sequences, heldout = load_sequences(config, work, prompts, tokenizer)
    if config.features == "offline":
        key = _digest({"layers": layer_ids, "dtype": config.feature_dtype, "target": config.target,
                       "sequences": sorted((s.id, len(s)) for s in sequences + heldout)})
        folder = work / f"features-{key}"
        if not distributed:  # stores made for fewer records seed this one: the corpus only grows
            older = sorted(set(work.glob("features-*")) - {folder})
            build_feature_store(model, sequences + heldout, folder, layer_ids, dtype=config.feature_dtype,
                                batch_size=config.data_batch_size, reuse=older)
        features = FeatureStore(folder)
    else:
        features = OnlineFeatures(model, layer_ids)
    if config.until == "features":
        return None

    seed_everything(config.training_seed)  # the draft's random initialisation (e.g. fc) is part of a reproducible run
    draft = DFlashDraftModel.for_target(model.config, num_layers=config.draft_layers, block_size=config.block_size,
                                        mask_token_id=mask_token_id, target_layer_ids=layer_ids)
    earlier_runs = []  # the runs behind --init-draft, read now: a damaged training.json fails before training
    if config.init_draft:
        start = DFlashDraftModel.from_pretrained(config.init_draft)
        earlier_runs = lineage(config.init_draft)
        (layers, *others), (wanted, *asked) = _draft_shape(start), _draft_shape(draft)
        if others != asked or layers > wanted:
            raise ValueError(
                f"--init-draft {config.init_draft} has (layers, feature layers, mask token) "
                f"{_draft_shape(start)} but the options ask for {_draft_shape(draft)}: give matching --feature-layers "
                "and --mask-token-id, and --draft-layers at least the earlier draft's"
            )
        if layers < wanted and config.init_from_target:
            init_from_target(draft, model)  # the added layers' weights, but for their zeroed outputs
        # The drafting vocabulary is chosen again from this run's data; added layers start silent.
        if start_from_draft(draft, start):
            _say(f"grew the draft from {layers} to {wanted} layers: the added ones start from "
                 f"{'the target' if config.init_from_target else 'random weights'}, their outputs at zero")
    elif config.init_from_target:
        init_from_target(draft, model)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    vocabulary = None
    if config.draft_vocab_size and vocab_size > 2 * config.draft_vocab_size:
        if config.draft_vocab_corpus is None:
            vocabulary, coverage = DraftVocabulary.most_frequent(sequences, config.draft_vocab_size, vocab_size)
            source = ""
        else:
            # The corpus grows between sessions: a run keeps the vocabulary it chose first, so that it can resume.
            chosen = run_dir / DRAFT_VOCAB_FILE
            if chosen.is_file():
                vocabulary = DraftVocabulary.from_ids(json.loads(chosen.read_text()), vocab_size)
            else:
                counts = response_counts(config.draft_vocab_corpus, vocab_size, exclude={s.id for s in heldout})
                vocabulary = DraftVocabulary.from_counts(torch.from_numpy(counts), config.draft_vocab_size)
                if dist.is_main:
                    write_atomic(chosen, json.dumps(vocabulary.ids.tolist()) + "\n")
            coverage = vocabulary.coverage(label_counts(sequences, vocab_size))
            source = f" (chosen from {config.draft_vocab_corpus})"
        _say(f"drafting vocabulary{source}: {len(vocabulary)} tokens cover {coverage:.1%} of the training labels")
    trainer = Trainer(
        draft, model, sequences, features, run_dir, train_config, vocabulary=vocabulary,
        heldout=heldout, eval_prompts=eval_prompt_sets(config.eval_sets, config.eval_prompts, tokenizer, heldout),
        stop_token_ids=stop_token_ids(model, tokenizer), distributed=dist,
    )
    if dist.is_main:  # the run in this folder is now this command's: a later command must match it to resume it
        write_atomic(run_dir / RUN_SETTINGS, json.dumps({"settings": run_identity(config), "command": command},
                                                        indent=2) + "\n")
    summary = trainer.train()
    if dist.is_main:
        counts = data_counts(sequences)
        kinds = {"regenerate": "the target's own greedy responses" if config.temperature == 0 else
                 f"the target's own responses sampled at temperature {config.temperature}",
                 "teacher-forced": "the target's greedy predictions over existing responses (teacher forcing)"}
        card = {
            "target": config.target,
            "data": counts,
            "labels": "; ".join(kinds[kind] for kind in config.label_kinds()),
            "settings": {"feature storage": config.features, "anchors per sequence": config.num_anchors,
                         "gamma": trainer.gamma, "loss weights": config.loss_weights,
                         "distillation weight": config.distill_weight,
                         "global batch (sequences)": trainer.global_batch, "peak learning rate": config.learning_rate},
            "command": command,
        }
        if earlier_runs:
            card["runs"] = earlier_runs
        folder = save_trained_draft(trainer.kept_draft(), output, summary, card)
        taus = ", ".join(f"{k} {v:.2f}" for k, v in (summary.best or {}).get("tau", {}).items())
        _say(f"draft written to {folder} (steps {summary.steps}, {summary.seconds / 60:.1f} min"
             + (f", tau {taus})" if taus else ")"))
    barrier()
    return summary
