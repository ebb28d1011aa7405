"""The draft a run starts from and the draft it writes: initialisation from the target's last layers or from an
earlier draft (grown by zero-output layers), the `TrainSummary` a run reports, and the output folder in the DFlash
format with its model card (README.md) and training.json."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..draft import DFlashDraftModel
from ..files import readable_as_folder
from .checkpoints import non_finite
from .records import ensure_free_space


@dataclass
class TrainSummary:
    """What a finished `Trainer.train()` reports."""

    steps: int
    epochs: float  # passes over the training sequences
    seconds: float  # wall time over all sessions of the run (resumes included)
    train_sequences: int
    blocks_per_second: float  # in this session
    tokens_per_second: float  # training sequence tokens per second, in this session
    final_loss: float
    final_accuracy: list[float]  # per block position 1..B-1, over the last logging window
    evaluations: list[dict] = field(default_factory=list)  # every evaluation, in order
    best: dict | None = None  # the evaluation of the kept draft


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators (every device): call it before building the draft, so that its random
    initialisation, and with it a fresh run, is the same for the same seed."""
    random.seed(seed)
    torch.manual_seed(seed)


def ensure_writable(folder: Path, needed_bytes: int, what: str) -> None:
    """Fail before training, not hours into it, when `folder` cannot be written or lacks space."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"cannot write the {what} to {folder} ({error.strerror}): choose a writable folder") from None
    ensure_free_space(folder, needed_bytes, what)


def init_from_target(draft: DFlashDraftModel, target) -> int:
    """Start the draft's layers from the target's last layers (and its final norm), for every weight whose name
    and shape match (the draft's q/k norms have no counterpart in Llama-style targets and stay at one).
    Returns the number of tensors copied."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    target_layers = getattr(decoder, "layers", None)
    if target_layers is None or len(target_layers) < len(draft.layers):
        raise ValueError(f"cannot initialise from {type(target).__name__}: its decoder layers were not found")
    copied = 0
    pairs = [(d, t) for d, t in zip(draft.layers, target_layers[len(target_layers) - len(draft.layers) :])]
    pairs.append((draft.norm, getattr(decoder, "norm", None)))
    with torch.no_grad():
        for draft_module, target_module in pairs:
            if target_module is None:
                continue
            source = target_module.state_dict()
            for name, tensor in draft_module.state_dict().items():
                if name in source and source[name].shape == tensor.shape:
                    tensor.copy_(source[name])
                    copied += 1
    return copied


def start_from_draft(draft: DFlashDraftModel, start: DFlashDraftModel) -> int:
    """Load an earlier draft's weights into `draft`, which may have more layers: the earlier draft's layers come
    first, and each added layer's output projections (attention o, MLP down) start at zero, so that the grown draft
    computes exactly what the earlier one did and training adds to it (its other weights stay as they were, e.g.
    from `init_from_target`). Returns the number of layers added. The drafting vocabulary is not carried over."""
    weights = start.state_dict()
    weights.pop("draft_vocab_ids", None)
    added = len(draft.layers) - len(start.layers)
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    ours = {f"layers.{i}." for i in range(len(start.layers), len(draft.layers))}
    strays = [name for name in missing if not any(name.startswith(prefix) for prefix in ours)]
    if added < 0 or unexpected or strays:
        raise ValueError(f"a draft of {len(start.layers)} layers cannot start a draft of {len(draft.layers)}: "
                         f"weights {(unexpected + strays)[:3]} do not match")
    with torch.no_grad():
        for layer in draft.layers[len(start.layers):]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return added


def save_draft_atomic(draft: DFlashDraftModel, folder: Path) -> None:
    bad = non_finite(draft.state_dict())
    if bad:  # a diverged draft is never kept nor shipped
        raise ValueError(f"the draft has non-finite weights ({', '.join(bad[:3])}): it is not written to {folder}")
    temporary = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    draft.save_pretrained(temporary)
    readable_as_folder(temporary)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(temporary, folder)


def save_trained_draft(
    draft: DFlashDraftModel, output_dir: str | Path, summary: TrainSummary, card: Mapping
) -> Path:
    """Write the draft folder (SPEC section 2 format), its model card README.md and training.json."""
    output_dir = Path(output_dir)
    save_draft_atomic(draft, output_dir)
    (output_dir / "training.json").write_text(json.dumps({**card, "summary": asdict(summary)}, indent=2) + "\n")
    (output_dir / "README.md").write_text(model_card(draft, summary, card))
    return output_dir


RUN_RECORD = ("what", "command", "summary", "settings", "data", "evaluation")  # a run's entry in a lineage


def lineage(init_draft: str | Path) -> list[dict]:
    """The runs behind the draft a run continues (`--init-draft`): the earlier runs its training.json lists under
    `runs`, then its own run; so that a draft continued many times keeps how each step was made. Empty for a draft
    without training.json (one converted from elsewhere)."""
    path = Path(init_draft) / "training.json"
    if not path.is_file():
        return []
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): fix or remove it to continue the draft") from None
    own = {key: earlier[key] for key in RUN_RECORD if key in earlier}
    own.setdefault("what", f"the draft continued from ({Path(init_draft).name})")
    return [*earlier.get("runs", []), own]


def model_card(draft: DFlashDraftModel, summary: TrainSummary, card: Mapping) -> str:
    """The model card: what the draft is for, how it was trained, and what it reaches."""
    config = draft.config
    vocab_size = config.dflash_config.get("draft_vocab_size")
    lines = [
        f"# DFlash draft for {card.get('target', 'its target')}",
        "",
        "A DFlash block-diffusion draft model for lossless speculative decoding, trained with flashdraft "
        "(`flashdraft train`). Format: a Qwen3-shaped `config.json` with `block_size`, `num_target_layers` and "
        "`dflash_config`, weights in safetensors; embeddings and output head are the target's.",
        "",
        "## Model",
        "",
        f"- target: `{card.get('target')}` ({config.num_target_layers} layers, hidden size {config.hidden_size})",
        f"- draft layers: {config.num_hidden_layers}; block size {config.block_size}; "
        f"mask token id {draft.mask_token_id}; target feature layers {draft.target_layer_ids}",
        f"- trainable parameters: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M",
        "- drafting vocabulary: "
        + (f"{vocab_size} most frequent target output tokens (`draft_vocab_ids`)" if vocab_size else "the full one"),
        "",
        "## Training data",
        "",
    ]
    for source, counts in (card.get("data") or {}).items():
        lines.append(f"- {source}: {counts.get('sequences', 0)} sequences, {counts.get('tokens', 0)} response tokens")
    lines += ["", f"Labels: {card.get('labels', 'n/a')}.", "", "## Training", ""]
    lines += [
        f"- steps: {summary.steps} ({summary.epochs:.2f} epochs over {summary.train_sequences} sequences)",
        f"- wall time: {summary.seconds / 60:.1f} minutes",
        f"- final training loss {summary.final_loss:.3f}; per-position accuracy "
        + " ".join(f"{a:.2f}" for a in summary.final_accuracy),
    ]
    for key, value in (card.get("settings") or {}).items():
        lines.append(f"- {key}: {value}")
    lines += ["", "## Acceptance (tau, greedy, pooled over the rounds of the held-out prompts)", ""]
    if summary.best is not None:
        lines.append(f"Kept draft: step {summary.best['step']}.")
        lines.append("")
        for name, tau in summary.best["tau"].items():
            lines.append(f"- {name}: tau {tau:.2f}")
        if "heldout_accuracy" in summary.best:
            lines.append(
                "- held-out per-position accuracy: " + " ".join(f"{a:.2f}" for a in summary.best["heldout_accuracy"])
            )
    else:
        lines.append("Not evaluated.")
    lines += learning_curve(summary)
    lines += earlier_runs(card.get("runs") or [])
    lines += ["", "## Reproduce", "", "```", card.get("command", ""), "```", ""]
    return "\n".join(lines)


def learning_curve(summary: TrainSummary) -> list[str]:
    """The model card's table of every evaluation: steps, the training sequences they saw, tau on each prompt set
    and the held-out loss, so that the next draft's data and steps can be planned from it."""
    if not summary.evaluations:
        return []
    sets = list(dict.fromkeys(name for evaluation in summary.evaluations for name in evaluation["tau"]))
    per_step = summary.epochs * summary.train_sequences / summary.steps if summary.steps else 0.0
    lines = ["", "## Learning curve", "",
             f"Training on {summary.train_sequences} sequences; one step is {per_step:.1f} of them.", "",
             "| step | sequences seen | " + " | ".join(f"tau {name}" for name in sets) + " | held-out loss |",
             "|---:|---:|" + "---:|" * len(sets) + "---:|"]
    for evaluation in summary.evaluations:
        taus = [evaluation["tau"].get(name) for name in sets]
        loss = evaluation.get("heldout_loss")
        lines.append(f"| {evaluation['step']} | {round(evaluation['step'] * per_step)} | "
                     + " | ".join("-" if t is None else f"{t:.2f}" for t in taus)
                     + f" | {'-' if loss is None else f'{loss:.3f}'} |")
    return lines


def earlier_runs(runs: list[dict]) -> list[str]:
    """The model card's list of the runs the draft continues, oldest first, each with its steps and command."""
    if not runs:
        return []
    lines = ["", "## Earlier runs", "", "This draft continues these runs, oldest first (training.json has them whole):",
             ""]
    for number, run in enumerate(runs, 1):
        summary = run.get("summary") or {}
        steps = f"{summary['steps']} steps over {summary.get('train_sequences', '?')} sequences: " if (
            "steps" in summary) else ""
        lines.append(f"{number}. {run.get('what', 'a run')}; {steps}`{run.get('command', 'command not recorded')}`")
    return lines


SHIPPED_WITH = ("README.md", "training.json")  # what a shipped draft carries beside its weights


def ship_draft(source: Path, destination: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a trained draft folder as a shipped draft: weights in bfloat16 (half the bytes; `load_draft` loads them
    into float32 on a CPU), the model card and `training.json` copied as they are. Measure the written folder, not
    the source: rounding to bfloat16 moves the logits a little, so acceptance can move by a hair."""
    source, destination = Path(source), Path(destination)
    draft = DFlashDraftModel.from_pretrained(source, dtype=torch.float32)
    if destination.resolve() == source.resolve():
        raise ValueError(f"{destination} is the source folder: write the shipped draft elsewhere")
    destination.mkdir(parents=True, exist_ok=True)
    for stale in destination.glob("*.safetensors"):
        stale.unlink()  # a folder holds one draft: no shard of the previous one stays beside the new weights
    draft.to(dtype).save_pretrained(destination)
    for name in SHIPPED_WITH:
        if (source / name).is_file():
            shutil.copyfile(source / name, destination / name)
    return destination
