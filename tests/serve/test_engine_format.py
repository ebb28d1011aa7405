"""A draft saved by `DFlashDraftModel.save_pretrained` carries exactly what vLLM and SGLang read to serve it.

The lists below are what those engines' DFlash loaders read, taken from their sources:
- vLLM: `vllm/model_executor/models/registry.py` maps architecture "DFlashDraftModel" to
  `qwen3_dflash.DFlashQwen3ForCausalLM`; `vllm/model_executor/models/qwen3_dflash.py` reads the Qwen3 fields,
  `dflash_config.mask_token_id`, `layer_types`/`sliding_window`, and loads the weights by the names below
  (stacking q/k/v into qkv_proj and gate/up into gate_up_proj; `AutoWeightsLoader` fails on any name it has no
  parameter for); `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config`
  takes the target layers from `dflash_config.target_layer_ids` (+1: hidden-state index) unless
  `eagle_aux_hidden_state_layer_ids` is set.
- SGLang: `python/sglang/srt/speculative/dflash_utils.py::parse_dflash_draft_config` reads `num_hidden_layers`,
  `num_target_layers`, `block_size` (top level or in dflash_config), `dflash_config.target_layer_ids` and
  `dflash_config.mask_token_id`; `python/sglang/srt/models/dflash.py` (`DFlashDraftModel`) reads the Qwen3
  fields, requires `hidden_act == "silu"`, checks `fc.weight` against len(target_layer_ids) * hidden_size and
  loads the same weight names (no embedding, no lm_head: the target's are used).
"""

import json

import pytest
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft import DFlashDraftModel

from tiny import tiny_target

# Config fields both engines read from the top level of config.json.
QWEN3_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "attention_bias",
    "layer_types",
)
ROPE_FIELDS = ("rope_parameters", "rope_theta")  # vLLM reads rope_parameters, SGLang's get_rope_config rope_theta
DFLASH_TOP_LEVEL = ("block_size", "num_target_layers")  # SGLang
DFLASH_CONFIG = ("mask_token_id", "target_layer_ids")  # both, inside dflash_config
# Fields that would change how vLLM reads the draft: other layer-id semantics, causal attention, or a reduced
# drafting vocabulary (vLLM then expects its own lm_head and a d2t map).
MUST_BE_ABSENT = ("eagle_aux_hidden_state_layer_ids", "is_causal", "target_hidden_size", "draft_vocab_size")
DFLASH_CONFIG_ABSENT = ("causal", "use_swa")

LAYER_WEIGHTS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
MODEL_WEIGHTS = ("norm.weight", "fc.weight", "hidden_norm.weight")


def qwen3_target_with_wide_heads():
    """head_dim (16) differs from hidden_size / heads (8), as in Qwen3: catches a draft that derives it."""
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1_000_000.0,
    )
    return Qwen3ForCausalLM(config)


TARGETS = {
    "llama": lambda: tiny_target("llama", num_layers=6),
    "qwen3-wide-heads": qwen3_target_with_wide_heads,
    "llama-reduced-vocab": lambda: tiny_target("llama", num_layers=6),  # a drafting vocabulary must add no weight
}


@pytest.fixture(params=list(TARGETS), scope="module")
def saved(request, tmp_path_factory):
    target = TARGETS[request.param]()
    draft = DFlashDraftModel.for_target(target.config, num_layers=3, block_size=16, mask_token_id=5)
    if request.param.endswith("reduced-vocab"):
        draft.set_draft_vocab(list(range(0, 96, 3)))
    folder = tmp_path_factory.mktemp(f"draft-{request.param}")
    draft.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    return target.config, config, shapes


def test_architecture_and_model_type(saved):
    _, config, _ = saved
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"


def test_fields_the_engines_read_are_present_with_the_right_values(saved):
    target_config, config, _ = saved
    missing = [f for f in QWEN3_FIELDS + ROPE_FIELDS + DFLASH_TOP_LEVEL if f not in config]
    missing += [f"dflash_config.{f}" for f in DFLASH_CONFIG if f not in config["dflash_config"]]
    assert missing == []
    heads = target_config.num_attention_heads
    assert config["hidden_size"] == target_config.hidden_size
    assert config["vocab_size"] == target_config.vocab_size  # vLLM: equal vocabularies need no d2t map
    assert config["head_dim"] == (getattr(target_config, "head_dim", None) or target_config.hidden_size // heads)
    assert config["hidden_act"] == "silu"  # SGLang supports nothing else
    assert config["num_hidden_layers"] == 3
    assert config["layer_types"] == ["full_attention"] * 3  # full: vLLM and SGLang make it non-causal
    theta = target_config.rope_parameters["rope_theta"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == theta
    assert config["block_size"] == 16
    assert config["num_target_layers"] == target_config.num_hidden_layers
    assert config["dflash_config"]["mask_token_id"] == 5
    ids = config["dflash_config"]["target_layer_ids"]
    assert len(ids) == 3 and all(0 <= i < target_config.num_hidden_layers for i in ids)


def test_fields_that_would_change_the_engines_reading_are_absent(saved):
    _, config, _ = saved
    assert [f for f in MUST_BE_ABSENT if f in config] == []
    assert [f for f in DFLASH_CONFIG_ABSENT if f in config["dflash_config"]] == []


def test_weight_names_are_exactly_the_engines(saved):
    _, config, shapes = saved
    expected = set(MODEL_WEIGHTS) | {f"layers.{i}.{name}" for i in range(3) for name in LAYER_WEIGHTS}
    assert set(shapes) == expected  # in particular no embed_tokens and no lm_head


def test_weight_shapes_fit_the_engines_fused_layers(saved):
    _, config, shapes = saved
    d, dh = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * dh, config["num_key_value_heads"] * dh
    # Both engines check fc against len(target_layer_ids) * hidden_size and slice qkv_proj as [q | k | v].
    assert shapes["fc.weight"] == (d, len(config["dflash_config"]["target_layer_ids"]) * d)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (q, d)
    assert shapes["layers.0.self_attn.k_proj.weight"] == shapes["layers.0.self_attn.v_proj.weight"] == (kv, d)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (d, q)
    assert shapes["layers.0.self_attn.q_norm.weight"] == shapes["layers.0.self_attn.k_norm.weight"] == (dh,)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (config["intermediate_size"], d)
