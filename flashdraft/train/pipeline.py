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

`PipelineConfig` is the one place the training settings and their defaults live: `flashdraft train` makes one
option per field (flag, default and help read from the field), `TrainConfig` and the data stages take their
defaults from it, and `exact_command` writes a config as the command line that reproduces it. Errors name a
setting by its option (`--store-top-k` is the field `store_top_k`), since most runs start from the command line.

This module loads nothing heavy at import (the command line reads the fields to build its parser); the stages
import torch and the models when they run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..evaluation.datasets import DATASETS
from ..files import write_atomic
from ..models import DEFAULT_TARGET
from .prompts import PROMPT_SETTINGS, PROMPTS_FILE
from .sources import DEFAULT_PROPORTIONS, SOURCES

if TYPE_CHECKING:
    from .trainer import TrainConfig, TrainSummary

STAGES = ("prompts", "labels", "features", "train")
PROMPTS_LOCK = ".prompts.lock"
LABEL_KINDS = ("regenerate", "teacher-forced")
LOSS_WEIGHTINGS = ("decay", "acceptance")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
HELDOUT_SET = "heldout"
DRAFT_VOCAB_FILE = "draft_vocab_ids.json"  # in the run folder: the vocabulary a --draft-vocab-corpus run chose


def setting(default: Any = MISSING, help: str = "", *, shown: str | None = None, **cli) -> Any:
    """A field of `PipelineConfig` with what its command-line option needs: `help` says what it does and the
    option's help appends the default (or `shown`, where the value alone does not say it; "{}" stands for the
    value); `cli` may give `type` (of the option's text, when the default's type is not it), `choices`, `short`
    (e.g. -o), `repeat` (the option may be given several times) and `metavar`."""
    metadata = {"help": help, "shown": shown, **cli}
    if isinstance(default, dict | list):  # mutable: every config gets its own copy
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class PipelineConfig:
    """Every setting of a training run, with its default: `flashdraft train`'s options are these fields (a field
    `store_top_k` is the option `--store-top-k`). Text values are accepted where the command line gives text
    (e.g. `feature_layers="1,8,14"`, `proportions="math=1"`); the config holds them parsed."""

    # target and draft
    target: str = setting(DEFAULT_TARGET, "registry name, folder or hub id of the target")
    output: Path = setting(help="folder to write the trained draft and its model card into", type=Path, short="-o")
    work_dir: Path | None = setting(
        None, "folder for the cached stages and checkpoints; keep it outside the repository",
        shown="$FLASHDRAFT_HOME/train/TARGET", type=Path)
    run_name: str = setting(
        "default", "name of the training run inside the work folder; a run resumes from its last checkpoint, so "
        "give a new name to train with other settings")
    draft_layers: int = setting(2, "decoder layers of the draft")
    block_size: int = setting(16, "tokens per block, anchor included; train at the block size you decode with")
    feature_layers: int | tuple[int, ...] = setting(
        5, "target layers the draft reads: a comma list (e.g. 1,8,14,20,27) or a count spread evenly from layer 1 "
        "to the fourth-last", type=str)
    mask_token_id: int | None = setting(
        None, "token id of the block's mask positions: a special token that never occurs in text",
        shown="the registry's choice for registry targets, else the tokenizer's mask token", type=int)
    draft_vocab_size: int = setting(
        8192, "draft over the N tokens most frequent in the target's outputs (the loss and the drafting head use "
        "only those rows; the ids are saved with the draft); 0 = the full vocabulary",
        shown="{}, or the full vocabulary when it is not larger than twice that")
    draft_vocab_corpus: Path | None = setting(
        None, "choose the drafting vocabulary from the answers of this corpus folder (e.g. corpus/TARGET of the "
        "repository), less this run's held-out records, instead of from this run's training labels: a larger sample "
        "when the run trains on a draw of the corpus", type=Path)
    # Off since an A/B at equal steps from scratch (BENCHMARKS.md, "The recipe A/B on the draft's initialisation"):
    # random layers reached held-out tau 1.30 after 300 steps, layers copied from the target 1.21.
    init_from_target: bool = setting(
        False, "start the draft's layers from the target's last layers where shapes match (off: random layers, "
        "which trained faster in an A/B)")
    init_draft: Path | None = setting(
        None, "start from the weights of this draft folder instead (e.g. to continue on more data under a new "
        "--run-name); its layers, feature layers and mask token must match the options (the block size may differ: "
        "no weight depends on it)", type=Path)
    device: str = setting(
        "auto", "torch device", shown="auto = this process's GPU (cuda:LOCAL_RANK) when there is one, else the CPU",
        type=str)
    dtype: str = setting(
        "auto", "target weights' dtype; the draft trains in float32 under autocast when this is lower",
        shown="auto = bfloat16 on a GPU, float32 on a CPU", choices=("auto", "float32", "bfloat16", "float16"))
    compute_dtype: str = setting(
        "auto", "precision of the draft's training passes (autocast: its weights, the optimizer and the evaluation's "
        "decoding stay in float32); bfloat16 trains ~1.6x faster on a CPU with native bfloat16 instructions "
        "(avx512_bf16 or AMX) at the same loss, and is slower where they are emulated",
        shown="auto = the target weights' dtype", choices=COMPUTE_DTYPES)
    threads: int | None = setting(
        None, "torch CPU threads; on a CPU shared with other jobs use 1, or set OMP_WAIT_POLICY=PASSIVE in the "
        "environment: spinning threads can make training several times slower",
        shown="torch's choice, one per core", type=int)
    until: str = setting("train", "stop after this stage", shown="{}, the whole pipeline", choices=STAGES)

    # prompts
    prompts: tuple[Path, ...] = setting(
        (), "JSONL prompt file, one {\"messages\": [...]} or {\"prompt\": \"...\"} per line, optionally with a "
        "\"response\"; repeatable. A file that overlaps an evaluation set is refused",
        shown="", type=Path, repeat=True, metavar="FILE")
    sources: tuple[str, ...] | None = setting(
        None, f"built-in prompt sources to mix, comma separated, among {', '.join(SOURCES)}, or 'none'",
        shown="all of them without --prompts, none with it", type=str)
    proportions: dict[str, float] = setting(
        DEFAULT_PROPORTIONS, "mix of the built-in sources as name=weight pairs", type=str)
    num_prompts: int = setting(1000, "prompts drawn from the built-in sources")
    max_prompt_chars: int = setting(
        3000, "cut longer prompt messages (and responses) to this many characters rather than dropping them")
    skip_eval_check: bool = setting(
        False, "do not check prompts against the evaluation sets (for machines without the evaluation packages; "
        "the benchmark figures of such a draft may be contaminated)", shown="")

    # target-written data
    labels: str = setting(
        "regenerate", "regenerate: the target answers every prompt (the published recipe); teacher-forced: the "
        "target's greedy prediction at each position of the prompts' existing responses, at the cost of one forward "
        "(several times faster; prompts without a response are skipped); both", choices=(*LABEL_KINDS, "both"))
    max_new_tokens: int = setting(256, "longest regenerated or labelled response, in tokens")
    temperature: float = setting(0.0, "regeneration temperature; 0 = greedy")
    store_top_k: int = setting(
        0, "store the target's K most probable tokens and their probabilities at every response position, for "
        "--distill-weight; 0 = none")
    label_minutes: float | None = setting(
        None, "spend at most this many minutes writing labels in this run, then train on the records written so far "
        "(a later run continues the labelling; 0 = train on what exists)", shown="no limit", type=float)
    data_batch_size: int = setting(8, "prompts per target batch in regeneration, labelling and feature extraction")

    # features
    features: str = setting(
        "offline", "offline: run the target once over the data and store the features on disk for every epoch; "
        "online: run it in every training step (no disk, for a single epoch or a fast GPU)",
        choices=("offline", "online"))
    feature_dtype: str = setting(
        "float16", "storage dtype of offline features", shown="{}, 2 bytes per value",
        choices=("float16", "bfloat16", "float32"))
    max_length: int = setting(2048, "truncate training sequences to this many tokens")

    # training
    epochs: int = setting(3, "passes over the training sequences")
    max_steps: int | None = setting(None, "optimizer steps, overriding --epochs", type=int)
    num_anchors: int = setting(64, "random blocks per sequence, redrawn every epoch")
    gamma: float | None = setting(
        None, "loss weight decay over block positions, exp(-(k-1)/gamma)", shown="7 at block 16, 4 at block 8",
        type=float)
    loss_weights: str = setting(
        "decay", "how the loss weighs block positions: decay = exp(-(k-1)/gamma); acceptance = by what each position "
        "adds to the expected accepted length under the draft's running per-position accuracy (later positions "
        "count as far as the earlier ones are accepted; floored at 0.05)", choices=LOSS_WEIGHTINGS)
    lr: float = setting(6e-4, "peak AdamW learning rate")
    warmup_ratio: float = setting(0.04, "share of the steps with a linear warmup")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    batch_size: int = setting(1, "sequences per micro-batch in each process")
    grad_accum: int = setting(4, "micro-batches per optimizer step")
    max_grad_norm: float = setting(1.0, "gradient clipping norm")
    distill_weight: float = setting(
        0.0, "0: hard labels; 1: cross-entropy to the target's stored top-k probabilities (needs --store-top-k); "
        "between: a mix")
    loss_chunk: int = setting(1024, "block positions per pass through the output head; bounds the logits' memory")
    checkpoint_every: int = setting(200, "steps between checkpoints")
    keep_checkpoints: int = setting(2, "newest checkpoints kept")
    eval_every: int = setting(
        500, "steps between evaluations of tau (greedy decoding replayed on the target's answers); 0 = at the end "
        "only")
    eval_sets: tuple[str, ...] = setting(
        (HELDOUT_SET,), f"prompt sets to measure tau on, comma separated: {HELDOUT_SET} (prompts of held-out "
        f"records), built-in {', '.join(DATASETS)} (their last prompts, apart from the usual benchmark samples), or "
        ".jsonl files; the draft with the best mean tau is kept", type=str)
    eval_prompts: int = setting(16, "prompts per evaluation set")
    eval_max_new_tokens: int = setting(128, "length of the target's answer to each evaluation prompt, written once")
    heldout: int = setting(
        16, "records kept out of training for held-out loss, accuracy and the heldout prompt set")
    seed: int = setting(0, "seed of the prompt mix, the held-out split and (without --train-seed) the training")
    train_seed: int | None = setting(
        None, "seed of the training alone: the draft's initialisation, anchors and data order; the prompt mix and "
        "the held-out split keep --seed, so a replicate trains in the same work folder on the same data",
        shown="--seed", type=int)

    def __post_init__(self):
        # The command line's text forms, parsed; then every check that needs no model, so that a bad setting fails
        # here rather than after the target has loaded.
        self.output = Path(self.output)
        self.work_dir = None if self.work_dir is None else Path(self.work_dir)
        self.init_draft = None if self.init_draft is None else Path(self.init_draft)
        self.draft_vocab_corpus = None if self.draft_vocab_corpus is None else Path(self.draft_vocab_corpus)
        from .corpus import MANIFEST  # imports numpy: not at the top, where the parser reads this

        if self.draft_vocab_corpus is not None and not (self.draft_vocab_corpus / MANIFEST).is_file():
            raise ValueError(f"--draft-vocab-corpus {self.draft_vocab_corpus} holds no corpus (no {MANIFEST}): "
                             "give a corpus folder, e.g. corpus/TARGET of the repository")
        files = [self.prompts] if isinstance(self.prompts, str | Path) else self.prompts
        self.prompts = tuple(Path(file) for file in files)
        self.feature_layers = _parse_feature_layers(self.feature_layers)
        if self.sources is not None:
            none = isinstance(self.sources, str) and self.sources.strip() == "none"
            self.sources = () if none else _comma_list(self.sources)
        self.proportions = _parse_proportions(self.proportions)
        self.eval_sets = _comma_list(self.eval_sets)
        for item in fields(self):
            choices = item.metadata.get("choices")
            if choices and getattr(self, item.name) not in choices:
                raise ValueError(f"{_flag(item)} must be one of {', '.join(choices)}, got {getattr(self, item.name)!r}")
        from .blocks import check_training_block_size  # imports torch: not at the top, where the parser reads this

        check_training_block_size(self.block_size)
        if self.draft_layers < 1:
            raise ValueError(f"--draft-layers must be at least 1, got {self.draft_layers}")
        if self.distill_weight > 0 and self.store_top_k <= 0:
            raise ValueError("--distill-weight needs the target's top-k probabilities: add --store-top-k K (e.g. 8)")
        if self.label_minutes is not None and self.label_minutes < 0:
            raise ValueError(f"--label-minutes must be >= 0, got {self.label_minutes}")
        unknown = [name for name in self.sources or () if name not in SOURCES]
        if unknown:
            raise ValueError(f"unknown prompt sources {unknown}: choose among {', '.join(SOURCES)}, or 'none'")
        if not self.source_names() and not self.prompts:
            raise ValueError("no prompts: give --prompts FILE and/or --sources")
        self.train_config()  # its own checks

    def source_names(self) -> tuple[str, ...]:
        """The built-in sources to mix: all of them without prompt files, none with them, unless given."""
        if self.sources is not None:
            return self.sources
        return () if self.prompts else tuple(SOURCES)

    def label_kinds(self) -> list[str]:
        return list(LABEL_KINDS) if self.labels == "both" else [self.labels]

    @property
    def training_seed(self) -> int:
        return self.seed if self.train_seed is None else self.train_seed

    def train_config(self) -> TrainConfig:
        """The trainer's settings (it checks them)."""
        from .trainer import TrainConfig

        return TrainConfig(
            num_anchors=self.num_anchors, gamma=self.gamma, loss_weights=self.loss_weights, learning_rate=self.lr,
            warmup_ratio=self.warmup_ratio, weight_decay=self.weight_decay, epochs=self.epochs,
            max_steps=self.max_steps, batch_size=self.batch_size,
            grad_accum=self.grad_accum, max_grad_norm=self.max_grad_norm, distill_weight=self.distill_weight,
            loss_chunk=self.loss_chunk, checkpoint_every=self.checkpoint_every,
            keep_checkpoints=self.keep_checkpoints, eval_every=self.eval_every,
            eval_max_new_tokens=self.eval_max_new_tokens, seed=self.training_seed, compute_dtype=self.compute_dtype,
        )


# ---------------------------------------------------------------------- settings as text


def _comma_list(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(filter(None, (part.strip() for part in value.split(","))))
    return tuple(value)


def _parse_feature_layers(value: int | str | Sequence[int]) -> int | tuple[int, ...]:
    """A count (an int, or text without a comma) or a list of layer ids (a sequence, or a comma list)."""
    if isinstance(value, str):
        try:
            values = [int(part) for part in value.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--feature-layers takes a count or a comma list of layer ids, got {value!r}") from None
        value = values[0] if len(values) == 1 and "," not in value else tuple(values)
    if isinstance(value, int) and value < 1:
        raise ValueError(f"--feature-layers count must be at least 1, got {value}")
    return value if isinstance(value, int) else tuple(value)


def _parse_proportions(value: str | Mapping[str, float]) -> dict[str, float]:
    if not isinstance(value, str):
        return {name: float(weight) for name, weight in value.items()}
    proportions = {}
    for item in _comma_list(value):
        name, _, weight = item.partition("=")
        try:
            proportions[name.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"--proportions takes name=weight pairs, got {item!r}") from None
    return proportions


def _flag(item: Field) -> str:
    return "--" + item.name.replace("_", "-")


def default_of(item: Field) -> Any:
    """A field's default (MISSING for a required one)."""
    return item.default_factory() if item.default_factory is not MISSING else item.default


def format_setting(value: Any) -> str:
    """A setting as its option writes it (the inverse of the parsing in `PipelineConfig`)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Path):
        return str(value.expanduser().resolve())  # the command reproduces the run from any folder
    if isinstance(value, Mapping):
        return ",".join(f"{name}={weight}" for name, weight in value.items())
    if isinstance(value, tuple):
        one_layer = len(value) == 1 and isinstance(value[0], int)
        return ",".join(map(str, value)) + ("," if one_layer else "")  # "3," is layer 3, "3" would be a count
    return str(value)


def option_words(item: Field, value: Any) -> list[str]:
    """The command-line words that set field `item` to `value`."""
    flag = _flag(item)
    if value is None:
        return []  # the option's own default (None) stands for it
    if isinstance(value, bool):
        if default_of(item) is True:
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if item.metadata.get("repeat"):
        return [word for each in value for word in (flag, format_setting(each))]
    return [flag, format_setting(value)]


def exact_command(config: PipelineConfig) -> str:
    """`flashdraft train` with every setting of `config` spelled out, defaults included: it reproduces the run."""
    words = ["flashdraft", "train"]
    for item in fields(config):
        words += option_words(item, getattr(config, item.name))
    return shlex.join(words)


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
    from ..models import cache_home

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
    """Refuse, before anything is written, record folders made with other label settings."""
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


def eval_prompt_sets(config: PipelineConfig, tokenizer, heldout) -> dict[str, list[list[int]]]:
    """Token ids of the prompts to measure tau on, per set."""
    from ..evaluation.datasets import get_dataset
    from ..text import encode_chat

    sets = {}
    for name in config.eval_sets:
        if name == HELDOUT_SET:
            sets[name] = [s.input_ids[: s.response_start].tolist() for s in heldout[: config.eval_prompts]]
            continue
        samples = get_dataset(name).read()[-config.eval_prompts :]
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
    from .records import exclusive
    from .trainer import ensure_writable

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
    from .features import FeatureStore, OnlineFeatures, build_feature_store
    from .loss import DraftVocabulary, label_counts
    from .prompts import read_prompt_file
    from .trainer import Trainer, init_from_target, save_trained_draft, seed_everything, start_from_draft

    dtype = resolve_dtype(config.dtype, dist.device.type)
    model, tokenizer = load_target(config.target, device=dist.device, dtype=dtype)
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
    if config.init_draft:
        start = DFlashDraftModel.from_pretrained(config.init_draft)
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
        heldout=heldout, eval_prompts=eval_prompt_sets(config, tokenizer, heldout),
        stop_token_ids=stop_token_ids(model, tokenizer), distributed=dist,
    )
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
                         "global batch (sequences)": trainer.global_batch, "peak learning rate": config.lr},
            "command": command,
        }
        folder = save_trained_draft(trainer.kept_draft(), output, summary, card)
        taus = ", ".join(f"{k} {v:.2f}" for k, v in (summary.best or {}).get("tau", {}).items())
        _say(f"draft written to {folder} (steps {summary.steps}, {summary.seconds / 60:.1f} min"
             + (f", tau {taus})" if taus else ")"))
    barrier()
    return summary
