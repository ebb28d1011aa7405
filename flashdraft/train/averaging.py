"""Weight averaging of drafts that descend from one another (a "model soup"): the mean of each parameter over
drafts continued from a common draft lies in the same basin and often accepts more than any of them alone, at no
training cost. Sources are draft folders (`flashdraft train`'s output, shipped drafts) or the trainer's checkpoints
(`runs/NAME/checkpoints/step-*.pt`, read with their checksums)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..draft import DFlashDraftModel
from .checkpoints import DamagedCheckpoint, read_checkpoint


def draft_weights(source: str | Path) -> dict[str, torch.Tensor]:
    """The parameters and buffers of a draft folder or of a trainer checkpoint (`.pt`), in float32."""
    source = Path(source)
    if source.suffix == ".pt":
        try:
            state = read_checkpoint(source)["draft"]
        except DamagedCheckpoint as error:
            raise ValueError(f"{source} cannot be averaged: {error}") from None
    else:
        state = DFlashDraftModel.from_pretrained(source, dtype=torch.float32).state_dict()
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}


def average_drafts(like: DFlashDraftModel, sources: Sequence[str | Path]) -> DFlashDraftModel:
    """`like` with each parameter replaced by its mean over `sources` (float32); its buffers, and so its config and
    drafting vocabulary, stay its own. Every source must have `like`'s parameter names and shapes."""
    if not sources:
        raise ValueError("nothing to average: give at least one draft folder or checkpoint")
    parameters = dict(like.named_parameters())
    total = {name: torch.zeros(p.shape, dtype=torch.float32) for name, p in parameters.items()}
    for source in sources:
        weights = draft_weights(source)
        missing = sorted(set(parameters) - set(weights))
        if missing:
            raise ValueError(f"{source} lacks parameters of the draft to average into ({', '.join(missing[:3])}): "
                             "average drafts of one architecture (the same layers and target)")
        for name, parameter in parameters.items():
            if weights[name].shape != parameter.shape:
                raise ValueError(f"{source} has {name} of shape {tuple(weights[name].shape)}, the draft to average "
                                 f"into {tuple(parameter.shape)}: average drafts of one architecture")
            total[name] += weights[name]
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_((total[name] / len(sources)).to(parameter.dtype))
    return like
