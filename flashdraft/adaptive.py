"""The block size that maximises expected tokens per second, chosen round by round.

A round that verifies b tokens (the anchor and b-1 proposals) costs one b-token target forward plus one draft
pass, and yields on average E(b) = 1 + sum_{k<b} a_1 * ... * a_k tokens, where a_k is the chance that proposal k
is accepted given that the ones before it were. The target's forward time for b tokens is measured once per
model, dtype, device and thread count and cached on disk, and so is the draft's time for one pass; the
acceptance rates are tracked as generation goes. The chosen size is the b in 1..B maximising E(b) / cost(b):
b = 1 turns speculation off,
so a draft that does not help cannot make decoding much slower than plain decoding. While speculation is off,
a probe round at full size every so often (less often each time the probe does not pay) keeps the estimates
fresh.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
from dataclasses import dataclass

import torch

from .files import write_atomic
from .sampling import SamplingParams
from .target import TargetModel, synchronize

MEASURED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class VerifyCosts:
    """Seconds of one target forward over n new tokens (after a short cached context), by n."""

    seconds: dict[int, float]

    def __call__(self, n: int) -> float:
        sizes = sorted(self.seconds)
        if n <= sizes[0]:
            return self.seconds[sizes[0]]
        for low, high in zip(sizes, sizes[1:]):
            if n <= high:
                share = (n - low) / (high - low)
                return self.seconds[low] + share * (self.seconds[high] - self.seconds[low])
        # Past the largest measured size: extrapolate the last segment's slope.
        low, high = sizes[-2], sizes[-1]
        return self.seconds[high] + (n - high) * (self.seconds[high] - self.seconds[low]) / (high - low)


def measure_verify_costs(
    target: TargetModel, max_size: int, context_length: int = 128, repeats: int = 5, every_size: bool = False
) -> VerifyCosts:
    """Time target forwards of each size up to `max_size` after a cached context (median of `repeats`): the
    sizes of `MEASURED_SIZES`, or every size from 1 with `every_size` (the full cost curve)."""
    measured = range(1, max_size + 1) if every_size else MEASURED_SIZES
    sizes = sorted({n for n in measured if n <= max_size} | {max_size})
    ids = torch.randint(0, target.vocab_size, (1, context_length + max_size), device=target.device)
    positions = torch.arange(context_length + max_size, device=target.device)[None]
    cache = target.new_cache()
    target.forward(ids[:, :context_length], positions[:, :context_length], cache, None, logits_to_keep=1)
    seconds = {}
    for n in sizes:
        times = []
        for _ in range(repeats + 1):  # the first run of each size warms up
            synchronize(target.device)
            began = time.perf_counter()
            window = slice(context_length, context_length + n)
            target.forward(ids[:, window], positions[:, window], cache, None)
            synchronize(target.device)
            times.append(time.perf_counter() - began)
            target.rollback(cache, n)
        seconds[n] = statistics.median(times[1:])
    return VerifyCosts(seconds)


def measure_draft_seconds(proposer, target: TargetModel, block_size: int, context_length: int = 128,
                          repeats: int = 3) -> float:
    """Time one drafting pass of `proposer` after a context of random features (median of `repeats`)."""
    width = len(proposer.target_layer_ids or []) * target.hidden_size
    context = torch.randn(1, context_length, width, device=target.device, dtype=target.dtype) if width else None
    anchor = torch.zeros(1, dtype=torch.long, device=target.device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        proposer.begin(context_length + block_size)
        synchronize(target.device)
        began = time.perf_counter()
        proposer.propose(anchor, context, context_length, block_size, block_size, SamplingParams(), None)
        synchronize(target.device)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def measure_batch_verify_costs(
    target: TargetModel, max_size: int, batch_size: int, context_length: int = 128, repeats: int = 3
) -> VerifyCosts:
    """`measure_verify_costs` for `batch_size` sequences verified together (`TargetModel.forward_rows`): seconds
    of one forward over n new tokens per row, for the whole batch."""
    sizes = sorted({n for n in MEASURED_SIZES if n <= max_size} | {max_size})
    ids = torch.randint(0, target.vocab_size, (batch_size, context_length + max_size), device=target.device)
    positions = torch.arange(context_length + max_size, device=target.device)[None].expand(batch_size, -1)
    prefilled = target.new_cache()
    target.forward(ids[:1, :context_length], positions[:1, :context_length], prefilled, None, logits_to_keep=1)
    rows = target.new_row_cache()
    for _ in range(batch_size):  # the rows' contexts need not differ for a time
        rows.add(copy.deepcopy(prefilled))
    seconds = {}
    for n in sizes:
        times = []
        for _ in range(repeats + 1):  # the first run of each size warms up
            window = slice(context_length, context_length + n)
            synchronize(target.device)
            began = time.perf_counter()
            target.forward_rows(ids[:, window], positions[:, window], rows, None)
            synchronize(target.device)
            times.append(time.perf_counter() - began)
            rows.keep([context_length] * batch_size)
        seconds[n] = statistics.median(times[1:])
    return VerifyCosts(seconds)


def measure_batch_draft_seconds(proposer, target: TargetModel, block_size: int, batch_size: int,
                                context_length: int = 128, repeats: int = 3) -> float:
    """One drafting pass over `batch_size` sequences (`DFlashProposer.logits_rows`); 0 for a proposer without a
    draft (the lookup costs nothing next to a forward)."""
    if not hasattr(proposer, "logits_rows"):
        return 0.0
    width = len(proposer.target_layer_ids) * target.hidden_size
    contexts = [torch.randn(1, context_length, width, device=target.device, dtype=target.dtype)] * batch_size
    anchors = torch.zeros(batch_size, dtype=torch.long, device=target.device)
    rows = list(range(batch_size))
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        cache = proposer.new_row_cache()
        for _ in rows:
            cache.add_row()
        synchronize(target.device)
        began = time.perf_counter()
        proposer.logits_rows(cache, rows, anchors, contexts, [context_length] * batch_size, block_size,
                             [block_size] * batch_size)
        synchronize(target.device)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def cached_costs(target: TargetModel, proposer, max_size: int, batch_size: int = 1) -> tuple[VerifyCosts, float]:
    """The target's verify costs up to `max_size` and the proposer's drafting time, measured once per model,
    draft, dtype, device, thread count and batch size, then read from disk. Measured, not tracked online, so that
    the block sizes chosen (and with them a seeded sampling run's output) do not depend on the machine's load of
    the day. Costs at a batch size above 1 are those of the whole batch's forward (`measure_batch_verify_costs`)."""
    from .models import cache_home

    draft = getattr(proposer, "draft", None)
    # Keyed by the architecture (the whole config), not by `TargetModel.identity`'s name: costs depend on shapes
    # alone, so every folder of one architecture shares them.
    identity = json.dumps(
        {
            "model": target.config.to_json_string(use_diff=False),
            "proposer": type(proposer).__name__,
            "draft": draft.config.to_json_string(use_diff=False) if draft is not None else None,
            "engine": target.engine_name,
            # The engine's kernel choice decides its costs: a new kernel (or a new measurement) prices anew.
            "kernels": target.engine.kernels.table if target.engine is not None else None,
            "dtype": str(target.dtype),
            "device": str(target.device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "max_size": max_size,
            **({"batch_size": batch_size} if batch_size > 1 else {}),  # batch size 1 keeps its earlier files
        },
        sort_keys=True,
    )
    path = cache_home() / "costs" / f"{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        return VerifyCosts({int(n): s for n, s in saved["verify"].items()}), saved["draft"]
    if batch_size > 1:
        costs = measure_batch_verify_costs(target, max_size, batch_size)
        draft_seconds = measure_batch_draft_seconds(proposer, target, max_size, batch_size)
    else:
        costs = measure_verify_costs(target, max_size)
        draft_seconds = measure_draft_seconds(proposer, target, max_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"verify": costs.seconds, "draft": draft_seconds}))
    return costs, draft_seconds


class BatchCosts:
    """A batch's round costs at any batch size: `cached_costs` at powers of two (each measured on first need, then
    kept on disk), interpolated between them, so that a batch of b rows plans with what b rows cost."""

    def __init__(self, target: TargetModel, proposer, max_size: int):
        self.target, self.proposer, self.max_size = target, proposer, max_size
        self.measured: dict[int, tuple[VerifyCosts, float]] = {}
        self.interpolated: dict[int, tuple[VerifyCosts, float]] = {}

    def _measured(self, batch_size: int) -> tuple[VerifyCosts, float]:
        if batch_size not in self.measured:
            self.measured[batch_size] = cached_costs(self.target, self.proposer, self.max_size, batch_size)
        return self.measured[batch_size]

    def at(self, batch_size: int) -> tuple[VerifyCosts, float]:
        """(verify costs, draft seconds) of a round over `batch_size` rows."""
        if batch_size not in self.interpolated:
            low = 1 << (batch_size.bit_length() - 1)
            if low == batch_size:
                self.interpolated[batch_size] = self._measured(batch_size)
            else:
                (low_costs, low_draft), (high_costs, high_draft) = self._measured(low), self._measured(2 * low)
                share = (batch_size - low) / low
                verify = VerifyCosts({n: seconds + share * (high_costs.seconds[n] - seconds)
                                      for n, seconds in low_costs.seconds.items()})
                self.interpolated[batch_size] = verify, low_draft + share * (high_draft - low_draft)
        return self.interpolated[batch_size]


class BlockSizeController:
    """Tracks acceptance and picks each round's block size (see the module docstring)."""

    def __init__(
        self,
        max_size: int,
        verify_costs: VerifyCosts,
        draft_seconds: float,
        decay: float = 0.97,
        first_probe_interval: int = 32,
        max_probe_interval: int = 512,
    ):
        self.max_size = max_size
        self.verify_costs = verify_costs
        self.decay = decay
        # Pseudo-counts per proposal position k = 1..max_size-1: a prior acceptance of one half.
        self.accepted = [0.5] * (max_size - 1)
        self.tested = [1.0] * (max_size - 1)
        self.draft_seconds = draft_seconds
        self.observed = False
        self.first_probe_interval = first_probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_interval = first_probe_interval
        self.rounds_without_drafting = 0

    def expected_tokens(self, size: int) -> float:
        """E(size): tokens a round of this size yields on average under the current estimates."""
        expected, chain = 1.0, 1.0
        for k in range(size - 1):
            chain *= self.accepted[k] / self.tested[k]
            expected += chain
        return expected

    def best_size(self) -> int:
        rates = [
            self.expected_tokens(size) / (self.verify_costs(size) + (self.draft_seconds if size > 1 else 0.0))
            for size in range(1, self.max_size + 1)
        ]
        return 1 + max(range(len(rates)), key=rates.__getitem__)

    def choose(self) -> int:
        if not self.observed:  # nothing observed yet: a full block tests every position at once
            return self.max_size
        size = self.best_size()
        if size > 1:
            self.probe_interval = self.first_probe_interval
            return size
        self.rounds_without_drafting += 1
        if self.rounds_without_drafting < self.probe_interval:
            return 1
        # Probe at full size; if drafting still does not pay afterwards, wait twice as long next time.
        self.rounds_without_drafting = 0
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        return self.max_size

    def observe(self, size: int, num_accepted: int) -> None:
        """Record a round: proposals 1..num_accepted were accepted, proposal num_accepted + 1 (if any) was not."""
        if size == 1:
            return
        self.observed = True
        for k in range(self.max_size - 1):
            self.accepted[k] *= self.decay
            self.tested[k] *= self.decay
        for k in range(min(num_accepted + 1, size - 1)):
            self.tested[k] += 1.0
            self.accepted[k] += 1.0 if k < num_accepted else 0.0
