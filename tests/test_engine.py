"""The CPU engine (flashdraft/engine.py): the same numbers as transformers' forward, on every kernel, every cache
operation and every fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from threadpoolctl import threadpool_info
from torch import nn

from flashdraft import native
from flashdraft.decoding import generate
from flashdraft.draft import DraftCache, RowDraftCache
from flashdraft.engine import (
    KERNEL_ROWS,
    NATIVE_ATTENTION_QUERIES,
    PRODUCTS,
    DraftEngine,
    Engine,
    EngineCache,
    KernelChoice,
    KernelLinear,
    available_products,
    cached_kernels,
    measure_kernels,
    unsupported_reason,
)
from flashdraft.models import cache_home, load_target
from flashdraft.proposals import DFlashProposer
from flashdraft.target import TargetModel

from tiny import ARCHITECTURES, tiny_draft, tiny_target, tiny_tokenizer

KINDS = ("qkv", "o", "gate_up", "down", "head")


def uniform(name: str) -> KernelChoice:
    """Every product through one kernel."""
    return KernelChoice({kind: {rows: name for rows in KERNEL_ROWS} for kind in KINDS})


def both(arch: str = "llama", **kwargs) -> tuple[TargetModel, TargetModel]:
    """The same tiny model seen through the engine and through transformers."""
    model = tiny_target(arch, **kwargs)
    return TargetModel(model, engine="flashdraft"), TargetModel(model, engine="transformers")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kernel", list(available_products()))
def test_logits_and_features_match_transformers(arch, kernel):
    engine_target, reference = both(arch)
    engine_target.engine.kernels = uniform(kernel)
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(30)[None]
    ours, theirs = engine_target.new_cache(), reference.new_cache()
    assert isinstance(ours, EngineCache)
    for window in (slice(0, 20), slice(20, 21), slice(21, 25), slice(25, 30)):  # prefill, a step, two blocks
        logits, features = engine_target.forward(ids[:, window], positions[:, window], ours, [0, 2, 3])
        expected, expected_features = reference.forward(ids[:, window], positions[:, window], theirs, [0, 2, 3])
        assert logits.shape == expected.shape and features.shape == expected_features.shape
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(features, expected_features, rtol=1e-4, atol=1e-5)


def test_logits_to_keep_and_feature_order():
    engine_target, reference = both()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    logits, features = engine_target.forward(ids, torch.arange(12)[None], engine_target.new_cache(), [3, 1], 1)
    expected, expected_features = reference.forward(ids, torch.arange(12)[None], reference.new_cache(), [3, 1], 1)
    assert logits.shape == (1, 1, 96)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(features, expected_features, rtol=1e-4, atol=1e-5)  # layer 3's first, as asked


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plain_and_speculative_decoding_equal_transformers_generate(arch):
    model = tiny_target(arch)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 9:].tolist()
    target = TargetModel(model)
    assert target.engine_name == "flashdraft"
    assert generate(target, None, prompt, max_new_tokens=40).tokens == expected
    draft = tiny_draft(model, block_size=6)
    for block_size in (2, 4, 6):
        assert generate(target, draft, prompt, max_new_tokens=40, block_size=block_size).tokens == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", ["default", "off"])
def test_attention_on_the_native_kernel_keeps_the_engine_exact(monkeypatch, arch, setting):
    if setting == "off":
        monkeypatch.setenv("FLASHDRAFT_NATIVE_ATTENTION", "0")
    model = tiny_target(arch, hidden_size=128, heads=2, kv_heads=1)  # head_dim 64: the native kernel's shape
    engine_target, reference = TargetModel(model, engine="flashdraft"), TargetModel(model, engine="transformers")
    assert engine_target.engine.native_attention == (native.available() and setting == "default")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(40)[None]
    ours, theirs = engine_target.new_cache(), reference.new_cache()
    for window in (slice(0, 20), slice(20, 21), slice(21, 25), slice(25, 33), slice(33, 34)):  # 1, 4 and 8 tokens
        logits, _ = engine_target.forward(ids[:, window], positions[:, window], ours, [])
        expected, _ = reference.forward(ids[:, window], positions[:, window], theirs, [])
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    prompt = ids[:, :9]
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 9:].tolist()
    assert generate(engine_target, None, prompt, max_new_tokens=40).tokens == expected
    draft = tiny_draft(model, block_size=4)
    assert generate(engine_target, draft, prompt, max_new_tokens=40, block_size=4).tokens == expected


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kernel", ["native", "native-parallel"])
def test_a_decoding_steps_layers_run_as_one_native_call_each_with_the_same_result(monkeypatch, arch, kernel):
    model = tiny_target(arch, hidden_size=128, heads=2, kv_heads=1)  # head_dim 64: the native kernel's shape
    engine = Engine(model)
    engine.kernels = uniform(kernel)
    calls = []
    decoder_layer = native.unchecked_decoder_layer
    monkeypatch.setattr(native, "unchecked_decoder_layer", lambda *args, **kwargs: calls.append(1) or decoder_layer(
        *args, **kwargs))
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(40)[None]
    caches = {True: engine.new_cache(), False: engine.new_cache()}
    limit = NATIVE_ATTENTION_QUERIES["threads" if torch.get_num_threads() > 1 else "one thread"]
    for window in (slice(0, 20), slice(20, 21), slice(21, 25), slice(25, 33), slice(33, 34)):  # 1, 4 and 8 tokens
        results = {}
        for native_layers, cache in caches.items():
            engine.use_native_layers = native_layers
            calls.clear()
            results[native_layers] = engine.forward(ids[:1, window], positions[:, window], cache, [1, 3])
            n = window.stop - window.start
            assert len(calls) == (4 if native_layers and n <= limit else 0)  # a prompt's prefill: operators
        (logits, features), (expected, expected_features) = results[True], results[False]
        assert torch.equal(logits, expected) and torch.equal(features, expected_features)
    for layer in range(4):
        assert torch.equal(caches[True].keys[layer][:, :, :34], caches[False].keys[layer][:, :, :34])
        assert torch.equal(caches[True].values[layer][:, :, :34], caches[False].values[layer][:, :, :34])
    engine.use_native_layers = True
    calls.clear()
    engine.kernels = uniform("torch")  # a product off the native kernel: operators
    engine.forward(ids[:1, 20:21], positions[:, 20:21], caches[True])
    assert calls == []


@pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.unavailable_reason()}")
@pytest.mark.parametrize("kernel", ["native", "native-parallel"])
def test_a_left_padded_batchs_steps_run_natively_each_row_as_it_runs_alone(monkeypatch, kernel):
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)
    engine = Engine(model)
    engine.kernels = uniform(kernel)
    calls = []
    decoder_layer = native.unchecked_decoder_layer
    monkeypatch.setattr(native, "unchecked_decoder_layer", lambda *args, **kwargs: calls.append(1) or decoder_layer(
        *args, **kwargs))
    generator = torch.Generator().manual_seed(6)
    lengths, width = (23, 30, 17), 30  # prompts longer than a native step: every prefill runs the operators
    prompts = [torch.randint(0, 96, (1, length), generator=generator) for length in lengths]
    alone = [engine.new_cache() for _ in lengths]
    for prompt, cache in zip(prompts, alone):
        engine.forward(prompt, torch.arange(prompt.shape[1])[None], cache)
    padding = torch.arange(width)[None] < torch.tensor([width - length for length in lengths])[:, None]
    ids = torch.zeros(3, width, dtype=torch.long)
    ids[~padding] = torch.cat([prompt[0] for prompt in prompts])
    positions = (torch.cumsum(~padding, dim=1) - 1).clamp(min=0)
    batch = engine.new_cache()
    engine.forward(ids, positions, batch, padding=padding)
    assert calls == [] and batch.leading_padding.tolist() == [7, 0, 13]
    for row, (cache, length) in enumerate(zip(alone, lengths)):  # the rows' own keys, so that steps compare exactly
        batch.keys[:, row, :, width - length : width] = cache.keys[:, 0, :, :length]
        batch.values[:, row, :, width - length : width] = cache.values[:, 0, :, :length]
    operators = engine.new_cache()
    engine.use_native_layers = False
    engine.forward(ids, positions, operators, padding=padding)
    engine.use_native_layers = True
    for step in range(3):
        tokens = torch.randint(0, 96, (3, 1), generator=generator)
        at = torch.tensor(lengths)[:, None] + step
        calls.clear()
        logits, _ = engine.forward(tokens, at, batch)
        assert len(calls) == 4  # one native call a layer for the whole batch
        for row, cache in enumerate(alone):
            expected, _ = engine.forward(tokens[row : row + 1], at[row : row + 1], cache)
            assert torch.equal(logits[row], expected[0])
        engine.use_native_layers = False
        by_operators, _ = engine.forward(tokens, at, operators)  # torch's masked attention: the same within rounding
        engine.use_native_layers = True
        torch.testing.assert_close(logits, by_operators, rtol=1e-4, atol=1e-4)
    batch.select_rows(torch.tensor([2, 0]))  # rows that finish leave, with their padding
    assert batch.leading_padding.tolist() == [13, 7]
    calls.clear()
    logits, _ = engine.forward(torch.tensor([[5], [6]]), torch.tensor([[20], [26]]), batch)
    assert len(calls) == 4
    assert torch.equal(logits[0], engine.forward(torch.tensor([[5]]), torch.tensor([[20]]), alone[2])[0][0])
    inner = engine.new_cache()  # padding that does not lead its row: the operators' mask
    engine.forward(ids[:2, :4], positions[:2, :4], inner, padding=torch.tensor([[True, False, True, False]] * 2))
    calls.clear()
    engine.forward(ids[:2, 4:5], positions[:2, 4:5], inner)
    assert inner.leading_padding is None and calls == []


def test_rollback_is_a_length():
    engine_target, reference = both()
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(20)[None]
    cache = engine_target.new_cache()
    engine_target.forward(ids[:, :10], positions[:, :10], cache, None)
    engine_target.forward(torch.randint(0, 96, (1, 5)), positions[:, 10:15], cache, None)  # a rejected block
    engine_target.rollback(cache, 5)
    assert cache.get_seq_length() == 10
    logits, _ = engine_target.forward(ids[:, 10:20], positions[:, 10:20], cache, None)
    expected, _ = reference.forward(ids, positions, reference.new_cache(), None)
    torch.testing.assert_close(logits, expected[:, 10:], rtol=1e-4, atol=1e-4)


def test_cache_grows_past_its_first_capacity():
    engine_target, reference = both(max_positions=1024)
    ids = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(300)[None]
    cache, theirs = engine_target.new_cache(), reference.new_cache()
    engine_target.forward(ids[:, :250], positions[:, :250], cache, None)
    reference.forward(ids[:, :250], positions[:, :250], theirs, None)
    assert cache.capacity == 256
    logits, _ = engine_target.forward(ids[:, 250:], positions[:, 250:], cache, None)  # grows to 512
    expected, _ = reference.forward(ids[:, 250:], positions[:, 250:], theirs, None)
    assert cache.capacity == 512
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_padded_batch_matches_transformers(arch):
    engine_target, reference = both(arch)
    prompts = [[5, 6, 7], list(range(10, 30)), [40, 41, 42, 43, 44, 45, 46]]
    stop = [17]
    ours = engine_target.generate_batch(prompts, 25, stop)
    assert ours == reference.generate_batch(prompts, 25, stop)
    for prompt, answer in zip(prompts, ours):  # and each row is what it gives alone
        assert answer == engine_target.generate_batch([prompt], 25, stop)[0]


def test_the_models_own_forward_is_unchanged_by_fusing():
    model = tiny_target()
    ids = torch.randint(0, 96, (1, 15), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(ids).logits
    engine = TargetModel(model).engine
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    projection = model.model.layers[0].self_attn.k_proj.weight
    assert projection.data_ptr() != model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert engine.layers[0].qkv.untyped_storage().data_ptr() == projection.untyped_storage().data_ptr()  # a view
    assert set(model.state_dict()) == set(tiny_target().state_dict())


def test_one_engine_per_model_rebuilt_when_weights_are_replaced():
    model = tiny_target()
    first = TargetModel(model).engine
    assert TargetModel(model).engine is first
    with torch.no_grad():
        model.model.embed_tokens.weight = nn.Parameter(model.model.embed_tokens.weight.clone())
    second = TargetModel(model).engine
    assert second is not first and second.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_fallbacks_say_why():
    model = tiny_target()
    assert unsupported_reason(model) is None
    assert TargetModel(model, engine="transformers").engine is None
    assert TargetModel(model, engine="transformers").engine_name == "transformers"
    hooked = tiny_target(forbid_token=3)
    assert "hooks" in unsupported_reason(hooked)
    assert TargetModel(hooked).engine is None
    with pytest.raises(ValueError, match="hooks.*engine=\"transformers\""):
        TargetModel(hooked, engine="flashdraft")
    assert "bfloat16" in unsupported_reason(tiny_target().to(torch.bfloat16))
    biased = tiny_target()
    biased.lm_head.bias = nn.Parameter(torch.zeros(96))
    assert "biases" in unsupported_reason(biased)
    with pytest.raises(ValueError, match="engine must be one of"):
        TargetModel(model, engine="fast")


def test_a_hooked_head_still_runs_through_transformers():
    model = tiny_target(forbid_token=3)
    result = generate(model, None, torch.tensor([[3, 3, 3]]), max_new_tokens=30)
    assert 3 not in result.tokens


def test_kernel_linear_keeps_parameters_and_gradients():
    torch.manual_seed(0)
    linear = nn.Linear(16, 24)
    x = torch.randn(5, 3, 16)
    for name in available_products():
        fast = KernelLinear.replacing(linear, "qkv", KernelChoice({"qkv": {r: name for r in KERNEL_ROWS}}))
        assert fast.weight is linear.weight and fast.bias is linear.bias
        assert set(fast.state_dict()) == {"weight", "bias"}
        with torch.no_grad():
            torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
    fast(x).sum().backward()  # with gradients it is nn.Linear
    assert linear.weight.grad is not None and linear.weight.grad.shape == (24, 16)


def test_drafts_run_on_the_engine_and_stay_exact():
    model = tiny_target("qwen3")
    draft = tiny_draft(model, block_size=4)
    prompt = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(7))
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 7:].tolist()
    result = generate(model, draft, prompt, max_new_tokens=30, block_size=4)
    assert result.tokens == expected
    assert isinstance(DFlashProposer(draft, TargetModel(model)).forward, DraftEngine)


def shaken_draft(model, **kwargs):
    """A tiny draft whose norms are not all ones, so that a norm applied to the wrong tensor shows."""
    draft = tiny_draft(model, **kwargs)
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return draft


def draft_inputs(draft, width: int, block: int, start: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    d = draft.config.hidden_size
    noise = torch.randn(1, block, d, generator=generator)
    features = torch.randn(1, width, len(draft.target_layer_ids) * d, generator=generator)
    return noise, features, torch.arange(start - width, start + block)[None]


def rounds_match_the_module(draft, fast, block: int, widths: tuple[int, ...]):
    """Passes of `fast` and of the draft module over a prompt's context, then rounds of `widths[1:]` accepted
    positions, each in its own cache: the block's hidden states equal. Returns both caches and the context length."""
    ours, theirs = DraftCache(draft.config, 64), DraftCache(draft.config, 64)
    start = 0
    for seed, width in enumerate(widths, start=1):
        noise, features, positions = draft_inputs(draft, width, block, start + width, seed)
        with torch.no_grad():
            expected = draft(noise, features, positions, theirs)
        torch.testing.assert_close(fast(noise, features, positions, ours), expected, rtol=1e-5, atol=1e-5)
        ours.crop(-block)
        theirs.crop(-block)
        start += width
    return ours, theirs, start


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kernel", list(available_products()))
def test_the_draft_pass_on_the_engine_equals_the_modules(arch, kernel):
    model = tiny_target(arch)
    target = TargetModel(model, engine="flashdraft")
    target.engine.kernels = uniform(kernel)
    draft = shaken_draft(model, block_size=4)
    fast = DraftEngine.for_draft(draft, target.engine)
    ours, theirs, start = rounds_match_the_module(draft, fast, block=4, widths=(9, 1, 3))
    torch.testing.assert_close(ours.keys[1][:, :, :start], theirs.keys[1][:, :, :start], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", ["default", "off"])
def test_the_draft_pass_with_native_attention_equals_the_modules(monkeypatch, setting):
    if setting == "off":
        monkeypatch.setenv("FLASHDRAFT_NATIVE_ATTENTION", "0")
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)  # head_dim 64: the native kernel's shape
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=8)
    fast = DraftEngine.for_draft(draft, target.engine)
    assert fast.native_attention == (native.available() and setting == "default")
    rounds_match_the_module(draft, fast, block=8, widths=(20, 1, 5))


def test_the_draft_pass_on_the_engine_drafts_rows_of_different_lengths():
    model = tiny_target("qwen3")
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4)
    fast = DraftEngine.for_draft(draft, target.engine)
    caches = {"engine": RowDraftCache(draft.config), "module": RowDraftCache(draft.config)}
    outputs = {}
    for name, forward in (("engine", fast), ("module", draft)):
        cache = caches[name]
        cache.add_row(), cache.add_row()
        for widths, seed in (([6, 2], 1), ([1, 3], 2)):
            generator = torch.Generator().manual_seed(seed)
            d, width = draft.config.hidden_size, max(widths)
            noise = torch.randn(2, 4, d, generator=generator)
            features = torch.randn(2, width, len(draft.target_layer_ids) * d, generator=generator)
            starts = [cache.lengths[r] + widths[r] for r in range(2)]
            # as DFlashProposer.logits_rows places them: the padding's positions run on past the row's context
            positions = torch.stack([torch.cat([torch.arange(s - w, s - w + width), torch.arange(s, s + 4)])
                                     for s, w in zip(starts, widths)])
            mask = cache.begin_pass([0, 1], widths, 4)
            with torch.no_grad():
                outputs.setdefault(name, []).append(forward(noise, features, positions, cache, attention_mask=mask))
            cache.end_pass([0, 1], widths)
    for ours, theirs in zip(outputs["engine"], outputs["module"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_draft_pass_on_the_engine_follows_training():
    model = tiny_target("qwen3")
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4)
    parameters = list(draft.parameters())
    fast = DraftEngine.for_draft(draft, target.engine)
    noise, features, positions = draft_inputs(draft, 5, 4, 5, seed=1)
    fast(noise, features, positions)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=0.1)
    draft.train()
    draft(noise, features, positions).square().sum().backward()
    optimizer.step()  # in place, on the draft's own parameters: the engine's copies are stale now
    draft.eval()
    assert [p for p in draft.parameters()] == parameters  # the optimizer's parameters are still the draft's
    with torch.no_grad():
        torch.testing.assert_close(fast(noise, features, positions), draft(noise, features, positions),
                                   rtol=1e-5, atol=1e-5)
        draft.load_state_dict({name: value * 0.5 for name, value in draft.state_dict().items()})
        torch.testing.assert_close(fast(noise, features, positions), draft(noise, features, positions),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", ["default", "off"])
def test_a_bfloat16_draft_computes_in_bfloat16_where_the_cpu_can(monkeypatch, setting):
    monkeypatch.setenv("FLASHDRAFT_DRAFT_INT8", "0")  # bfloat16 arithmetic, not 8-bit (the test below)
    if setting == "off":
        monkeypatch.setenv("FLASHDRAFT_DRAFT_BF16", "0")
    model = tiny_target("qwen3")  # hidden 32, intermediate 64: every K a multiple of 32
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()  # as a shipped draft loads
    fast = DraftEngine.for_draft(draft, target.engine)
    assert fast.bf16_dot == (native.bf16_dot_available() and setting == "default")
    head = target.head_rows(torch.arange(0, 96, 2))
    noise, features, positions = draft_inputs(draft, 6, 4, 6, seed=3)
    with torch.no_grad():
        expected = draft(noise, features, positions)
        expected_logits = head(expected[0])
    ours = fast(noise, features, positions)
    logits = fast.logits(ours[0], head)
    if fast.bf16_dot:  # inputs rounded to bfloat16: close, not equal
        assert 0 < (ours - expected).abs().max() <= 2e-2 * expected.abs().max()
        assert 0 < (logits - expected_logits).abs().max() <= 2e-2 * expected_logits.abs().max()
    else:
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", ["default", "off"])
def test_a_bfloat16_draft_computes_in_8_bit_integers_where_the_cpu_can(monkeypatch, setting):
    if setting == "off":
        monkeypatch.setenv("FLASHDRAFT_DRAFT_INT8", "0")
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)  # every K a multiple of 64
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()  # as a shipped draft loads
    fast = DraftEngine.for_draft(draft, target.engine)
    head = target.head_rows(torch.arange(0, 96, 2))
    noise, features, positions = draft_inputs(draft, 6, 4, 6, seed=3)
    with torch.no_grad():
        expected = draft(noise, features, positions)
        expected_logits = head(expected[0])
    ours = fast(noise, features, positions)
    logits = fast.logits(ours[0], head)
    int8 = native.available() and setting == "default"
    assert bool(fast.int8) == int8 and len(fast.int8) == (9 if int8 else 0)  # fc and 4 products in each layer
    error = (ours - expected).abs().max() / expected.abs().max()
    logits_error = (logits - expected_logits).abs().max() / expected_logits.abs().max()
    assert error <= (0.05 if int8 else 2e-2) and logits_error <= (0.05 if int8 else 2e-2)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(11))
    reference = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 9:].tolist()
    assert generate(target, draft, prompt, max_new_tokens=30, block_size=4, proposals="dflash").tokens == reference
    training = DraftEngine.for_draft(shaken_draft(model, block_size=4), target.engine)  # float32 weights
    training(noise, features, positions)
    assert training.int8 == {}  # a draft in training keeps its own arithmetic


@pytest.mark.skipif(not native.available(), reason="needs the native kernels (the test above covers their absence)")
def test_an_8_bit_draft_runs_each_layer_in_one_native_call_with_the_same_result():
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)  # head_dim 64, every K a multiple of 64
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()  # as a shipped draft loads
    fast = DraftEngine.for_draft(draft, target.engine)
    caches = {True: DraftCache(draft.config, 64), False: DraftCache(draft.config, 64)}
    start = 0
    for seed, width in enumerate((9, 1, 3), start=1):  # a prompt's context, then rounds of accepted positions
        noise, features, positions = draft_inputs(draft, width, 4, start + width, seed)
        outputs = {}
        for native_layers, cache in caches.items():
            fast.use_native_layers = native_layers
            outputs[native_layers] = fast(noise, features, positions, cache)
            assert cache.length == start + width + 4  # the window's keys and values appended
            cache.crop(-4)
        assert torch.equal(outputs[True], outputs[False])  # the same kernels in the same order
        start += width
    assert len(fast.native_layers) == 2
    for layer in range(2):  # the context's keys and values are the step-by-step pass's, bit for bit
        assert torch.equal(caches[True].keys[layer][:, :, :start], caches[False].keys[layer][:, :, :start])
        assert torch.equal(caches[True].values[layer][:, :, :start], caches[False].values[layer][:, :, :start])
    full = DraftCache(draft.config, 64)
    full.claim(62)  # no room for the last round's 3 + 4 positions: refused before anything is written
    with pytest.raises(ValueError, match="draft cache holds 64 positions, 69 were asked for"):
        fast(noise, features, positions, full)
    assert full.length == 62


@pytest.mark.skipif(not native.available(), reason="needs the native kernels (the test above covers their absence)")
@pytest.mark.parametrize("drafting_vocabulary", [False, True])
def test_an_8_bit_drafts_whole_pass_is_one_native_call_with_the_same_proposals(monkeypatch, drafting_vocabulary):
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()
    if drafting_vocabulary:
        draft.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(2))[:64])
    calls = []
    whole = native.unchecked_draft_block
    monkeypatch.setattr(native, "unchecked_draft_block",
                        lambda *args, **kwargs: calls.append(1) or whole(*args, **kwargs))
    proposers = {name: DFlashProposer(draft, target) for name in ("whole", "layers")}
    proposers["layers"].forward.use_whole_pass = False  # the layers one call each, the rest in torch
    features = torch.randn(1, 12, len(draft.target_layer_ids) * 128, generator=torch.Generator().manual_seed(3))
    for proposer in proposers.values():
        proposer.begin(32)
    start = 0
    for round_, width in enumerate((9, 1, 2)):  # a prompt's context, then rounds of accepted positions
        anchor, size = torch.tensor([11 + round_]), (4, 3, 2)[round_]
        outputs = {name: (proposer.logits(anchor, features[:, start : start + width], start + width, 4, size),
                          proposer.propose(anchor, features[:, start : start + width], start + width, 4, size))
                   for name, proposer in proposers.items()}
        for proposer in proposers.values():
            assert proposer.cache.length == start + 2 * width  # each call kept its context: the second repeats it
            proposer.cache.crop(-width)
        (logits, (tokens, q)), (expected_logits, (expected_tokens, _)) = outputs["whole"], outputs["layers"]
        assert torch.equal(logits, expected_logits) and logits.shape == (size - 1, 64 if drafting_vocabulary else 96)
        assert torch.equal(tokens, expected_tokens) and q is None
        if drafting_vocabulary:
            assert set(tokens.tolist()) <= set(draft.draft_vocab_ids.tolist())
        start += width
    assert len(calls) == 6  # every pass of the first proposer, none of the second's
    for layer in range(2):
        assert torch.equal(proposers["whole"].cache.keys[layer][..., :start, :],
                           proposers["layers"].cache.keys[layer][..., :start, :])


@pytest.mark.skipif(not native.available(), reason="needs the native kernels (the test above covers their absence)")
@pytest.mark.parametrize("proposals", ["dflash", "hybrid"])
def test_decoding_on_an_8_bit_drafts_whole_pass_stays_exact(monkeypatch, proposals):
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()
    calls = []
    whole = native.unchecked_draft_block
    monkeypatch.setattr(native, "unchecked_draft_block",
                        lambda *args, **kwargs: calls.append(1) or whole(*args, **kwargs))
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(12))
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 9:].tolist()
    result = generate(model, draft, prompt, max_new_tokens=40, block_size=4, proposals=proposals)
    assert result.tokens == expected and len(calls) >= 3  # the rounds' passes: one native call each


def test_speculative_decoding_with_a_bfloat16_draft_pass_stays_exact():
    model = tiny_target("qwen3")
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(11))
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 9:].tolist()
    assert generate(model, draft, prompt, max_new_tokens=40, block_size=4, proposals="dflash").tokens == expected


def test_drafts_the_engine_cannot_run_keep_the_module_on_the_engines_kernels():
    model = tiny_target("qwen3")
    target = TargetModel(model, engine="flashdraft")
    sliding = tiny_draft(model)
    sliding.config.sliding_window = 6
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    biased = tiny_draft(model)
    biased.config.attention_bias = True
    for draft in (sliding, biased, tiny_draft(model).to(torch.bfloat16)):
        assert DraftEngine.for_draft(draft, target.engine) is None
    assert DraftEngine.for_draft(tiny_draft(model), None) is None
    forward = target.draft_forward(sliding)
    assert forward is sliding and isinstance(sliding.fc, KernelLinear)


def test_kernels_are_measured_once_and_cover_every_shape(monkeypatch):
    model = tiny_target(hidden_size=48)
    engine = Engine(model)
    choice = cached_kernels(engine)
    assert set(choice.table) == set(KINDS)
    for kind in KINDS:
        assert sorted(choice.table[kind]) == list(KERNEL_ROWS)
        assert set(choice.table[kind].values()) <= set(PRODUCTS)

    def fail(*args, **kwargs):
        raise AssertionError("measured twice")

    monkeypatch.setattr("flashdraft.engine.kernels.measure_kernels", fail)
    assert cached_kernels(Engine(model)).table == json.loads(json.dumps(choice.table), object_hook=lambda d: {
        (int(k) if k.isdigit() else k): v for k, v in d.items()})


def test_measurement_leaves_the_engine_exact():
    engine_target, reference = both()
    measure_kernels(engine_target.engine, repeats=1)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(8))
    logits, _ = engine_target.forward(ids, torch.arange(8)[None], engine_target.new_cache(), None)
    expected, _ = reference.forward(ids, torch.arange(8)[None], reference.new_cache(), None)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_numpy_blas_threads_are_restored_after_a_forward():
    engine_target, _ = both()
    engine_target.engine.kernels = uniform("numpy")
    before = [pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"]
    engine_target.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], engine_target.new_cache(), None)
    assert [pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"] == before


def test_a_damaged_kernel_file_is_measured_again():
    engine = Engine(tiny_target(hidden_size=40))
    cached_kernels(engine, progress=False)
    for path in (cache_home() / "kernels").glob("*.json"):
        path.write_text("{not json")
    choice = cached_kernels(engine, progress=False)
    assert set(choice.table) == set(KINDS)


def test_load_target_records_the_engine_for_every_wrapper(tmp_path):
    tiny_target().save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    model, _ = load_target(str(tmp_path / "t"), engine="transformers")
    assert TargetModel(model).engine is None
    model, _ = load_target(str(tmp_path / "t"))
    assert TargetModel(model).engine_name == "flashdraft"
    assert TargetModel(model, engine="transformers").engine is None  # an explicit choice wins
    with pytest.raises(ValueError, match="bfloat16"):
        load_target(str(tmp_path / "t"), dtype=torch.bfloat16, engine="flashdraft")


def test_a_target_from_a_gguf_checkpoint_runs_on_packed_weights_with_the_same_results():
    from test_native import as_gguf_q4_1, as_gguf_q8_0

    from flashdraft import native
    from flashdraft.engine import WeightForms

    if not native.available():
        pytest.skip(f"native kernel: {native.unavailable_reason()}")
    model = tiny_target("llama", hidden_size=64)
    with torch.no_grad():  # the weights as a Q4_1 checkpoint with a Q8_0 embedding would load them
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.copy_((as_gguf_q8_0 if "embed" in name or "lm_head" in name else as_gguf_q4_1)(parameter))
    packed_target, reference = both_of(model)
    engine = packed_target.engine
    assert engine.packed_formats() == {"head": ["q8_0"], "qkv": ["q4_1"], "o": ["q4_1"], "gate_up": ["q4_1"],
                                       "down": ["q4_1"]}
    unpacked = Engine(model)
    unpacked.forms = {key: WeightForms(forms.array, None) for key, forms in unpacked.forms.items()}
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    for kernel in ("native", "native-parallel"):
        engine.kernels = unpacked.kernels = uniform(kernel)
        got, _ = engine.forward(ids, torch.arange(12)[None], engine.new_cache())
        same, _ = unpacked.forward(ids, torch.arange(12)[None], unpacked.new_cache())
        assert torch.equal(got, same)
    expected, _ = reference.forward(ids, torch.arange(12)[None], reference.new_cache(), None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    prompt = ids[:, :5]
    assert generate(model, None, prompt, max_new_tokens=20, block_size=1).tokens == model.generate(
        prompt, max_new_tokens=20, do_sample=False)[0, 5:].tolist()


def both_of(model) -> tuple[TargetModel, TargetModel]:
    return TargetModel(model, engine="flashdraft"), TargetModel(model, engine="transformers")


def test_a_drafts_head_rows_and_their_packed_form_are_kept_for_the_next_generate():
    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)
    target = TargetModel(model, engine="flashdraft")
    ids = torch.arange(0, 96, 2)
    head = target.head_rows(ids)
    assert TargetModel(model, engine="flashdraft").head_rows(ids) is head  # another wrapper of the same model
    torch.testing.assert_close(head.weight, model.get_output_embeddings().weight[ids])
    assert target.head_rows(torch.arange(0, 96, 3)).weight.shape[0] == 32  # another vocabulary: its own rows
    head = target.head_rows(ids)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2)  # changed in place: made again from the new weights
    doubled = target.head_rows(ids)
    assert doubled is not head
    torch.testing.assert_close(doubled.weight, model.get_output_embeddings().weight[ids])
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()
    first, second = (DraftEngine.for_draft(draft, target.engine) for _ in range(2))
    noise, features, positions = draft_inputs(draft, 6, 4, 6, seed=3)
    first.logits(first(noise, features, positions)[0], doubled)
    packed = first._packed_head(doubled)
    assert (packed is not None) == native.available()
    second(noise, features, positions)
    assert second._packed_head(doubled) is packed  # a new pass of the same draft reuses the head's packed form


def test_the_head_rows_are_kept_when_building_the_engine_moves_the_heads_weight():
    model = tiny_target("llama", hidden_size=64)
    head = model.get_output_embeddings()
    with torch.no_grad():  # off a cache line, as a checkpoint may load it: the engine moves it (`_aligned`)
        head.weight.data = torch.empty(head.weight.numel() + 1)[1:].view_as(head.weight).copy_(head.weight)
    before = head.weight.data_ptr()
    target = TargetModel(model, engine="flashdraft")  # its engine is built on first use, inside `head_rows`
    ids = torch.arange(0, 96, 2)
    rows = target.head_rows(ids)
    assert head.weight.data_ptr() != before
    assert target.head_rows(ids) is rows


def test_a_proposer_makes_its_drafts_weights_before_the_first_round(monkeypatch):
    if not native.available():
        pytest.skip(f"native kernel: {native.unavailable_reason()}")
    from flashdraft import quantized
    from flashdraft.proposals import DFlashProposer

    model = tiny_target("qwen3", hidden_size=128, heads=2, kv_heads=1)
    target = TargetModel(model, engine="flashdraft")
    draft = shaken_draft(model, block_size=4).to(torch.bfloat16).float()
    proposer = DFlashProposer(draft, target)
    proposer.begin(64)
    assert isinstance(proposer.forward, DraftEngine) and proposer.forward._whole is not None

    def packing(*args, **kwargs):
        raise AssertionError("packed inside a round")

    for module, name in ((quantized, "q8_blocks"), (native, "pack_draft"), (native, "pack_layer"),
                         (native, "pack_bfloat16")):
        monkeypatch.setattr(module, name, packing)
    context = torch.randn(1, 6, len(draft.target_layer_ids) * 128, generator=torch.Generator().manual_seed(4))
    tokens, q = proposer.propose(torch.tensor([3]), context, 6, 4)
    assert q is None and tokens.shape == (3,)


def test_interleaved_seconds_runs_every_work_in_changing_company():
    """Each work runs once a turn plus a warm-up turn, and not always after the same work: a rotation would keep
    each predecessor, and a work that always follows one that evicts its data would always be timed cold."""
    from flashdraft.engine.kernels import interleaved_seconds

    ran = []
    works = {name: (lambda name=name: ran.append(name)) for name in "abcde"}
    seconds = interleaved_seconds(works, repeats=12)
    assert set(seconds) == set(works) and all(value >= 0 for value in seconds.values())
    assert sorted(ran) == sorted(list("abcde") * 13)
    predecessors = {name: {ran[i - 1] for i in range(1, len(ran)) if ran[i] == name} for name in works}
    assert all(len(before) >= 2 for before in predecessors.values())


def test_every_engine_variable_is_documented_and_amx_is_a_setting_of_the_cost_keys(monkeypatch):
    from flashdraft.engine.settings import VARIABLES, EngineSettings

    guide = (Path(__file__).parents[1] / "docs" / "cpu-engine.md").read_text()
    assert [name for name in VARIABLES if f"`{name}`" not in guide] == []
    monkeypatch.setenv("FLASHDRAFT_AMX", "0")
    off = EngineSettings.from_environment()
    monkeypatch.setenv("FLASHDRAFT_AMX", "1")
    on = EngineSettings.from_environment()
    assert (off.tiles, on.tiles) == (False, True) and off.key() != on.key()
