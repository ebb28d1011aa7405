"""The settings of a training run, each with its one default and its help: `TrainConfig` (the trainer's) and
`PipelineConfig`, which inherits the trainer's fields and adds the data stages' (`pipeline.py`).

`flashdraft train` makes one option per field of `PipelineConfig` (flag, default and help read from the field,
grouped as `option_groups` says), the data stages take their defaults from it, and `exact_command` writes a config
as the command line that reproduces it. Errors name a setting by its option (`--store-top-k` is the field
`store_top_k`), since most runs start from the command line.

This module loads nothing heavy at import (the command line reads the fields to build its parser).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..evaluation.datasets import DATASETS
from ..models import DEFAULT_TARGET
from .sources import DEFAULT_PROPORTIONS, DEFAULT_SOURCES, SOURCES

STAGES = ("prompts", "labels", "features", "train")
LABEL_KINDS = ("regenerate", "teacher-forced")
LOSS_WEIGHTINGS = ("decay", "acceptance")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
HELDOUT_SET = "heldout"


def check_prompt_sets(names) -> None:
    """Fail, naming the problem, on a prompt set to measure tau on that cannot be read (an unknown name, a missing
    data package or .jsonl file), before anything slow runs; HELDOUT_SET is the corpus's own."""
    from ..evaluation.datasets import get_dataset

    for name in names:
        if name != HELDOUT_SET:
            get_dataset(name).read()


# The help groups of `flashdraft train`, in order; a field's `group` opens one (see `option_groups`).
OPTION_GROUPS = ("target and draft", "prompts", "target-written data", "features", "training", "evaluation", "seeds")


def setting(default: Any = MISSING, help: str = "", *, shown: str | None = None, **cli) -> Any:
    """A field of `PipelineConfig` with what its command-line option needs: `help` says what it does and the
    option's help appends the default (or `shown`, where the value alone does not say it; "{}" stands for the
    value); `cli` may give `type` (of the option's text, when the default's type is not it), `choices`, `short`
    (e.g. -o), `flag` (the option's name, when not the field's), `group` (the help group this
    field opens, `OPTION_GROUPS`), `repeat` (the option may be given several times), `metavar`, and
    `result=False` for a setting that changes how a run goes but not what it trains (where files go, threads,
    checkpoint cadence): every other setting is part of the run's identity (`run_identity`). A number's range:
    `at_least` (inclusive) or `above` (exclusive), checked by `check_ranges` before any model loads."""
    metadata = {"help": help, "shown": shown, **cli}
    if isinstance(default, dict | list):  # mutable: every config gets its own copy
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class TrainConfig:
    """The trainer's settings (optimisation, checkpoints, evaluation), each with its one default; the model shape
    lives in the draft's config. `PipelineConfig` inherits these fields, so `flashdraft train` has an option for
    each (`learning_rate` is `--lr`) and the trainer alone trains as the command does."""

    epochs: int = setting(3, "passes over the training sequences", group="training", at_least=1)
    max_steps: int | None = setting(None, "optimizer steps, overriding --epochs", type=int, at_least=1)
    num_anchors: int = setting(64, "random blocks per sequence, redrawn every epoch", at_least=1)
    gamma: float | None = setting(
        None, "loss weight decay over block positions, exp(-(k-1)/gamma)", shown="7 at block 16, 4 at block 8",
        type=float, above=0)
    loss_weights: str = setting(
        "decay", "how the loss weighs block positions: decay = exp(-(k-1)/gamma); acceptance = by what each position "
        "adds to the expected accepted length under the draft's running per-position accuracy (later positions "
        "count as far as the earlier ones are accepted; floored at 0.05)", choices=LOSS_WEIGHTINGS)
    learning_rate: float = setting(6e-4, "peak AdamW learning rate", flag="--lr", above=0)
    warmup_ratio: float = setting(0.04, "share of the steps with a linear warmup")
    weight_decay: float = setting(0.0, "AdamW weight decay", at_least=0)
    batch_size: int = setting(1, "sequences per micro-batch in each process", at_least=1)
    grad_accum: int = setting(4, "micro-batches per optimizer step", at_least=1)
    max_grad_norm: float = setting(1.0, "gradient clipping norm", above=0)
    distill_weight: float = setting(
        0.0, "0: hard labels; 1: cross-entropy to the target's stored top-k probabilities (needs --store-top-k); "
        "between: a mix")
    loss_chunk: int = setting(1024, "block positions per pass through the output head; bounds the logits' memory",
                              result=False, at_least=1)
    compute_dtype: str = setting(
        "auto", "precision of the draft's training passes (autocast: its weights, the optimizer and the evaluation's "
        "decoding stay in float32); bfloat16 trains ~1.6x faster on a CPU with native bfloat16 instructions "
        "(avx512_bf16 or AMX) at the same loss, and is slower where they are emulated",
        shown="auto = the target weights' dtype", choices=COMPUTE_DTYPES)
    checkpoint_every: int = setting(200, "steps between checkpoints", result=False, at_least=1)
    keep_checkpoints: int = setting(2, "newest checkpoints kept", result=False, at_least=1)
    log_every: int = setting(10, "steps between lines of the run's metrics.jsonl", result=False, at_least=1)
    eval_every: int = setting(
        500, "steps between evaluations of tau (greedy decoding replayed on the target's answers); 0 = at the end "
        "only", group="evaluation", at_least=0)
    eval_max_new_tokens: int = setting(128, "length of the target's answer to each evaluation prompt, written once",
                                       at_least=1)
    seed: int = setting(
        0, "seed of the training (the draft's initialisation, anchors and data order); in `flashdraft train` also of "
        "the prompt mix and the held-out split, unless --train-seed gives the training its own", group="seeds",
        at_least=0)

    def __post_init__(self):
        check_ranges(self)
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.loss_weights not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weights must be one of {', '.join(LOSS_WEIGHTINGS)}, got {self.loss_weights!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, not {self.compute_dtype!r}")
        if not 0 <= self.distill_weight <= 1:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")


@dataclass(kw_only=True)
class PipelineConfig(TrainConfig):
    """Every setting of a training run, with its default: the trainer's (`TrainConfig`, inherited as they are) and
    the data stages'. `flashdraft train`'s options are these fields (a field `store_top_k` is the option
    `--store-top-k`). Text values are accepted where the command line gives text
    (e.g. `feature_layers="1,8,14"`, `proportions="math=1"`); the config holds them parsed."""

    # target and draft
    target: str = setting(DEFAULT_TARGET, "registry name, folder or hub id of the target")
    output: Path = setting(help="folder to write the trained draft and its model card into", type=Path, short="-o",
                           result=False)
    work_dir: Path | None = setting(
        None, "folder for the cached stages and checkpoints; keep it outside the repository",
        shown="$FLASHDRAFT_HOME/train/TARGET", type=Path, result=False)
    run_name: str = setting(
        "default", "name of the training run inside the work folder; a run resumes from its last checkpoint, so "
        "give a new name to train with other settings", result=False)
    draft_layers: int = setting(2, "decoder layers of the draft", at_least=1)
    block_size: int = setting(16, "tokens per block, anchor included; train at the block size you decode with")
    feature_layers: int | tuple[int, ...] = setting(
        5, "target layers the draft reads: a comma list (e.g. 1,8,14,20,27) or a count spread evenly from layer 1 "
        "to the fourth-last", type=str)
    mask_token_id: int | None = setting(
        None, "token id of the block's mask positions: a special token that never occurs in text",
        shown="the registry's choice for registry targets, else the tokenizer's mask token", type=int, at_least=0)
    draft_vocab_size: int = setting(
        8192, "draft over the N tokens most frequent in the target's outputs (the loss and the drafting head use "
        "only those rows; the ids are saved with the draft); 0 = the full vocabulary",
        shown="{}, or the full vocabulary when it is not larger than twice that", at_least=0)
    draft_vocab_corpus: Path | None = setting(
        None, "choose the drafting vocabulary from the answers of this corpus folder (e.g. corpus/TARGET of the "
        "repository), less this run's held-out records, instead of from this run's training labels: a larger sample "
        "when the run trains on a draw of the corpus; with --corpus, a continued draft's vocabulary is chosen again "
        "so (else it keeps --init-draft's)", type=Path)
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
        type=str, result=False)
    dtype: str = setting(
        "auto", "target weights' dtype; the draft trains in float32 under autocast when this is lower",
        shown="auto = bfloat16 on a GPU, float32 on a CPU", choices=("auto", "float32", "bfloat16", "float16"))
    threads: int | None = setting(
        None, "torch CPU threads; on a CPU shared with other jobs use 1, or set OMP_WAIT_POLICY=PASSIVE in the "
        "environment: spinning threads can make training several times slower",
        shown="torch's choice, one per core", type=int, result=False, at_least=1)
    until: str = setting("train", "stop after this stage", shown="{}, the whole pipeline", choices=STAGES,
                         result=False)

    # prompts
    prompts: tuple[Path, ...] = setting(
        (), "JSONL prompt file, one {\"messages\": [...]} or {\"prompt\": \"...\"} per line, optionally with a "
        "\"response\"; repeatable. A file that overlaps an evaluation set is refused",
        shown="", type=Path, repeat=True, metavar="FILE", group="prompts")
    sources: tuple[str, ...] | None = setting(
        None, f"built-in prompt sources to mix, comma separated, among {', '.join(SOURCES)}, or 'none'",
        shown=f"{','.join(DEFAULT_SOURCES)} without --prompts, none with it", type=str)
    proportions: dict[str, float] = setting(
        DEFAULT_PROPORTIONS, "mix of the built-in sources as name=weight pairs", type=str)
    num_prompts: int = setting(1000, "prompts drawn from the built-in sources", at_least=1)
    max_prompt_chars: int = setting(
        3000, "cut longer prompt messages (and responses) to this many characters rather than dropping them",
        at_least=1)
    skip_eval_check: bool = setting(
        False, "do not check prompts against the evaluation sets (for machines without the evaluation packages; "
        "the benchmark figures of such a draft may be contaminated)", shown="")

    # target-written data
    labels: str = setting(
        "regenerate", "regenerate: the target answers every prompt (the published recipe); teacher-forced: the "
        "target's greedy prediction at each position of the prompts' existing responses, at the cost of one forward "
        "(several times faster; prompts without a response are skipped); both",
        choices=(*LABEL_KINDS, "both"), group="target-written data")
    max_new_tokens: int = setting(256, "longest regenerated or labelled response, in tokens", at_least=1)
    temperature: float = setting(0.0, "regeneration temperature; 0 = greedy", at_least=0)
    store_top_k: int = setting(
        0, "store the target's K most probable tokens and their probabilities at every response position, for "
        "--distill-weight; 0 = none", at_least=0)
    label_minutes: float | None = setting(
        None, "spend at most this many minutes writing labels in this run, then train on the records written so far "
        "(a later run continues the labelling; 0 = train on what exists)", shown="no limit", type=float,
        result=False, at_least=0)  # the records it leaves are part of the run's data, which the trainer checks
    data_batch_size: int = setting(8, "prompts per target batch in regeneration, labelling and feature extraction",
                                   result=False, at_least=1)

    # features
    features: str = setting(
        "offline", "offline: run the target once over the data and store the features on disk for every epoch; "
        "online: run it in every training step (no disk, for a single epoch or a fast GPU)",
        choices=("offline", "online"), group="features")
    feature_dtype: str = setting(
        "float16", "storage dtype of offline features", shown="{}, 2 bytes per value",
        choices=("float16", "bfloat16", "float32"))
    max_length: int = setting(2048, "truncate training sequences to this many tokens", at_least=1)

    # evaluation and seeds (the trainer's own are inherited)
    eval_sets: tuple[str, ...] = setting(
        (HELDOUT_SET,), f"prompt sets to measure tau on, comma separated: {HELDOUT_SET} (prompts of held-out "
        f"records), built-in {', '.join(DATASETS)} (their last prompts, apart from the usual benchmark samples), or "
        ".jsonl files; the draft with the best mean tau is kept", type=str, group="evaluation")
    eval_prompts: int = setting(16, "prompts per evaluation set", at_least=1)
    heldout: int = setting(
        16, "records kept out of training for held-out loss, accuracy and the heldout prompt set", at_least=1)
    train_seed: int | None = setting(
        None, "seed of the training alone: the draft's initialisation, anchors and data order; the prompt mix and "
        "the held-out split keep --seed, so a replicate trains in the same work folder on the same data",
        shown="--seed", type=int, group="seeds", at_least=0)

    def __post_init__(self):
        # The command line's text forms, parsed; then every check that needs no model, so that a bad setting fails
        # here rather than after the target has loaded.
        self.output = Path(self.output)
        self.work_dir = None if self.work_dir is None else Path(self.work_dir)
        self.init_draft = None if self.init_draft is None else Path(self.init_draft)
        self.draft_vocab_corpus = None if self.draft_vocab_corpus is None else Path(self.draft_vocab_corpus)
        from .corpus import check_corpus_folder  # imports numpy: not at the top, where the parser reads this

        if self.init_draft is not None and not (self.init_draft / "config.json").is_file():
            raise ValueError(f"--init-draft {self.init_draft} is not a draft folder (no config.json): give the folder "
                             "of a trained draft, e.g. a run's OUT/final or flashdraft/drafts/TARGET")
        if self.draft_vocab_corpus is not None:
            check_corpus_folder(self.draft_vocab_corpus, "--draft-vocab-corpus")
        files = [self.prompts] if isinstance(self.prompts, str | Path) else self.prompts
        self.prompts = tuple(Path(file) for file in files)
        self.feature_layers = _parse_feature_layers(self.feature_layers)
        if self.sources is not None:
            none = isinstance(self.sources, str) and self.sources.strip() == "none"
            self.sources = () if none else _comma_list(self.sources)
        self.proportions = _parse_proportions(self.proportions)
        check_ranges(self)  # the data stages' numbers too (train_config() below checks only the trainer's)
        self.eval_sets = _comma_list(self.eval_sets)
        check_prompt_sets(self.eval_sets)
        for item in fields(self):
            choices = item.metadata.get("choices")
            if choices and getattr(self, item.name) not in choices:
                raise ValueError(f"{flag(item)} must be one of {', '.join(choices)}, got {getattr(self, item.name)!r}")
        from .blocks import check_training_block_size  # imports torch: not at the top, where the parser reads this

        check_training_block_size(self.block_size)
        if self.distill_weight > 0 and self.store_top_k <= 0:
            raise ValueError("--distill-weight needs the target's top-k probabilities: add --store-top-k K (e.g. 8)")
        unknown = [name for name in self.sources or () if name not in SOURCES]
        if unknown:
            raise ValueError(f"unknown prompt sources {unknown}: choose among {', '.join(SOURCES)}, or 'none'")
        unweighted = [name for name in self.source_names() if self.proportions.get(name, 0) <= 0]
        if unweighted:
            raise ValueError(f"--proportions gives no weight to the source(s) {', '.join(unweighted)}: add "
                             f"{unweighted[0]}=WEIGHT to --proportions, or leave it out of --sources")
        if not self.source_names() and not self.prompts:
            raise ValueError("no prompts: give --prompts FILE and/or --sources")
        self.train_config()  # its own checks

    def source_names(self) -> tuple[str, ...]:
        """The built-in sources to mix: the default mix's without prompt files, none with them, unless given."""
        if self.sources is not None:
            return self.sources
        return () if self.prompts else DEFAULT_SOURCES

    def label_kinds(self) -> list[str]:
        return list(LABEL_KINDS) if self.labels == "both" else [self.labels]

    @property
    def training_seed(self) -> int:
        return self.seed if self.train_seed is None else self.train_seed

    def train_config(self) -> TrainConfig:
        """The trainer's settings: this config's own values of the trainer's fields (the training seed as
        `training_seed` says)."""
        values = {item.name: getattr(self, item.name) for item in fields(TrainConfig)}
        return TrainConfig(**{**values, "seed": self.training_seed})


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


def check_ranges(config: TrainConfig) -> None:
    """Every number within its setting's range (`at_least`, `above`; None where a setting allows it is unset)."""
    for item in fields(config):
        value = getattr(config, item.name)
        if value is None or not {"at_least", "above"} & set(item.metadata):
            continue
        whole = str(item.type).startswith("int")  # the annotation, a string under postponed evaluation
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
            raise ValueError(f"{flag(item)} must be {'an integer' if whole else 'a number'}, got {value!r}")
        if "at_least" in item.metadata and not value >= item.metadata["at_least"]:
            raise ValueError(f"{flag(item)} must be at least {item.metadata['at_least']}, got {value}")
        if "above" in item.metadata and not value > item.metadata["above"]:
            raise ValueError(f"{flag(item)} must be above {item.metadata['above']}, got {value}")


def flag(item: Field) -> str:
    """A field's option: its own `flag` (`learning_rate` is `--lr`), else its name with dashes."""
    return item.metadata.get("flag") or "--" + item.name.replace("_", "-")


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
    option = flag(item)
    if value is None:
        return []  # the option's own default (None) stands for it
    if isinstance(value, bool):
        if default_of(item) is True:
            return [option if value else "--no-" + option[2:]]
        return [option] if value else []
    if item.metadata.get("repeat"):
        return [word for each in value for word in (option, format_setting(each))]
    return [option, format_setting(value)]


def exact_command(config: PipelineConfig) -> str:
    """`flashdraft train` with every setting of `config` spelled out, defaults included, in the order of its help:
    it reproduces the run."""
    words = ["flashdraft", "train"]
    for items in option_groups().values():
        for item in items:
            words += option_words(item, getattr(config, item.name))
    return shlex.join(words)


def run_identity(config: PipelineConfig) -> dict[str, str]:
    """Every setting that changes what a run trains, by option, as the option writes it (None: "unset"): a run
    folder holds one run, and a command with other values is another run, never the same one resumed."""
    return {flag(item): "unset" if getattr(config, item.name) is None else format_setting(getattr(config, item.name))
            for item in fields(config) if item.metadata.get("result", True)}


def option_groups() -> dict[str, list[Field]]:
    """`PipelineConfig`'s fields by help group, in the order of `flashdraft train --help`: a field with a `group`
    opens it and the fields after it in its class follow it; the data stages' fields come before the trainer's."""
    groups: dict[str, list[Field]] = {name: [] for name in OPTION_GROUPS}
    trainer = {item.name for item in fields(TrainConfig)}
    for own in (False, True):
        current = OPTION_GROUPS[0]
        for item in (item for item in fields(PipelineConfig) if (item.name in trainer) == own):
            current = item.metadata.get("group", current)
            groups[current].append(item)
    return groups
