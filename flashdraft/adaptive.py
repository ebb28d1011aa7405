"""The block size that maximises expected tokens per second, chosen round by round.

A round that verifies b tokens (the anchor and b-1 proposals) costs one b-token target forward plus one draft
pass, and yields on average E(b) = 1 + sum_{k<b} a_1 * ... * a_k tokens, where a_k is the chance that proposal k
is accepted given that the ones before it were. The target's forward time for b tokens is measured once per
model, dtype, device and thread count and cached on disk, and so is the draft's time for one pass; the
acceptance rates are tracked as generation goes. The chosen size is the b in 1..B maximising E(b) / cost(b):
b = 1 turns speculation off,
so a draft that does not help cannot make decoding much slower than plain decoding. While speculation is off,
a probe round every so often (less often each time the probe does not pay; of the size that would pay for a draft
accepted half the time) keeps the estimates fresh.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from . import native
from .engine import EngineSettings, interleaved_seconds
from .engine.settings import threading_environment
from .files import BUSY_CORES, cached_measurement, other_processes_cpu, save_measurement, shape_key
from .sampling import SamplingParams
from .target import TargetModel, synchronize

MEASURED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ROUND_CONTEXT = 2  # new verified positions a round's draft pass reads: the accepted tokens and the bonus, ~tau


FIRST_PROBE_STEPS = 2.0  # a draft's first probe costs at most this many one-token steps (see `first_probe_size`)


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


def first_probe_size(verify: VerifyCosts, draft_seconds: float, max_size: int) -> int:
    """The size of a draft's first round, before anything about its acceptance is known: the whole block where a
    round of it costs at most FIRST_PROBE_STEPS one-token steps (every position is scored at once), else the largest
    round that does, at least 2. (On an AVX2 CPU, where 8 tokens cost 3-4 steps, a whole first block lost about two
    steps an answer.)"""
    affordable = [size for size in range(2, max_size + 1)
                  if verify(size) + draft_seconds <= FIRST_PROBE_STEPS * verify(1)]
    return max(affordable, default=min(2, max_size))


def measure_round_costs(
    target: TargetModel, proposer=None, max_size: int = 8, context_length: int = 128, repeats: int = 9,
    every_size: bool = False,
) -> tuple[VerifyCosts, float]:
    """The target's forward over n new tokens after a cached context, for the sizes of `MEASURED_SIZES` up to
    `max_size` (every size from 1 with `every_size`: the full cost curve), and one drafting pass of `proposer` as a
    round of decoding runs it (0.0 without one).

    Every size and the draft pass run in each of `repeats` turns, in a shuffled order, and each is priced by its
    median ratio to the one-token forward of the same turn, times that forward's median: what matters is the ratios,
    and on a shared host the load changes between turns, not within one. (Measured one size after another, a change
    of load in between bent the curve: a 2-token round priced above a 3-token one. The least of five turns each
    followed every size's own quiet moment: a one-token forward slowed through all its turns priced a 3-token round
    at 1.31 steps where decoding paid 1.6-1.8.)

    The draft pass runs at the proposer's own block size when it has a smaller one (a draft beside the lookup drafts
    its own block in rounds up to `max_size`), after a context of `context_length` random features it has already
    read, on ROUND_CONTEXT new ones, and right after a one-token target forward, which takes the caches from the
    draft's weights as a round's verification does (timed back to back it cost 0.30 of a step where decoding paid
    0.40 on an AVX2 CPU). (A pass that reads the whole context first, as the first round after the prefill does,
    cost 2.5 times a round's on Qwen2.5-Coder-0.5B's draft, and priced so the draft drafted in a fifth of the rounds
    it pays in.)"""
    measured = range(1, max_size + 1) if every_size else MEASURED_SIZES
    sizes = sorted({n for n in measured if n <= max_size} | {1, max_size})
    ids = torch.randint(0, target.vocab_size, (1, context_length + max_size), device=target.device)
    positions = torch.arange(context_length + max_size, device=target.device)[None]
    cache = target.new_cache()
    target.forward(ids[:, :context_length], positions[:, :context_length], cache, None, logits_to_keep=1)

    def verify(n: int) -> None:
        window = slice(context_length, context_length + n)
        target.forward(ids[:, window], positions[:, window], cache, None)
        synchronize(target.device)
        target.rollback(cache, n)

    works: dict = {n: partial(verify, n) for n in sizes}
    passes: list[float] = []
    if proposer is not None:
        works["draft"] = partial(_draft_round, proposer, target, max_size, context_length, partial(verify, 1), passes)
    turns = interleaved_seconds(works, repeats, list)
    if passes:
        turns["draft"] = passes[1:]  # the first turn warms up
    step = statistics.median(turns[1])
    ratio = {key: statistics.median(t / t1 for t, t1 in zip(times, turns[1])) for key, times in turns.items()}
    return VerifyCosts({n: step * ratio[n] for n in sizes}), step * ratio["draft"] if passes else 0.0


def measure_verify_costs(target: TargetModel, max_size: int, context_length: int = 128, repeats: int = 9,
                         every_size: bool = False) -> VerifyCosts:
    """`measure_round_costs` without a draft: the target's forward costs alone."""
    return measure_round_costs(target, None, max_size, context_length, repeats, every_size)[0]


def _draft_round(proposer, target: TargetModel, max_size: int, context_length: int, step, passes: list[float]) -> None:
    """One turn of `measure_round_costs`' draft pass: the context read, a one-token target forward (`step`), then the
    round's pass, whose seconds join `passes`."""
    block_size = min(max_size, getattr(proposer, "block_size", None) or max_size)
    width = len(proposer.target_layer_ids or []) * target.hidden_size
    length = context_length + ROUND_CONTEXT
    features = torch.randn(1, length, width, device=target.device, dtype=target.dtype) if width else None
    anchor = torch.zeros(1, dtype=torch.long, device=target.device)
    proposer.begin(length + block_size)
    proposer.propose(anchor, None if features is None else features[:, :context_length], context_length,
                     block_size, block_size, SamplingParams(), None)
    step()
    began = time.perf_counter()
    proposer.propose(anchor, None if features is None else features[:, context_length:], length, block_size,
                     block_size, SamplingParams(), None)
    synchronize(target.device)
    passes.append(time.perf_counter() - began)


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


def cached_costs(target: TargetModel, proposer, max_size: int, batch_size: int = 1) -> tuple[VerifyCosts, float]:
    """The target's verify costs up to `max_size` and the proposer's drafting time, measured once per model,
    draft, dtype, device, thread count and batch size, then read from disk. Measured, not tracked online, so that
    the block sizes chosen (and with them a seeded sampling run's output) do not depend on the machine's load of
    the day; costs measured while other work kept the machine busy are measured again, once, at a quiet start
    (`flashdraft.files.cached_measurement`). At a batch size above 1, the whole batch's verify costs
    (`measure_batch_verify_costs`), no draft."""
    from .models import cache_home

    draft = getattr(proposer, "draft", None)
    # Keyed by the architecture (the whole config), not by `TargetModel.identity`'s name: costs depend on shapes
    # alone, so every folder of one architecture shares them.
    identity = json.dumps(
        {
            "model": shape_key(target.config),
            "proposer": type(proposer).__name__,
            "draft": shape_key(draft.config) if draft is not None else None,
            "engine": target.engine_name,
            # The engine's kernel choice decides its costs: a new kernel (or a new measurement) prices anew.
            "kernels": target.engine.kernels.table if target.engine is not None else None,
            # The arithmetic and the weights' forms (int8 on GGUF blocks, float32 packed or not) price anew.
            "arithmetic": target.engine.arithmetic if target.engine is not None else None,
            "weights": target.engine.packed_formats() if target.engine is not None else None,
            "native": native.build_identity(),  # a rebuilt native kernel (new source or compiler) prices anew
            # How threads wait changes every cost (a one-token step 2x here), and the draft's arithmetic its pass.
            "environment": threading_environment(),
            "settings": EngineSettings.from_environment().key(),  # every engine setting, the draft's arithmetic too
            "dtype": str(target.dtype),
            "device": str(target.device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "max_size": max_size,
            # how: costs measured otherwise before are measured again
            "measured": "ratios within turns; a round's draft pass after a target step",
            **({"batch_size": batch_size} if batch_size > 1 else {}),  # batch size 1 keeps its earlier files
        },
        sort_keys=True,
    )
    path = cache_home() / "costs" / f"{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"
    saved = cached_measurement(path)
    if saved is not None and {"verify", "draft"} <= saved.keys():
        return VerifyCosts({int(n): s for n, s in saved["verify"].items()}), saved["draft"]
    busy = other_processes_cpu() >= BUSY_CORES
    if batch_size > 1:  # the batch's verify costs only: a row's draft pass is priced alone (`BatchCosts`)
        costs, draft_seconds = measure_batch_verify_costs(target, max_size, batch_size), 0.0
    else:
        costs, draft_seconds = measure_round_costs(target, proposer, max_size)
    save_measurement(path, {"verify": costs.seconds, "draft": draft_seconds}, busy)
    return costs, draft_seconds


class BatchCosts:
    """What one row of a batch of b pays for a round, for its proposer's plan (`HybridProposer.plan`).

    The batch verifies one block length for all its rows, so a row that widens the block widens it for all: its
    round of s tokens costs its share of the batch's one-token forward, T_b(1) / b, plus the whole widening,
    T_b(s) - T_b(1), and its draft pass the pass of one row. At b = 1 these are the single sequence's costs. (A
    row prices its widening as if it alone widened: when several do, it was cheaper than priced, which keeps the
    batch on the safe side of speculating.) T_b is measured once per machine at powers of two (each on first
    need, then kept on disk) and interpolated between them."""

    def __init__(self, target: TargetModel, proposer, max_size: int):
        self.target, self.max_size = target, max_size
        self.single = cached_costs(target, proposer, max_size)
        self.measured: dict[int, VerifyCosts] = {1: self.single[0]}
        self.rows: dict[int, tuple[VerifyCosts, float]] = {}

    def batch_costs(self, batch_size: int) -> VerifyCosts:
        """T_b: the whole batch's forward over n tokens per row, by n."""
        if batch_size not in self.measured:
            low = 1 << (batch_size.bit_length() - 1)
            if low == batch_size:
                self.measured[batch_size] = cached_costs(self.target, None, self.max_size, batch_size)[0]
            else:
                low_costs, high_costs = self.batch_costs(low), self.batch_costs(2 * low)
                share = (batch_size - low) / low
                self.measured[batch_size] = VerifyCosts({
                    n: seconds + share * (high_costs.seconds[n] - seconds) for n, seconds in low_costs.seconds.items()
                })
        return self.measured[batch_size]

    def at(self, batch_size: int) -> tuple[VerifyCosts, float]:
        """(a row's verify costs, its draft pass) in a batch of `batch_size` rows."""
        if batch_size == 1:  # the single sequence's own, as measured (the widening below clamps a dip in the curve)
            return self.single
        if batch_size not in self.rows:
            whole = self.batch_costs(batch_size)
            base = whole(1)
            row = VerifyCosts({n: base / batch_size + max(seconds - base, 0.0) for n, seconds in whole.seconds.items()})
            self.rows[batch_size] = row, self.single[1]
        return self.rows[batch_size]


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

    def expected_tokens(self, size: int, acceptance: list[float] | None = None) -> float:
        """E(size): tokens a round of this size yields on average under the current estimates (or under the
        per-position `acceptance` given)."""
        if acceptance is None:
            acceptance = [a / t for a, t in zip(self.accepted, self.tested)]
        expected, chain = 1.0, 1.0
        for k in range(size - 1):
            chain *= acceptance[k]
            expected += chain
        return expected

    def best_size(self, acceptance: list[float] | None = None) -> int:
        """The size with the most expected tokens per second, under the current estimates (or `acceptance`)."""
        rates = [
            self.expected_tokens(size, acceptance)
            / (self.verify_costs(size) + (self.draft_seconds if size > 1 else 0.0))
            for size in range(1, self.max_size + 1)
        ]
        return 1 + max(range(len(rates)), key=rates.__getitem__)

    @property
    def probe_size(self) -> int:
        """A probe's size: the best one for a draft accepted half the time at every position (the prior), at least
        2. On this CPU, where 8 tokens cost ~2.6 one-token steps and a draft pass ~0.2, that is 3: a probe that
        finds the draft still useless costs ~1.5 steps, not ~2.8, and it tests the first positions, which decide
        the rest."""
        return max(2, self.best_size([0.5] * (self.max_size - 1)))

    def choose(self) -> int:
        if not self.observed:  # nothing observed yet: a block tests every position it holds at once
            return first_probe_size(self.verify_costs, self.draft_seconds, self.max_size)
        size = self.best_size()
        if size > 1:
            self.probe_interval = self.first_probe_interval
            return size
        self.rounds_without_drafting += 1
        if self.rounds_without_drafting < self.probe_interval:
            return 1
        # Probe; if drafting still does not pay afterwards, wait twice as long next time.
        self.rounds_without_drafting = 0
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        return self.probe_size

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
