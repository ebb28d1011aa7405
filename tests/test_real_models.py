"""End to end on the real default target, SmolLM2-135M-Instruct (prepared from its PyPI package)."""

import pytest
import torch

import flashdraft
from flashdraft import DFlashDraftModel
from flashdraft.models import DEMO_MAX_NEW_TOKENS, DEMO_PROMPT, load_draft, load_target
from flashdraft.target import TargetModel, remember_engine

CODE_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that reverses the words of a sentence.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    """The default target as a user gets it: the engine's default arithmetic, int8 on the GGUF's own blocks."""
    model, tokenizer = load_target(str(smollm2_folder))
    assert TargetModel(model).engine.arithmetic == "int8"
    return model, tokenizer


@pytest.fixture(scope="module")
def smollm2_float32(smollm2_folder):
    model, tokenizer = load_target(str(smollm2_folder))
    remember_engine(model, "auto", arithmetic="float32")
    return model, tokenizer


def greedy(model, ids, max_new_tokens, stop):
    """transformers' own greedy decoding (float32)."""
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=stop, pad_token_id=stop[0])
    return out[0, len(ids):].tolist()


def plain(model, ids, max_new_tokens, stop):
    """The target's plain decoding on the engine, one token a step, in its arithmetic: what speculation must give."""
    return flashdraft.generate(model, None, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop,
                               block_size=1).tokens


@pytest.mark.slow
def test_float32_arithmetic_decodes_as_transformers_and_int8_as_its_own_plain_decoding(smollm2, smollm2_float32):
    draft = load_draft(None)
    for model, tokenizer in (smollm2_float32, smollm2):
        stop = flashdraft.stop_token_ids(model, tokenizer)
        ids = flashdraft.encode_chat(tokenizer, [{"role": "user", "content": CODE_PROMPTS[1]}])
        result = flashdraft.generate(model, draft, ids, max_new_tokens=40, stop_token_ids=stop)
        reference = greedy if model is smollm2_float32[0] else plain
        assert result.tokens == reference(model, ids, 40, stop)
    assert TargetModel(smollm2_float32[0]).engine.arithmetic == "float32"


@pytest.mark.slow
def test_fresh_draft_on_the_real_target_is_lossless(smollm2):
    model, tokenizer = smollm2
    torch.manual_seed(0)
    draft = DFlashDraftModel.for_target(model.config, num_layers=1, block_size=8, mask_token_id=16).eval()
    stop = flashdraft.stop_token_ids(model, tokenizer)
    ids = flashdraft.encode_chat(tokenizer, [{"role": "user", "content": "Name three colours."}])
    result = flashdraft.generate(model, draft, ids, max_new_tokens=24, stop_token_ids=stop)
    assert result.tokens == plain(model, ids, 24, stop)
    assert len(result.acceptance_lengths) >= 1


@pytest.mark.slow
def test_shipped_draft_is_lossless_and_still_accepts(smollm2):
    """A guard against silently breaking the shipped draft or the loop: outputs equal the target's own, and
    tau at the draft's own block size on fixed code prompts stays above a floor set well below the measured
    value."""
    model, tokenizer = smollm2
    draft = load_draft(None)
    stop = flashdraft.stop_token_ids(model, tokenizer)
    taus = []
    for prompt in CODE_PROMPTS:
        ids = flashdraft.encode_chat(tokenizer, [{"role": "user", "content": prompt}])
        result = flashdraft.generate(model, draft, ids, max_new_tokens=48, stop_token_ids=stop,
                                     block_size=draft.block_size,  # the draft's own acceptance, no lookup
                                     proposals="dflash")
        assert result.tokens == plain(model, ids, 48, stop)
        taus.append(result.tau)
    assert sum(taus) / len(taus) >= SHIPPED_TAU_FLOOR


@pytest.mark.slow
def test_prompts_decoded_together_get_exactly_what_each_gets_alone(smollm2):
    """Continuous batching (prompts of different lengths, a shared chat-template opening prefilled once) gives each
    prompt its own plain decoding, token for token, with the draft and without: the engine's int8 arithmetic
    computes every row of a batch, a chunk or a block as it computes it alone."""
    model, tokenizer = smollm2
    stop = flashdraft.stop_token_ids(model, tokenizer)
    prompts = [flashdraft.encode_chat(tokenizer, [{"role": "user", "content": text}])
               for text in [*CODE_PROMPTS, "Name three colours.", "Explain what a hash table is, with an example."]]
    alone = [plain(model, ids, 48, stop) for ids in prompts]
    for draft in (None, load_draft(None)):
        together = flashdraft.generate(model, draft, prompts, max_new_tokens=48, stop_token_ids=stop)
        assert [result.tokens for result in together] == alone


# Measured mean tau of the shipped draft on these prompts (48 tokens, its own block size, 8-bit draft products as by
# default here): 2.492 (2026-12-05, draft v17, block 8, bfloat16 on disk; v16 gave 2.565, though v17 replays
# above it on two benchmark sets and within noise on GSM8K; v15 2.478 and v14 2.571 in one session, though v15
# replays above v14 on all three; deterministic for these weights and the kernels
# a machine measures fastest: v13 gave 2.538 on v14's machine, 2.487 on the one before; v12 2.298 and v11 2.354
# on these three prompts, though v12 replays higher than v11 on all three benchmark sets; v9 2.177,
# v8 1.906, v6 1.785, v5 1.882, v4 1.595 and v3 1.401 at block 16, v2 1.333, the first draft 1.029). A draft or loop
# that never gets a proposal accepted gives exactly 1.0.
SHIPPED_TAU_FLOOR = 2.20


@pytest.mark.slow
def test_the_demo_prompt_gets_a_right_answer_that_ends_within_its_budget(smollm2):
    """The quick start's prompt (README) on the 135M demonstration target: a correct palindrome test, its code
    fence closed, ended by the model's end-of-turn token well before the budget (a prime test, the prompt before,
    repeated a wrong line until the cap)."""
    model, tokenizer = smollm2
    ids = flashdraft.encode_chat(tokenizer, [{"role": "user", "content": DEMO_PROMPT}])
    result = flashdraft.generate(model, load_draft(None), ids, max_new_tokens=DEMO_MAX_NEW_TOKENS,
                                 stop_token_ids=flashdraft.stop_token_ids(model, tokenizer))
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert result.stop_reason == "stop" and len(result.tokens) < DEMO_MAX_NEW_TOKENS * 3 // 4, text
    assert "def is_palindrome(s):\n    return s == s[::-1]\n```" in text
    assert text.count("```") % 2 == 0
    namespace = {}
    exec(text.split("```python\n")[1].split("```")[0], namespace)  # the answer's own code, run
    assert [namespace["is_palindrome"](word) for word in ("level", "abba", "", "flash")] == [True, True, True, False]
