"""Benchmark methods on tiny random models: every method is lossless at temperature 0, honours stop tokens, and
the method list is built (or refused) as documented."""

import sys

import pytest
import torch

from flashdraft.bench import METHOD_NAMES
from flashdraft.bench import methods as methods_module
from flashdraft.bench.methods import BUILDERS, DecodeSettings, build_methods, reference_available
from flashdraft.text import stop_token_ids

from tiny import greedy_reference, tiny_draft, tiny_target, tiny_tokenizer

MASK = 1
ALL = ["ar", "flashdraft", "flashdraft-hybrid", "flashdraft-plain", "flashdraft-lookup", "prompt-lookup", "assisted",
       "reference", "transformers-dflash"]


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen2", forbid_token=MASK)
    draft = tiny_draft(target, block_size=4, mask_token_id=MASK)
    assistant = tiny_target("llama", num_layers=2, seed=5)
    return target, draft, assistant, tiny_tokenizer()


def all_methods(models, block_sizes=(2, 4)):
    target, draft, assistant, tokenizer = models
    return build_methods(ALL, target=target, tokenizer=tokenizer, draft=draft, block_sizes=list(block_sizes),
                         assistant=assistant, assistant_tokenizer=tokenizer)


def test_method_list_puts_ar_first_and_runs_flashdraft_per_block_size(models):
    names = [method.name for method in all_methods(models)]
    assert names == ["ar", "flashdraft-b2", "flashdraft-b4", "flashdraft-hybrid", "flashdraft-plain",
                     "flashdraft-lookup", "prompt-lookup", "assisted", "reference-b4", "transformers-dflash-b4"]
    target, draft, _, tokenizer = models
    default = build_methods(["flashdraft"], target=target, tokenizer=tokenizer, draft=draft)
    assert [method.name for method in default] == ["ar", "flashdraft-b4"]
    no_draft = build_methods(["flashdraft-plain", "flashdraft-lookup"], target=target, tokenizer=tokenizer)
    assert [method.name for method in no_draft] == ["ar", "flashdraft-plain", "flashdraft-lookup"]


@pytest.mark.parametrize("prompt", [[5, 9, 17, 33], list(range(10, 40))])
def test_every_method_is_the_targets_greedy_continuation(models, prompt):
    expected = greedy_reference(models[0], prompt, 24)
    settings = DecodeSettings(max_new_tokens=24, temperature=0.0, stop_token_ids=())
    for method in all_methods(models):
        assert method.generate(torch.tensor([prompt]), settings, seed=0) == expected, method.name


def test_every_method_stops_at_a_stop_token(models):
    prompt = [7, 8, 9, 10]
    continuation = greedy_reference(models[0], prompt, 24)
    index = next(i for i in range(3, 24) if continuation[i] not in continuation[:i])
    settings = DecodeSettings(max_new_tokens=24, temperature=0.0, stop_token_ids=(continuation[index],))
    for method in all_methods(models):
        assert method.generate(torch.tensor([prompt]), settings, seed=0) == continuation[: index + 1], method.name


def test_sampling_is_reproducible_per_seed(models):
    settings = DecodeSettings(max_new_tokens=12, temperature=1.0, stop_token_ids=())
    prompt = torch.tensor([[3, 4, 5, 6]])
    for method in all_methods(models, block_sizes=[4]):
        first = method.generate(prompt, settings, seed=11)
        assert len(first) == 12
        assert method.generate(prompt, settings, seed=11) == first, method.name


def test_unusable_method_requests_are_refused(models):
    target, draft, assistant, tokenizer = models
    with pytest.raises(ValueError, match="unknown method.*eagle"):
        build_methods(["ar", "eagle"], target=target, tokenizer=tokenizer, draft=draft)
    with pytest.raises(ValueError, match="flashdraft, reference need a draft: pass --draft"):
        build_methods(["reference", "flashdraft"], target=target, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="pass --assistant"):
        build_methods(["assisted"], target=target, tokenizer=tokenizer)
    other = tiny_tokenizer(vocab_size=64)
    with pytest.raises(ValueError, match="tokenizer differs"):
        build_methods(["assisted"], target=target, tokenizer=tokenizer, assistant=assistant, assistant_tokenizer=other)
    with pytest.raises(ValueError, match="block size must be an integer >= 2"):
        build_methods(["flashdraft"], target=target, tokenizer=tokenizer, draft=draft, block_sizes=[1])


def test_reference_missing_names_the_pip_command(models, monkeypatch):
    target, draft, _, tokenizer = models
    assert reference_available()
    monkeypatch.setitem(sys.modules, "dflash.model", None)  # makes `import dflash.model` fail
    assert not reference_available()
    with pytest.raises(ValueError, match=r"pip install --no-deps dflash==0\.1\.0"):
        build_methods(["reference"], target=target, tokenizer=tokenizer, draft=draft)


def test_stop_tokens_come_from_the_generation_config_and_the_tokenizer():
    target = tiny_target("llama", num_layers=1)
    tokenizer = tiny_tokenizer()  # its end-of-turn token <eot> is id 2
    assert stop_token_ids(target, tokenizer) == (2,)
    target.generation_config.eos_token_id = [7, 2]
    assert stop_token_ids(target, tokenizer) == (7, 2)
    target.generation_config.eos_token_id = 9
    assert stop_token_ids(target, tokenizer) == (9, 2)


def test_transformers_dflash_adapter_exposes_the_fields_transformers_reads(models):
    _, draft, _, _ = models
    assistant = methods_module.TransformersDFlashAssistant(draft)
    assert (assistant.config.target_layer_ids, assistant.config.block_size, assistant.config.mask_token_id) == (
        draft.target_layer_ids, 4, MASK)
    assert not hasattr(draft.config, "mask_token_id")  # the draft's own config is left as it was


def test_the_registry_builds_every_method_the_command_line_lists():
    """One row per method: the names the command line offers (listed without torch) are the registry's."""
    assert list(BUILDERS) == list(METHOD_NAMES)
