"""From logits to tokens, and the acceptance rules of verification, as pure functions over tensors.

Terms, used the same way everywhere: p is the target's distribution, q the draft's; a round verifies B-1
*proposals*; the *accepted* ones are the longest prefix the rule keeps; the *bonus* token is the target's
own token after them (the correction at the first rejection, or one more token when all are accepted), so a
round always yields accepted + 1 tokens.

Sampling (temperature > 0) uses rejection sampling (Leviathan et al. 2023; Chen et al. 2023): proposals are
drawn from q, proposal x is accepted with probability min(1, p(x) / q(x)), a rejection is replaced by a draw
from norm(max(0, p - q)), and the bonus after a fully accepted block is drawn from p. The emitted sequence
then follows p exactly. p and q are the target's and the draft's logits warped by the same temperature,
top-k and top-p, with transformers' own warpers, so p is exactly what `target.generate(do_sample=True)` uses,
wherever that is a distribution: at a temperature so small that logits / T overflows float32 (where transformers
gets NaN) p is computed from the logits shifted by their maximum instead, which is the same distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from numbers import Integral

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# The seeds a torch generator takes: any signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)

# Below this temperature, logits / T can overflow float32 (from about 1e-37 for logits of order 10; transformers'
# softmax is then NaN). Above it only logits beyond 1e34 could, which no model produces; the check is skipped.
OVERFLOW_BELOW = 1e-4


def check_seed(seed) -> None:
    """A seed no generator takes fails here, named, rather than as torch's "Overflow when unpacking long long"."""
    low, high = SEED_RANGE
    if seed is not None and not (isinstance(seed, Integral) and not isinstance(seed, bool) and low <= seed <= high):
        raise ValueError(f"seed must be a 64-bit integer, in [-2**63, 2**64 - 1], got {seed!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def warpers(self) -> tuple:
        # Same order as transformers' generate: temperature, then top-k, then top-p. Built once per
        # generation and called directly (LogitsProcessorList inspects signatures on every call).
        warpers = []
        if self.temperature not in (0.0, 1.0):
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return tuple(warpers)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] float32 probabilities after temperature, top-k and top-p."""
    probs = _warped_softmax(logits.float(), params)
    if 0 < params.temperature < OVERFLOW_BELOW:
        # Rows where logits / T overflowed (NaN): the same distribution from the logits shifted by their maximum,
        # in float64, where every warped logit is <= 0 and the largest exactly 0 for any T > 0 (softmax, top-k and
        # top-p ignore a common shift). At such T it is the argmax, shared evenly among exact ties: the limit of
        # sampling as T -> 0. Rows that did not overflow keep transformers' numbers. No host sync: torch.where.
        shifted = logits.double()
        shifted = shifted - shifted.max(dim=-1, keepdim=True).values
        probs = torch.where(probs.isnan().any(dim=-1, keepdim=True), _warped_softmax(shifted, params).float(), probs)
    return probs


def _warped_softmax(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    for warper in params.warpers:
        logits = warper(None, logits)
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[n, V] probabilities -> [n] token ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] token ids: the first largest entry of each row, as `argmax(dim=-1)`. On CPU float32
    through numpy's vectorised argmax: torch's takes 40-60 us for one 49,152-entry row here, numpy's 5, and a step
    takes one per round at least."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.as_tensor(logits.numpy().argmax(-1))
    return logits.argmax(dim=-1)


def accept_greedy(proposals: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    proposals [B-1]; target_logits [B, V] at the anchor and each proposal. Returns (accepted: 0-d tensor, the
    longest prefix where proposal i equals the target's argmax after position i-1; bonus: 0-d tensor, the
    target's argmax after the last accepted token).
    """
    choice = greedy(target_logits)  # [B]
    accepted = matching_prefix(proposals, choice[:-1])
    return accepted, choice[accepted]


def matching_prefix(proposals: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """0-d tensor: how many leading proposals equal the target's tokens at the same places (the greedy rule;
    replay applies it to the target's recorded answer)."""
    return (proposals == target_tokens).cumprod(dim=0).sum()


def accept_sampled(
    proposals: torch.Tensor,  # [B-1] drawn from q
    q: torch.Tensor,  # [B-1, V] draft probabilities the proposals were drawn from
    p: torch.Tensor,  # [B, V] target probabilities at the anchor and each proposal
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification (see the module docstring). Returns (accepted, bonus) 0-d tensors."""
    p_proposed = p[:-1].gather(1, proposals[:, None]).squeeze(1)
    q_proposed = q.gather(1, proposals[:, None]).squeeze(1)
    u = torch.rand(proposals.shape, generator=generator, device=p.device)
    accepted = (u * q_proposed <= p_proposed).cumprod(dim=0).sum()
    # Row i < B-1: the distribution a rejection at i is resampled from; row B-1: p itself (all accepted).
    residual = (p[:-1] - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:-1])  # p == q: never rejected
    bonus = sample(torch.cat([residual, p[-1:]])[accepted][None], generator)[0]
    return accepted, bonus
