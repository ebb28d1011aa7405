"""The draft network against an independent, written-out version of SPEC section 1, and its checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from flashdraft import DFlashDraftModel, default_target_layer_ids
from flashdraft.draft import DraftCache

from tiny import tiny_draft, tiny_target


def test_default_target_layer_ids_follow_the_spec():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, from the SPEC
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(12, 3) == [1, 5, 9]


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, positions, theta):
    """RoPE of x [h, n, dh] at the given absolute positions, rotate-half convention."""
    dh = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dh, 2).float() / dh)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    halves = torch.cat([-x[..., dh // 2 :], x[..., : dh // 2]], -1)
    return x * cos + halves * sin


def reference_forward(draft, noise, features, context_positions, block_positions, window=None):
    """SPEC section 1 written out for batch 1: C = RMSNorm(fc(features)); per layer Q from the block only,
    K/V = the same projections over [C ; H], QK-norm, RoPE at true positions, non-causal softmax."""
    cfg = draft.config
    eps, dh, theta = cfg.rms_norm_eps, cfg.head_dim, cfg.rope_parameters["rope_theta"]
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    context = rms(features[0] @ draft.fc.weight.T, draft.hidden_norm.weight, eps)  # [c, d]
    h = noise[0]
    key_positions = torch.cat([context_positions, block_positions])
    for layer in draft.layers:
        a = layer.self_attn
        x = rms(h, layer.input_layernorm.weight, eps)
        both = torch.cat([context, x])
        q = (x @ a.q_proj.weight.T).view(len(x), -1, dh).transpose(0, 1)
        k = (both @ a.k_proj.weight.T).view(len(both), -1, dh).transpose(0, 1)
        v = (both @ a.v_proj.weight.T).view(len(both), -1, dh).transpose(0, 1)
        q, k = rms(q, a.q_norm.weight, eps), rms(k, a.k_norm.weight, eps)
        q, k = rotate(q, block_positions, theta), rotate(k, key_positions, theta)
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = q @ k.transpose(1, 2) / dh**0.5
        if window is not None and a.sliding_window is not None:
            too_far = block_positions[:, None] - key_positions[None, :] >= window
            too_far[:, len(context_positions) :] = False
            scores = scores.masked_fill(too_far, float("-inf"))
        attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(x), -1)
        h = h + attended @ a.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        h = h + (torch.nn.functional.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(h, draft.norm.weight, eps)[None]


def random_inputs(draft, context_length=7, block=5, start=None, seed=0):
    torch.manual_seed(seed)
    d = draft.config.hidden_size
    k = len(draft.target_layer_ids)
    noise = torch.randn(1, block, d)
    features = torch.randn(1, context_length, k * d)
    start = context_length if start is None else start
    positions = torch.arange(start - context_length, start + block)
    return noise, features, positions


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forward_matches_the_written_out_method(arch, attn):
    draft = tiny_draft(tiny_target(arch), num_layers=2, attn_implementation=attn)
    for layer in draft.layers:  # non-trivial norms so a missing or misplaced norm shows
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.input_layernorm):
            norm.weight.data.uniform_(0.5, 1.5)
    noise, features, positions = random_inputs(draft, start=40)
    out = draft(noise, features, positions[None])
    expected = reference_forward(draft, noise, features, positions[:7], positions[7:])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_eager_and_sdpa_agree():
    target = tiny_target("qwen3")
    eager = tiny_draft(target, attn_implementation="eager")
    sdpa = tiny_draft(target, attn_implementation="sdpa")
    noise, features, positions = random_inputs(eager, context_length=20, block=8)
    torch.testing.assert_close(eager(noise, features, positions[None]), sdpa(noise, features, positions[None]),
                               atol=1e-5, rtol=1e-5)


def test_queries_take_the_last_positions_of_the_window():
    """Shifting every position by the same offset changes nothing (RoPE is relative); giving the block the
    context's positions instead (the off-by-window bug) does."""
    draft = tiny_draft(tiny_target())
    noise, features, positions = random_inputs(draft)
    out = draft(noise, features, positions[None])
    torch.testing.assert_close(draft(noise, features, positions[None] + 13), out, atol=1e-5, rtol=1e-5)
    wrong = torch.cat([positions[:7], torch.arange(5)])
    assert (draft(noise, features, wrong[None]) - out).abs().max() > 1e-3


def test_attention_is_not_causal_within_the_block():
    draft = tiny_draft(tiny_target())
    noise, features, positions = random_inputs(draft)
    changed = noise.clone()
    changed[0, -1] += 1.0
    difference = draft(changed, features, positions[None])[0, 0] - draft(noise, features, positions[None])[0, 0]
    assert difference.abs().max() > 1e-4


def test_cached_context_gives_the_same_block_as_the_whole_context_at_once():
    """The decoding loop feeds the context in pieces through the cache and crops the block back out."""
    draft = tiny_draft(tiny_target())
    noise, features, positions = random_inputs(draft, context_length=12, block=6)
    whole = draft(noise, features, positions[None])
    cache = DynamicCache()
    first_noise = torch.randn(1, 6, noise.shape[-1])
    draft(first_noise, features[:, :5], torch.arange(0, 11)[None], cache)  # context 0..4, block at 5..10
    cache.crop(-6)
    assert cache.get_seq_length() == 5
    pieces = draft(noise, features[:, 5:], positions[None, 5:], cache)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


def test_preallocated_draft_cache_matches_transformers_dynamic_cache():
    draft = tiny_draft(tiny_target())
    noise, features, positions = random_inputs(draft, context_length=12, block=6)
    outputs = []
    for cache in (DynamicCache(), DraftCache(draft.config, 40)):
        draft(torch.randn(1, 6, noise.shape[-1]), features[:, :5], torch.arange(0, 11)[None], cache)
        cache.crop(-6)
        assert cache.get_seq_length() == 5
        outputs.append(draft(noise, features[:, 5:], positions[None, 5:], cache))
        cache.crop(-6)
        assert cache.get_seq_length() == 12
    torch.testing.assert_close(outputs[0], outputs[1])


def test_draft_cache_refuses_to_overflow():
    draft = tiny_draft(tiny_target())
    noise, features, positions = random_inputs(draft, context_length=12, block=6)
    with pytest.raises(ValueError, match="draft cache holds 10 positions, 18 were asked for"):
        draft(noise, features, positions[None], DraftCache(draft.config, 10))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_sliding_window_layers_ignore_context_beyond_the_window(attn):
    target = tiny_target("qwen3")
    draft = tiny_draft(target, num_layers=2, attn_implementation=attn)
    draft.config.sliding_window = 6
    draft.config.layer_types = ["sliding_attention", "full_attention"]
    draft.layers[0].self_attn.sliding_window = 6
    noise, features, positions = random_inputs(draft, context_length=12, block=4)
    out = draft(noise, features, positions[None])
    expected = reference_forward(draft, noise, features, positions[:12], positions[12:], window=6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out - reference_forward(draft, noise, features, positions[:12], positions[12:])).abs().max() > 1e-4


def test_draft_has_no_embedding_and_no_head():
    draft = tiny_draft(tiny_target())
    names = set(draft.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)


# ------------------------------------------------------------------ checkpoints (SPEC section 2)

SPEC_CONFIG_KEYS = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "layer_types", "sliding_window", "block_size", "num_target_layers", "dflash_config",
}


def layer_weight_names(i):
    attn = [f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
    norms = [f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"]
    mlp = [f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer_norms = [f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")]
    return attn + norms + mlp + layer_norms


def test_save_writes_the_spec_format_and_loads_back(tmp_path):
    draft = tiny_draft(tiny_target("llama"), num_layers=3, block_size=16, mask_token_id=7)
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert SPEC_CONFIG_KEYS <= set(config)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 16 and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": draft.target_layer_ids}
    weights = load_file(tmp_path / "model.safetensors")
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {n for i in range(3) for n in layer_weight_names(i)}
    assert set(weights) == expected
    loaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    noise, features, positions = random_inputs(draft)
    torch.testing.assert_close(loaded(noise, features, positions[None]), draft(noise, features, positions[None]))


def test_loads_a_published_style_config_with_flat_rope_theta(tmp_path):
    """Published drafts carry `rope_theta` (no `rope_parameters`); they load unchanged."""
    draft = tiny_draft(tiny_target("llama"))
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert DFlashDraftModel.from_pretrained(tmp_path).config.rope_parameters["rope_theta"] == theta


def test_draft_vocabulary_is_saved_and_restored(tmp_path):
    draft = tiny_draft(tiny_target())
    draft.set_draft_vocab([9, 3, 3, 40, 11])
    draft.save_pretrained(tmp_path)
    dflash = json.loads((tmp_path / "config.json").read_text())["dflash_config"]
    assert dflash["draft_vocab_size"] == 4 and dflash["draft_vocab_ids"] == [3, 9, 11, 40]
    assert "draft_vocab_ids" not in load_file(tmp_path / "model.safetensors")  # vLLM refuses unknown weights
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.draft_vocab_ids.tolist() == [3, 9, 11, 40]


@pytest.fixture
def saved_draft(tmp_path):
    tiny_draft(tiny_target()).save_pretrained(tmp_path)
    return tmp_path


def test_missing_weight_is_named(saved_draft):
    weights = load_file(saved_draft / "model.safetensors")
    del weights["layers.1.mlp.up_proj.weight"]
    save_file(weights, saved_draft / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights: layers\.1\.mlp\.up_proj\.weight"):
        DFlashDraftModel.from_pretrained(saved_draft)


def test_wrongly_shaped_weight_is_named(saved_draft):
    weights = load_file(saved_draft / "model.safetensors")
    weights["fc.weight"] = torch.zeros(32, 10)
    save_file(weights, saved_draft / "model.safetensors")
    with pytest.raises(ValueError, match=r"fc\.weight has shape \[32, 10\], the config implies \[32, 64\]"):
        DFlashDraftModel.from_pretrained(saved_draft)


def test_a_plain_model_folder_is_not_a_draft(tmp_path):
    tiny_target("qwen3").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is not a DFlash draft"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_config_without_dflash_fields_is_rejected(saved_draft):
    config = json.loads((saved_draft / "config.json").read_text())
    del config["dflash_config"]
    (saved_draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dflash_config"):
        DFlashDraftModel.from_pretrained(saved_draft)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DFlashDraftModel.from_pretrained(tmp_path)
