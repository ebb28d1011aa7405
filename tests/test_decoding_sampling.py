"""Sampling is lossless: flashdraft's tokens follow the target's own sampling distribution.

The joint distribution of the first 3 generated tokens (tiny vocabulary, so it has few cells) from 10,000
flashdraft generations is compared with the target's exact distribution of them by a chi-square goodness-of-fit
test. The exact distribution is enumerated (every continuation the sampling settings leave possible, each step's
probabilities through transformers' warpers in `generate`'s order), and checked against 20,000 draws of the
target's own `generate(do_sample=True)` by the same test. Against exact probabilities, 10,000 draws test as finely
as the two-sample test of 20,000 draws a side did (the variance of a cell's difference is p(1-p)/m against
2p(1-p)/n), at half the generations. The same test rejects a deliberately biased acceptance rule (one that tests
sampled proposals as if they were the draft's argmax, ignoring q), which shows the tolerance is tight enough: from a
quarter of the draws (a test's power only grows with its draws, so what it rejects at 2,500 it rejects at 10,000;
measured, p < 1e-200 there, against the 1e-6 asserted).

Rows of a batch (`flashdraft.batching`) get the same test, with its negative control: every row of a batch follows
the target's distribution, whatever the other rows do.

Hybrid rounds (`flashdraft.proposals`) get the same test on a prompt that repeats itself, so the lookup finds
continuations: every round takes a plan drawn at random among all it could take (lookup tokens only, lookup then
draft, draft only, nothing), so each kind of round, one-hot and drawn q side by side, is covered. Its negative
control treats lookup tokens as drawn from a flat q instead of a one-hot one.
"""

import math
import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import flashdraft
import flashdraft.decoding as decoding
import flashdraft.proposals as proposers
from flashdraft.sampling import SamplingParams, accept_greedy, accept_sampled, greedy, probabilities, sample

from tiny import tiny_draft, tiny_target

SAMPLES = 10_000  # flashdraft's generations per test, against the exact distribution
REFERENCE_SAMPLES = 20_000  # the target's own generate() draws the exact distribution is checked against
NEGATIVE_SAMPLES = 2_500  # a negative control's generations: rejected far beyond its threshold from these already
VOCAB = 8
PROMPT = [2, 5, 3]
REPEATING_PROMPT = [2, 5, 3, 2, 5]  # the lookup finds a continuation after most first tokens
SETTINGS = dict(temperature=0.9, top_k=6, top_p=0.95)


def target_and_draft():
    target = tiny_target("llama", vocab_size=VOCAB, hidden_size=16, num_layers=2, heads=2, kv_heads=1, seed=3)
    with torch.no_grad():  # soften the sharpened head so several tokens keep real probability
        target.get_output_embeddings().weight.div_(8.0)
    draft = tiny_draft(target, num_layers=1, block_size=4, mask_token_id=0, seed=4)
    with torch.no_grad():
        draft.fc.weight.mul_(3.0)
    return target, draft


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the tiny model's operations are far too small to share, and on a shared 2-core machine a
    second thread only waits for a busy core (a generation took ~3 ms on one thread, 3-7 ms on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def target_samples(target, samples: int = REFERENCE_SAMPLES, prompt=PROMPT) -> Counter:
    torch.manual_seed(1234)
    out = target.generate(
        torch.tensor([prompt] * samples, device=target.device), do_sample=True, max_new_tokens=3, min_new_tokens=3,
        pad_token_id=0, eos_token_id=None, **SETTINGS,
    )
    return Counter(tuple(row) for row in out[:, len(prompt):].tolist())


def flashdraft_samples(
    target, draft, samples: int = SAMPLES, prompt=PROMPT, proposals: str = "dflash"
) -> tuple[Counter, float]:
    counts, lengths = Counter(), []
    for seed in range(samples):
        # 4 new tokens at block 4: the first round drafts 2 proposals, so tokens 2 and 3 come from every
        # path (both accepted, a rejection at either, the bonus).
        result = flashdraft.generate(target, draft, prompt, max_new_tokens=4, block_size=4, seed=seed,
                                     proposals=proposals, **SETTINGS)
        counts[tuple(result.tokens[:3])] += 1
        lengths.append(result.acceptance_lengths[0])
    return counts, sum(lengths) / len(lengths)


def exact_distribution(target, prompt=PROMPT) -> dict[tuple, float]:
    """The target's exact probability of each sequence of its first 3 sampled tokens under SETTINGS, for every
    sequence they leave possible: enumerated step by step, each step's probabilities from transformers' warpers in
    the order `generate` applies them (temperature, top-k, top-p), in float32 as `generate` computes them."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(SETTINGS["temperature"]),
                                   TopKLogitsWarper(SETTINGS["top_k"]), TopPLogitsWarper(SETTINGS["top_p"])])
    distribution = {(): 1.0}
    for _ in range(3):
        ids = torch.tensor([[*prompt, *prefix] for prefix in distribution], device=target.device)
        with torch.no_grad():
            scores = warpers(ids, target(ids).logits[:, -1].float())
        steps = torch.softmax(scores, dim=-1).double().tolist()
        distribution = {(*prefix, token): mass * p for (prefix, mass), step in zip(distribution.items(), steps)
                        for token, p in enumerate(step) if p > 0}
    return distribution


def fit_p_value(counts: Counter, exact: dict[tuple, float]) -> float:
    """Chi-square goodness-of-fit test of the sampled `counts` against the `exact` distribution; cells expected
    fewer than 10 times are pooled with their neighbours in order of probability into groups expected at least 10
    times (a partition fixed by the exact distribution and the sample size alone); a sample the exact distribution
    gives no probability fails at once (0.0). p-value from the Wilson-Hilferty normal approximation."""
    n = sum(counts.values())
    if any(cell not in exact for cell in counts):
        return 0.0
    pairs, observed, expected = [], 0, 0.0
    for cell, p in sorted(exact.items(), key=lambda item: item[1]):
        observed, expected = observed + counts[cell], expected + n * p
        if expected >= 10:
            pairs.append((observed, expected))
            observed, expected = 0, 0.0
    if expected > 0:  # what is left (the likeliest cells, when even they are expected fewer than 10 times)
        pairs[-1] = (pairs[-1][0] + observed, pairs[-1][1] + expected) if pairs else (observed, expected)
    if len(pairs) < 2:
        return 1.0  # too few draws to tell anything
    statistic = sum((o - e) ** 2 / e for o, e in pairs)
    return wilson_hilferty(statistic, len(pairs) - 1)


def wilson_hilferty(statistic: float, df: int) -> float:
    """P(chi-square with `df` degrees of freedom >= statistic), by the Wilson-Hilferty normal approximation."""
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def biased_accept(proposals, q, p, generator):
    """Wrong on purpose: accepts a sampled proposal with probability p(x), as if q(x) were 1 (argmax)."""
    p_proposed = p[:-1].gather(1, proposals[:, None]).squeeze(1)
    u = torch.rand(proposals.shape, generator=generator, device=proposals.device)
    accepted = (u <= p_proposed).cumprod(dim=0).sum()
    residual = (p[:-1] - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:-1])
    bonus = sample(torch.cat([residual, p[-1:]])[accepted][None], generator)[0]
    return accepted, bonus


@pytest.fixture(scope="module")
def setup():
    target, draft = target_and_draft()
    return target, draft, exact_distribution(target)


@pytest.mark.parametrize("prompt", [PROMPT, REPEATING_PROMPT])
def test_the_exact_distribution_is_the_one_generate_samples(prompt):
    """The reference of the tests below, checked against the target's own sampling: 20,000 `generate` draws."""
    target, _ = target_and_draft()
    exact = exact_distribution(target, prompt)
    assert sum(exact.values()) == pytest.approx(1.0) and len(exact) > 20  # several tokens likely at each step
    assert fit_p_value(target_samples(target, prompt=prompt), exact) > 1e-4
    # and the test tells another distribution from it: the same draws with one candidate fewer at each step
    torch.manual_seed(1234)
    out = target.generate(torch.tensor([prompt] * REFERENCE_SAMPLES), do_sample=True, max_new_tokens=3,
                          min_new_tokens=3, pad_token_id=0, eos_token_id=None, **{**SETTINGS, "top_k": 5})
    narrower = Counter(tuple(row) for row in out[:, len(prompt):].tolist())
    assert fit_p_value(narrower, exact) < 1e-6


def test_sampling_follows_the_target_distribution(setup):
    target, draft, exact = setup
    counts, mean_first_round = flashdraft_samples(target, draft)
    assert 1.3 < mean_first_round < 2.9, "the draft must drive both acceptances and rejections"
    assert fit_p_value(counts, exact) > 1e-4


def test_a_biased_acceptance_rule_fails_the_same_test(setup, monkeypatch):
    target, draft, exact = setup
    monkeypatch.setattr(decoding, "accept_sampled", biased_accept)
    counts, _ = flashdraft_samples(target, draft, NEGATIVE_SAMPLES)
    assert fit_p_value(counts, exact) < 1e-6


@pytest.fixture(scope="module")
def hybrid_setup():
    target, draft = target_and_draft()
    return target, draft, exact_distribution(target, REPEATING_PROMPT)


@pytest.fixture
def random_plans(monkeypatch):
    """Every hybrid round takes a plan drawn at random (from its own generator: independent of the target's draws,
    as every real choice is) among all it could take; counts the kinds of rounds taken."""
    rng, kinds = random.Random(0), Counter()

    def plan(self, continuation, n, size):
        found = len(continuation)  # at most size - 1
        kind = rng.choice(["none", "draft"] + ["lookup"] * (found > 0) + ["lookup then draft"] * (found > 0 < size - 2))
        kinds[kind] += 1
        if kind == "none":
            return proposers.Plan(0, 1, False)
        if kind == "draft":
            return proposers.Plan(0, rng.randint(2, size), True)
        if kind == "lookup":
            lookup = rng.randint(1, found)
            return proposers.Plan(lookup, lookup + 1, False)
        lookup = rng.randint(1, min(found, size - 2))
        return proposers.Plan(lookup, rng.randint(lookup + 2, size), True)

    monkeypatch.setattr(proposers.HybridProposer, "plan", plan)
    return kinds


def test_hybrid_sampling_follows_the_target_distribution(hybrid_setup, random_plans):
    target, draft, exact = hybrid_setup
    counts, _ = flashdraft_samples(target, draft, prompt=REPEATING_PROMPT, proposals="hybrid")
    assert min(random_plans.values()) > 0.05 * sum(random_plans.values()), random_plans  # every kind, often
    assert fit_p_value(counts, exact) > 1e-4


def test_lookup_tokens_tested_as_if_drawn_from_a_flat_q_fail_the_same_test(hybrid_setup, random_plans, monkeypatch):
    target, draft, exact = hybrid_setup
    monkeypatch.setattr(proposers, "lookup_q", lambda tokens, vocab_size: torch.full((len(tokens), vocab_size),
                                                                                   1 / vocab_size))
    counts, _ = flashdraft_samples(target, draft, NEGATIVE_SAMPLES, prompt=REPEATING_PROMPT, proposals="hybrid")
    assert fit_p_value(counts, exact) < 1e-6


BATCH_SAMPLES = 5_000  # per prompt, against the exact distribution (as 10,000 against 10,000 generate draws)


@pytest.fixture(scope="module")
def batch_setup():
    target, draft = target_and_draft()
    references = {tuple(prompt): exact_distribution(target, prompt) for prompt in (PROMPT, REPEATING_PROMPT)}
    return target, draft, references


def batched_samples(target, draft, rows: int = 200) -> dict[tuple, Counter]:
    """BATCH_SAMPLES sequences of each prompt decoded in batches of `rows` (`flashdraft.Batch`), the two prompts
    (of different lengths) alternating, half of each batch joining it after its first round, a greedy row among
    them (which must get the greedy tokens). Each sequence has its own seed."""
    counts = {tuple(PROMPT): Counter(), tuple(REPEATING_PROMPT): Counter()}
    greedy = flashdraft.generate(target, draft, PROMPT, max_new_tokens=4).tokens
    seed = 0
    for _ in range(2 * BATCH_SAMPLES // rows):
        batch = flashdraft.Batch(target, draft, block_size=4, proposals="hybrid")
        sequences = [(None, batch.add(PROMPT, max_new_tokens=4))]
        for i in range(rows):
            prompt = PROMPT if i % 2 else REPEATING_PROMPT
            sequences.append((tuple(prompt), batch.add(prompt, max_new_tokens=4, seed=seed, **SETTINGS)))
            seed += 1
            if i == rows // 2:
                batch.step()
        while batch:
            batch.step()
        for prompt, sequence in sequences:
            if prompt is None:
                assert sequence.result.tokens == greedy
            else:
                counts[prompt][tuple(sequence.result.tokens[:3])] += 1
    return counts


def test_batched_sampling_follows_the_target_distribution_in_every_row(batch_setup, random_plans):
    """Rows drafted together in one pass, next to rows with lookup rounds, plain rounds and a greedy row."""
    target, draft, references = batch_setup
    counts = batched_samples(target, draft)
    assert min(random_plans.values()) > 0.05 * sum(random_plans.values()), random_plans
    for prompt, exact in references.items():
        assert fit_p_value(counts[prompt], exact) > 1e-4, prompt


def test_a_biased_acceptance_rule_fails_the_batched_test(batch_setup, random_plans, monkeypatch):
    target, draft, references = batch_setup
    monkeypatch.setattr(decoding, "accept_sampled", biased_accept)
    counts = batched_samples(target, draft)
    assert fit_p_value(counts[tuple(PROMPT)], references[tuple(PROMPT)]) < 1e-6


def test_seed_makes_sampling_reproducible():
    target, draft = target_and_draft()
    runs = [flashdraft.generate(target, draft, PROMPT, max_new_tokens=20, seed=7, **SETTINGS).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------ the acceptance rules, exactly


def test_accept_greedy_counts_the_matching_prefix():
    logits = torch.full((4, 5), -1.0)
    for position, token in enumerate([3, 1, 4, 2]):
        logits[position, token] = 1.0  # target argmax after anchor, after proposal 1, 2, 3
    for proposals, accepted, bonus in (([3, 1, 4], 3, 2), ([3, 1, 0], 2, 4), ([0, 1, 4], 0, 3), ([3, 0, 4], 1, 1)):
        n, b = accept_greedy(torch.tensor(proposals), logits)
        assert (int(n), int(b)) == (accepted, bonus)


def test_greedy_is_torchs_argmax_ties_and_nan_included():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 50), generator=generator).float()  # many exact ties: the first one wins
    logits[2, 7] = float("nan")  # a NaN counts as the largest, as in torch
    for case in (logits, logits.T, logits[:, ::3], logits[0], torch.randn(3, 4, 9, generator=generator)):
        picked = greedy(case)
        assert picked.dtype == torch.long and torch.equal(picked, case.argmax(dim=-1))
    assert torch.equal(greedy(logits.double()), logits.argmax(dim=-1))  # other dtypes: torch's own


def test_accept_greedy_with_no_proposals_is_one_autoregressive_step():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    n, b = accept_greedy(torch.empty(0, dtype=torch.long), logits)
    assert (int(n), int(b)) == (0, 1)


def test_accept_sampled_accepts_everything_when_draft_equals_target():
    p = torch.softmax(torch.randn(5, 6), -1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        proposals = sample(p[:-1], generator)
        n, _ = accept_sampled(proposals, p[:-1], p, generator)
        assert int(n) == 4


def test_accept_sampled_rejects_tokens_the_target_excludes_and_resamples_inside_its_support():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0]])  # proposes token 3, which p gives probability 0
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, bonus = accept_sampled(torch.tensor([3]), q, p, generator)
        assert int(n) == 0 and int(bonus) in (1, 2)


def test_probabilities_apply_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, 1.0, 2)), torch.tensor([[0.625, 0.375, 0, 0]]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, 0.7, 0)), torch.tensor([[0.625, 0.375, 0, 0]]))
    hot = probabilities(logits, SamplingParams(2.0, 1.0, 0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


# ------------------------------------------------------------------ temperatures near 0


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    # logits / T overflows float32 here; the limit of sampling as T -> 0 is the argmax, i.e. greedy decoding.
    target, draft = target_and_draft()
    greedy = flashdraft.generate(target, draft, PROMPT, max_new_tokens=20, block_size=4).tokens
    for seed in range(3):
        sampled = flashdraft.generate(
            target, draft, PROMPT, max_new_tokens=20, block_size=4, temperature=temperature, seed=seed, **{
                key: value for key, value in SETTINGS.items() if key != "temperature"
            },
        )
        assert sampled.tokens == greedy


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_probabilities_at_a_tiny_temperature_are_the_argmax_shared_among_ties(temperature):
    logits = torch.tensor([[4.0, 3.9, -1.0, 0.0], [2.0, -3.0, 2.0, 1.0], [-5.0, -7.0, float("-inf"), -5.5]])
    expected = torch.tensor([[1.0, 0, 0, 0], [0.5, 0, 0.5, 0], [1.0, 0, 0, 0]])
    assert torch.equal(probabilities(logits, SamplingParams(temperature)), expected)
    assert torch.equal(probabilities(logits, SamplingParams(temperature, 0.9, 3)), expected)


def test_where_logits_over_t_overflow_the_distribution_is_still_exact_not_rounded_to_the_argmax():
    # T below float32's smallest number: transformers' division gives inf and NaN. The logits differ by a
    # subnormal amount, so at this T the exact distribution is exp((l - max l) / T) normalised, far from one-hot.
    logits = torch.tensor([[1.4e-45, 0.0, -1.0]])
    expected = torch.softmax((logits.double() - logits.double().max()) / 5e-46, -1).float()
    probs = probabilities(logits, SamplingParams(5e-46))
    assert torch.allclose(probs, expected) and 0.01 < float(probs[0, 1]) < 0.99


@pytest.mark.parametrize("temperature", [1e-6, 0.01, 0.7, 1.3])
def test_wherever_logits_over_t_stay_finite_transformers_warpers_are_used_unchanged(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 5
    assert torch.equal(probabilities(logits, SamplingParams(temperature)), torch.softmax(logits / temperature, -1))
