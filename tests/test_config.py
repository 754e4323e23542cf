"""MLAConfig: presets against SPEC section 1, from_hf on real config.json contents, validation."""

import copy
import math

import pytest

from mla_jax.config import MLAConfig

# SPEC section 1: hidden, N, Lq, L, P, R, V, yarn factor, indexer (heads, dim, topk).
SPEC_TABLE = {
    "DeepSeek-V2-Lite": (2048, 16, None, 512, 128, 64, 128, 40.0, None),
    "DeepSeek-V2": (5120, 128, 1536, 512, 128, 64, 128, 40.0, None),
    "DeepSeek-V3": (7168, 128, 1536, 512, 128, 64, 128, 40.0, None),
    "DeepSeek-R1": (7168, 128, 1536, 512, 128, 64, 128, 40.0, None),
    "DeepSeek-V3.2": (7168, 128, 1536, 512, 128, 64, 128, 40.0, (64, 128, 2048)),
}

# deepseek-ai/DeepSeek-V2-Lite config.json
V2_LITE_JSON = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

# deepseek-ai/DeepSeek-V3 config.json
V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# deepseek-ai/DeepSeek-V3.2-Exp config.json: V3's layout plus the indexer keys.
V32_EXP_JSON = {
    **{k: v for k, v in V3_JSON.items() if k not in ("auto_map", "aux_loss_alpha", "pretraining_tp",
                                                     "seq_aux")},
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "transformers_version": "4.44.2",
}


def _v5_style(hf):
  """transformers v5 layout: `rope_parameters` carries rope_type and rope_theta, no rope_scaling."""
  out = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta")}
  rope = {k: v for k, v in hf["rope_scaling"].items() if k != "type"}
  out["rope_parameters"] = {**rope, "rope_type": "yarn", "rope_theta": 10000.0}
  return out


@pytest.mark.parametrize("name", sorted(SPEC_TABLE))
def test_preset_matches_spec_table(name):
  hidden, n, lq, l, p, r, v, factor, indexer = SPEC_TABLE[name]
  c = MLAConfig.preset(name)
  assert (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
          c.qk_rope_head_dim, c.v_head_dim) == (hidden, n, lq, l, p, r, v)
  assert c.rope_scaling is not None and c.rope_scaling.factor == factor
  assert c.rope_scaling.original_max_position_embeddings == 4096
  assert (c.rope_scaling.beta_fast, c.rope_scaling.beta_slow) == (32, 1)
  assert c.rope_theta == 10000
  assert c.qk_head_dim == 192 and c.latent_dim == 576
  if indexer is None:
    assert not c.has_indexer
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (None, None, None)
  else:
    assert c.has_indexer
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == indexer


@pytest.mark.parametrize("hf, name", [
    (V2_LITE_JSON, "DeepSeek-V2-Lite"),
    (V3_JSON, "DeepSeek-V3"),
    (V32_EXP_JSON, "DeepSeek-V3.2"),
    (_v5_style(V2_LITE_JSON), "DeepSeek-V2-Lite"),
    (_v5_style(V3_JSON), "DeepSeek-V3"),
    (_v5_style(V32_EXP_JSON), "DeepSeek-V3.2"),
], ids=["v2lite", "v3", "v32exp", "v2lite-v5", "v3-v5", "v32exp-v5"])
def test_from_hf_equals_preset(hf, name):
  snapshot = copy.deepcopy(hf)
  c = MLAConfig.from_hf(hf)
  assert c == MLAConfig.preset(name)
  assert hf == snapshot  # reading must not mutate the caller's dict


def test_v2_lite_mscale_values():
  s = MLAConfig.from_hf(V2_LITE_JSON).rope_scaling
  assert (s.mscale, s.mscale_all_dim) == (0.707, 0.707)


def test_v3_softmax_scale():
  expected = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2
  assert MLAConfig.from_hf(V3_JSON).softmax_scale == pytest.approx(expected, rel=1e-12)
  # V2-Lite: mscale_all_dim 0.707 enters the scale, squared
  expected = 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2
  assert MLAConfig.from_hf(V2_LITE_JSON).softmax_scale == pytest.approx(expected, rel=1e-12)


def test_softmax_scale_without_yarn():
  hf = {k: v for k, v in V3_JSON.items() if k != "rope_scaling"}
  c = MLAConfig.from_hf(hf)
  assert c.rope_scaling is None
  assert c.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-12)


def test_from_hf_reads_llama_4_scaling():
  c = MLAConfig.from_hf({**V3_JSON, "llama_4_scaling": {"beta": 0.1,
                                                         "original_max_position_embeddings": 8192}})
  assert (c.llama_4_scaling.beta, c.llama_4_scaling.original_max_position_embeddings) == (0.1, 8192)


SMALL = dict(hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32)


@pytest.mark.parametrize("changes", [
    dict(hidden_size=0), dict(num_heads=-1), dict(kv_lora_rank=0), dict(qk_nope_head_dim=0),
    dict(qk_rope_head_dim=0), dict(v_head_dim=-8), dict(max_position_embeddings=0),
    dict(q_lora_rank=0), dict(q_lora_rank=-5), dict(hidden_size=64.0),
    dict(qk_rope_head_dim=15),  # odd rope dim
    dict(index_n_heads=4),  # partial indexer fields
    dict(index_n_heads=4, index_head_dim=32),
    dict(index_n_heads=4, index_head_dim=32, index_topk=0),
    dict(q_lora_rank=None, index_n_heads=4, index_head_dim=32, index_topk=8),  # indexer without Lq
    dict(index_n_heads=4, index_head_dim=16, index_topk=8),  # indexer head not wider than rope
    dict(rms_norm_eps=0.0),
], ids=str)
def test_bad_fields_raise(changes):
  MLAConfig(**SMALL)  # the base is valid: only `changes` can make it fail
  with pytest.raises(ValueError):
    MLAConfig(**{**SMALL, **changes})


@pytest.mark.parametrize("rope, match", [
    ({"type": "linear", "factor": 2.0}, "rope type"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type"),
    ({"type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}, "factor"),
    ({"type": "yarn", "factor": 40, "beta_fast": 1, "beta_slow": 32}, "beta"),
    ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 0}, "original_max"),
], ids=["linear", "dynamic", "factor<1", "betas", "orig0"])
def test_bad_rope_raises(rope, match):
  with pytest.raises(ValueError, match=match):
    MLAConfig.from_hf({**V3_JSON, "rope_scaling": rope})


def test_yarn_without_factor_raises_value_error():
  rope = {k: v for k, v in V3_JSON["rope_scaling"].items() if k != "factor"}
  with pytest.raises(ValueError, match="factor"):
    MLAConfig.from_hf({**V3_JSON, "rope_scaling": rope})


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "kv_lora_rank",
                                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"])
def test_missing_key_raises(key):
  hf = {k: v for k, v in V3_JSON.items() if k != key}
  with pytest.raises(ValueError, match=key):
    MLAConfig.from_hf(hf)


def test_partial_indexer_in_hf_raises():
  hf = {k: v for k, v in V32_EXP_JSON.items() if k != "index_topk"}
  with pytest.raises(ValueError):
    MLAConfig.from_hf(hf)


@pytest.mark.parametrize("tp, local", [(1, 128), (2, 64), (4, 32), (8, 16)])
def test_num_local_heads(tp, local):
  assert MLAConfig.preset("DeepSeek-V3").num_local_heads(tp) == local
  assert MLAConfig.preset("DeepSeek-V2-Lite").num_local_heads(tp) == 16 // tp


@pytest.mark.parametrize("tp", [0, -2, 3, 256])
def test_num_local_heads_not_dividing(tp):
  with pytest.raises(ValueError, match="divisible"):
    MLAConfig.preset("DeepSeek-V3").num_local_heads(tp)


def test_unknown_preset():
  with pytest.raises(ValueError, match="DeepSeek-V3"):  # the message lists the known presets
    MLAConfig.preset("DeepSeek-V4")


@pytest.mark.parametrize("key, value, match", [
    ("hidden_size", "7168", "hidden_size is '7168' .str., expected an integer"),
    ("num_attention_heads", 128.0, "num_attention_heads is 128.0 .float., expected an integer"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps is '1e-6' .str., expected a number"),
    ("rope_theta", "abc", "rope_theta is 'abc'"),
    ("max_position_embeddings", True, "max_position_embeddings is True"),
    ("index_topk", "2048", "index_topk is '2048'"),
    ("rope_scaling", {"type": "yarn", "factor": "40"}, r"rope_scaling\.factor is '40'"),
    ("rope_scaling", "yarn", "rope_scaling is 'yarn', expected an object"),
    ("llama_4_scaling", {"beta": "0.1", "original_max_position_embeddings": 8192},
     r"llama_4_scaling\.beta is '0.1'"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 25 else "")
def test_string_and_float_numbers_name_their_key(key, value, match):
  with pytest.raises(ValueError, match=f"config.json: {match}"):
    MLAConfig.from_hf({**V32_EXP_JSON, key: value})


@pytest.mark.parametrize("key, value", [("vocab_size", "129280"), ("num_hidden_layers", 61.0),
                                        ("intermediate_size", None), ("vocab_size", 0)])
def test_decoder_numbers_name_their_key(key, value):
  from mla_jax.model import DecoderConfig
  from mla_jax.tiny_checkpoint import tiny_config
  with pytest.raises(ValueError, match=key):
    DecoderConfig.from_hf(tiny_config("v3") | {key: value})
