"""Benchmark metric arithmetic on hand-made records, with exact expected values."""

import pytest

from flashdraft.bench.metrics import count_differing, decode_tokens_per_second, median_speedup, summarize
from flashdraft.bench.runner import Record
from flashdraft.decoding import acceptance_histogram, tau


def record(method, tokens, seconds, first_token, lengths=(), dataset="d", sample="s0", turn=0):
    return Record(dataset, sample, turn, method, 5, list(tokens), seconds, first_token, list(lengths))


def test_tau_is_the_mean_acceptance_length():
    assert tau([1, 3, 4, 2]) == 2.5
    assert tau([7]) == 7.0
    assert tau([]) == 0.0


def test_histogram_counts_rounds_by_length_in_increasing_order():
    histogram = acceptance_histogram([3, 1, 3, 16, 1, 3])
    assert histogram == {1: 2, 3: 3, 16: 1}
    assert list(histogram) == [1, 3, 16]
    assert acceptance_histogram([]) == {}


def test_decode_throughput_pools_tokens_after_the_first_over_decode_time():
    records = [record("ar", range(11), 2.5, 0.5), record("ar", range(5), 1.5, 0.5)]
    # (10 + 4) tokens over (2.0 + 1.0) seconds
    assert decode_tokens_per_second(records) == pytest.approx(14 / 3)
    assert decode_tokens_per_second([record("ar", [4], 1.0, 1.0)]) == 0.0


def test_count_differing_matches_records_by_sample_and_turn():
    baseline = [record("ar", [1, 2], 1, 0, sample="a"), record("ar", [3], 1, 0, sample="a", turn=1),
                record("ar", [5, 6], 1, 0, sample="b")]
    other = [record("x", [3], 1, 0, sample="a", turn=1), record("x", [1, 2], 1, 0, sample="a"),
             record("x", [5, 7], 1, 0, sample="b")]
    assert count_differing(other, baseline) == 1
    assert count_differing(baseline, baseline) == 0


def test_median_speedup_pairs_each_prompt_with_the_baseline_on_the_same_prompt():
    baseline = [record("ar", range(5), 2.0, 0.0, sample="a"),  # 2 tok/s
                record("ar", range(5), 4.0, 0.0, sample="b"),  # 1 tok/s (a slow spell)
                record("ar", range(5), 1.0, 0.0, sample="c"),  # 4 tok/s
                record("ar", range(5), 1.0, 0.0, sample="c", turn=1)]  # 4 tok/s
    spec = [record("x", range(5), 1.0, 0.0, sample="b"),  # 4 tok/s: 4x its own prompt's baseline
            record("x", range(5), 0.5, 0.0, sample="a"),  # 8 tok/s: 4x
            record("x", range(5), 0.5, 0.0, sample="c"),  # 8 tok/s: 2x
            record("x", range(5), 2.0, 0.0, sample="c", turn=1)]  # 2 tok/s: 0.5x
    assert median_speedup(spec, baseline) == pytest.approx(3.0)  # median of 0.5, 2, 4, 4
    # pooled: 16 tokens in 4 s against 16 tokens in 8 s
    assert decode_tokens_per_second(spec) / decode_tokens_per_second(baseline) == pytest.approx(2.0)
    # a prompt whose answer has one token has no decode rate and no ratio
    assert median_speedup([record("x", [1], 1.0, 0.0, sample="a")], baseline) is None


def test_summary_per_dataset_and_method():
    records = [
        # dataset d: ar decodes 8 tokens in 4 s (2 tok/s); spec decodes 8 tokens in 1 s (8 tok/s)
        record("ar", range(9), 4.5, 0.5, [1] * 8),
        record("spec", range(9), 1.25, 0.25, [4, 3, 1]),
        # dataset e: spec differs from ar on one of two prompts; spec ran first here, the rows keep d's order
        record("spec", [1, 2, 3], 1.0, 0.5, [2], dataset="e", sample="p"),
        record("ar", [1, 2, 3], 2.0, 1.0, [1, 1], dataset="e", sample="p"),
        record("ar", [4, 5, 6], 2.0, 1.0, [1, 1], dataset="e", sample="q"),
        record("spec", [4, 5, 9], 1.0, 0.5, [2], dataset="e", sample="q"),
    ]
    summaries = {(s.dataset, s.method): s for s in summarize(records, greedy=True)}
    assert list(summaries) == [("d", "ar"), ("d", "spec"), ("e", "ar"), ("e", "spec")]
    spec = summaries["d", "spec"]
    assert spec.prompts == 1 and spec.output_tokens == 9.0
    assert spec.decode_tokens_per_second == pytest.approx(8.0)
    assert spec.speedup == pytest.approx(4.0)
    assert spec.time_to_first_token == pytest.approx(0.25)
    assert spec.tau == pytest.approx(8 / 3)
    assert spec.acceptance_histogram == {1: 1, 3: 1, 4: 1}
    assert spec.differs_from_ar == 0
    assert summaries["d", "ar"].speedup == 1.0 and summaries["d", "ar"].tau == 1.0
    e = summaries["e", "spec"]
    # ar: 4 tokens / 2 s = 2 tok/s; spec: 4 tokens / 1 s = 4 tok/s
    assert e.speedup == pytest.approx(2.0)
    assert e.median_speedup == pytest.approx(2.0)
    assert e.differs_from_ar == 1
    assert e.tau == 2.0 and e.acceptance_histogram == {2: 2}
    assert summaries["e", "ar"].time_to_first_token == 1.0


def test_speedups_over_flashdraft_plain_where_it_ran():
    records = [  # decode seconds: the seconds after the first token
        # s0: ar decodes 8 tokens in 4 s, flashdraft-plain in 2 s, spec in 1 s; s1: 4 s, 1 s and 1 s
        record("ar", range(9), 4.5, 0.5),
        record("flashdraft-plain", range(9), 2.25, 0.25),
        record("spec", range(9), 1.25, 0.25),
        record("ar", range(9), 4.5, 0.5, sample="s1"),
        record("flashdraft-plain", range(9), 1.25, 0.25, sample="s1"),
        record("spec", range(9), 1.25, 0.25, sample="s1"),
        record("ar", range(5), 2.5, 0.5, dataset="e"),  # no flashdraft-plain on this dataset
        record("spec", range(5), 1.5, 0.5, dataset="e"),
    ]
    summaries = {(s.dataset, s.method): s for s in summarize(records, greedy=True)}
    spec = summaries["d", "spec"]
    # pooled: 16 tokens in 8 s (ar), 3 s (flashdraft-plain), 2 s (spec)
    assert spec.speedup == pytest.approx(4.0)
    assert spec.speedup_over_plain == pytest.approx(1.5)
    assert spec.median_speedup_over_plain == pytest.approx(1.5)  # s0 2x, s1 1x
    assert summaries["d", "flashdraft-plain"].speedup_over_plain == 1.0
    assert summaries["d", "ar"].speedup_over_plain == pytest.approx(3 / 8)
    assert summaries["e", "spec"].speedup == pytest.approx(2.0)
    assert summaries["e", "spec"].speedup_over_plain is None
    assert summaries["e", "spec"].median_speedup_over_plain is None


def test_token_shares_pool_the_sources_of_every_record():
    records = [
        record("ar", range(4), 1.0, 0.5),
        Record("d", "s0", 0, "hybrid", 5, list(range(4)), 1.0, 0.5, [2, 1], {"target": 2, "lookup": 2}),
        Record("d", "s1", 0, "hybrid", 5, list(range(6)), 1.0, 0.5, [3, 2], {"target": 3, "lookup": 2, "dflash": 1}),
    ]
    summaries = {s.method: s for s in summarize(records, greedy=False)}
    assert summaries["hybrid"].token_shares == pytest.approx({"target": 0.5, "lookup": 0.4, "dflash": 0.1})
    assert summaries["ar"].token_shares == {}  # a method that does not say


def test_a_dataset_with_later_turns_is_summarised_per_turn():
    records = [record(method, [1, 2], 1.0, 0.5, turn=turn, sample=sample) for turn in (1, 0)
               for sample in ("a", "b") for method in ("ar", "spec")]
    records.append(record("ar", [1], 1.0, 0.5, dataset="single"))
    summaries = summarize(records, greedy=True)
    assert [(s.dataset, s.method, s.prompts) for s in summaries] == [
        ("d turn 1", "ar", 2), ("d turn 1", "spec", 2), ("d turn 2", "ar", 2), ("d turn 2", "spec", 2),
        ("single", "ar", 1)]


def test_sampling_leaves_exactness_out():
    records = [record("ar", [1, 2], 1.0, 0.5), record("spec", [3, 4], 1.0, 0.5)]
    assert {s.differs_from_ar for s in summarize(records, greedy=False)} == {None}


def test_a_dataset_without_ar_is_an_error():
    with pytest.raises(ValueError, match="no 'ar' records"):
        summarize([record("spec", [1], 1.0, 0.5)], greedy=True)
