"""Benchmark metrics per dataset and method, computed from the per-prompt records.

- output tokens: mean new tokens per prompt;
- decode tokens/s: tokens after the first over the time after the first (pooled over the prompts), so the
  prefill, which every method shares, is left out;
- speedup: decode tokens/s over that of `ar` on the same dataset (the same as the ratio of decode time per token);
- speedup over plain: the same over `flashdraft-plain` (flashdraft's engine and loop without proposals) where it ran,
  so that the proposals' own gain is apart from the engine's (`ar` is transformers' `generate`);
- median speedup: the median over the prompts of each prompt's own speedup (its decode tokens/s over `ar`'s on the
  same prompt and turn). The runner runs the methods back to back on each prompt, so a slow spell on a shared host
  moves both sides of a prompt's ratio; the pooled figure lets one slow prompt weigh by its seconds;
- time to first token: mean seconds until the target's prefill forward ended;
- tau: tokens per target forward after the prefill, pooled over all rounds of all prompts (1 for `ar`), and the
  histogram of those acceptance lengths; for a method that counts only totals (llama.cpp's tools print the tokens
  decoded and the proposals accepted), decoded tokens over rounds, a round being one target token plus the accepted
  proposals before it, and no histogram;
- exactness (temperature 0 only): how many outputs differ from `ar`'s for the same prompt, and from llama.cpp's
  plain decoding's where it ran (`llama.cpp`: its speculative methods must match it, as flashdraft's match `ar`).
  Token ids are compared where both methods give them; a method that prints text (llama.cpp's) is compared by text
  (the other side's tokens decoded, special tokens skipped: `texts_agree`);
- tokens by source: each proposer's share of the output tokens (accepted proposals; "target" for the rest), for
  the methods that say (flashdraft's).

A dataset with several turns (MT-Bench) is summarised per turn, as "mt-bench turn 1", "mt-bench turn 2": a later
turn answers with the earlier answer in its context, which changes what proposals from the context can do.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..decoding import acceptance_histogram, tau
from .runner import Record

BASELINE = "ar"
PLAIN = "flashdraft-plain"  # the second baseline: flashdraft's own plain decoding
LLAMA_CPP_PLAIN = "llama.cpp"  # llama.cpp's plain decoding, which its speculative methods must reproduce


def decode_tokens_per_second(records: Sequence[Record]) -> float:
    """Pooled decode throughput: every token after each answer's first, over the decode seconds."""
    tokens = sum(record.decode_tokens if record.decode_tokens is not None else max(len(record.tokens) - 1, 0)
                 for record in records)
    seconds = sum(record.decode_seconds for record in records)
    return tokens / seconds if tokens and seconds > 0 else 0.0


def median_speedup(records: Sequence[Record], baseline: Sequence[Record]) -> float | None:
    """Median over the prompts of decode tokens/s over the baseline's on the same sample and turn; None when no
    prompt has a ratio (no baseline record for it, or one side decoded nothing)."""
    expected = {(record.sample_id, record.turn): record for record in baseline}
    ratios = []
    for record in records:
        paired = expected.get((record.sample_id, record.turn))
        mine = decode_tokens_per_second([record])
        theirs = decode_tokens_per_second([paired]) if paired else 0.0
        if mine > 0 and theirs > 0:
            ratios.append(mine / theirs)
    return statistics.median(ratios) if ratios else None


def count_differing(records: Sequence[Record], baseline: Sequence[Record]) -> int:
    """How many of `records` produced another answer than the baseline record for the same sample and turn: other
    token ids, or other text where either side's tokens were encoded from printed text."""
    expected = {(record.sample_id, record.turn): record for record in baseline}

    def differs(record: Record, other: Record) -> bool:
        if record.tokens_from_text or other.tokens_from_text:
            return not texts_agree(record, other)
        return record.tokens != other.tokens

    return sum(differs(record, expected[(record.sample_id, record.turn)]) for record in records)


def texts_agree(one: Record, other: Record) -> bool:
    """Whether two answers agree by text: equal, or the shorter, cut by the token budget (not ended by the model),
    begins the longer (a method that decodes past the budget, or a text cut at another token boundary)."""
    shorter, longer = sorted((one, other), key=lambda record: len(record.text))
    return shorter.text == longer.text or (not shorter.ended and longer.text.startswith(shorter.text))


def counted_tau(records: Sequence[Record]) -> float:
    """Tau from a method's own totals: decoded tokens over rounds, each round emitting the accepted proposals and
    one target token (so rounds = decoded - accepted)."""
    decoded = sum(record.decode_tokens or 0 for record in records)
    rounds = decoded - sum(record.accepted or 0 for record in records)
    return decoded / rounds if rounds > 0 else 0.0


def token_shares(records: Sequence[Record]) -> dict[str, float]:
    """Source -> share of all output tokens, pooled over the records; empty unless every record says."""
    if not records or not all(record.tokens_by_source for record in records):
        return {}
    totals: dict[str, int] = {}
    for record in records:
        for source, count in record.tokens_by_source.items():
            totals[source] = totals.get(source, 0) + count
    tokens = sum(totals.values())
    return {source: count / tokens for source, count in totals.items()} if tokens else {}


@dataclass
class Summary:
    dataset: str
    method: str
    prompts: int
    output_tokens: float  # mean per prompt
    decode_tokens_per_second: float
    speedup: float | None  # over `ar`; None when `ar` decoded nothing
    median_speedup: float | None  # the median of the per-prompt speedups; None when no prompt has one
    time_to_first_token: float  # mean seconds
    tau: float
    acceptance_histogram: dict[int, int]
    differs_from_ar: int | None  # None when sampling (outputs are not comparable)
    token_shares: dict[str, float]  # source -> share of the output tokens; empty when the method does not say
    speedup_over_plain: float | None = None  # over `flashdraft-plain`; None when it did not run (or decoded nothing)
    median_speedup_over_plain: float | None = None
    differs_from_llama_cpp: int | None = None  # None when `llama.cpp` did not run, or sampling
    drafted: int | None = None  # proposals verified / accepted, for the methods that count them (llama.cpp's)
    accepted: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[Record], *, greedy: bool) -> list[Summary]:
    """One summary per (dataset, method): datasets, and the methods within each, in the order they first appear in
    `records` (the runner rotates the method order from prompt to prompt; its first prompt has the listed order)."""
    multi_turn = {record.dataset for record in records if record.turn > 0}

    def dataset_of(record: Record) -> str:
        return f"{record.dataset} turn {record.turn + 1}" if record.dataset in multi_turn else record.dataset

    order = {dataset: i for i, dataset in enumerate(dict.fromkeys(record.dataset for record in records))}
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in sorted(records, key=lambda record: (order[record.dataset], record.turn)):  # turns in order
        groups.setdefault((dataset_of(record), record.method), []).append(record)
    datasets = dict.fromkeys(dataset for dataset, _ in groups)
    methods = dict.fromkeys(record.method for record in records)
    summaries = []
    for dataset, method in [(d, m) for d in datasets for m in methods if (d, m) in groups]:
        group = groups[dataset, method]
        baseline = groups.get((dataset, BASELINE))
        if baseline is None:
            raise ValueError(f"dataset {dataset!r} has no {BASELINE!r} records to compare against")
        throughput = decode_tokens_per_second(group)
        baseline_throughput = decode_tokens_per_second(baseline)
        plain = groups.get((dataset, PLAIN))
        plain_throughput = decode_tokens_per_second(plain) if plain else 0.0
        lengths = [length for record in group for length in record.acceptance_lengths]
        counted = not lengths and all(record.accepted is not None for record in group)
        llama_cpp = groups.get((dataset, LLAMA_CPP_PLAIN))
        summaries.append(
            Summary(
                dataset=dataset,
                method=method,
                prompts=len(group),
                output_tokens=sum(len(record.tokens) for record in group) / len(group),
                decode_tokens_per_second=throughput,
                speedup=throughput / baseline_throughput if baseline_throughput > 0 else None,
                median_speedup=median_speedup(group, baseline),
                time_to_first_token=sum(record.time_to_first_token for record in group) / len(group),
                tau=counted_tau(group) if counted else tau(lengths),
                acceptance_histogram=acceptance_histogram(lengths),
                differs_from_ar=count_differing(group, baseline) if greedy else None,
                token_shares=token_shares(group),
                speedup_over_plain=throughput / plain_throughput if plain_throughput > 0 else None,
                median_speedup_over_plain=median_speedup(group, plain) if plain else None,
                differs_from_llama_cpp=count_differing(group, llama_cpp) if greedy and llama_cpp else None,
                drafted=sum(record.drafted for record in group) if counted else None,
                accepted=sum(record.accepted for record in group) if counted else None,
            )
        )
    return summaries
