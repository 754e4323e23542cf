"""load_attention_weights: HF [out, in] tensors into nnx kernels, absorbed weights, errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.config import MLAConfig
from mla_jax.modules import DeepseekV2MLAAttention
from mla_jax.weights import load_attention_weights

CFG = MLAConfig.preset("DeepSeek-V3").replace(
    hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=24)  # V != P so a mixed-up split cannot pass
PREFIX = "model.layers.3.self_attn."


def _module(cfg):
  return DeepseekV2MLAAttention(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def _hf_tensors(cfg, seed=0):
  """HF names and PyTorch Linear layout [out, in], written from the checkpoint format."""
  rng = np.random.default_rng(seed)
  n, h = cfg.num_heads, cfg.hidden_size
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  shapes = {
      "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
      "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
      "kv_b_proj.weight": (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
      "o_proj.weight": (h, n * cfg.v_head_dim),
  }
  if cfg.q_lora_rank is None:
    shapes["q_proj.weight"] = (n * qk, h)
  else:
    shapes["q_a_proj.weight"] = (cfg.q_lora_rank, h)
    shapes["q_a_layernorm.weight"] = (cfg.q_lora_rank,)
    shapes["q_b_proj.weight"] = (n * qk, cfg.q_lora_rank)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q_lora", "no_q_lora"])
@pytest.mark.parametrize("prefix", ["", PREFIX], ids=["bare", "prefixed"])
def test_load_fills_every_parameter(q_lora_rank, prefix):
  cfg = CFG.replace(q_lora_rank=q_lora_rank)
  m = _module(cfg)
  tensors = _hf_tensors(cfg)
  load_attention_weights(m, {prefix + k: v for k, v in tensors.items()}, prefix=prefix)
  linears = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
  linears += ["q_proj"] if q_lora_rank is None else ["q_a_proj", "q_b_proj"]
  for name in linears:
    np.testing.assert_array_equal(np.asarray(getattr(m, name).kernel[...]),
                                  tensors[f"{name}.weight"].T)
  norms = ["kv_a_layernorm"] + ([] if q_lora_rank is None else ["q_a_layernorm"])
  for name in norms:
    np.testing.assert_array_equal(np.asarray(getattr(m, name).scale[...]),
                                  tensors[f"{name}.weight"])
  assert hasattr(m, "q_proj") == (q_lora_rank is None)


def test_absorbed_weights_are_kv_b_split():
  m = _module(CFG)
  tensors = _hf_tensors(CFG, seed=1)
  old_uk = np.asarray(m.mla_attn.W_UK_T[...]).copy()
  load_attention_weights(m, tensors)
  w = tensors["kv_b_proj.weight"]  # [N*(P+V), L], per head [k_nope P | v V] rows
  p, v, n = CFG.qk_nope_head_dim, CFG.v_head_dim, CFG.num_heads
  uk = np.asarray(m.mla_attn.W_UK_T[...])
  uv = np.asarray(m.mla_attn.W_UV[...])
  assert uk.shape == (n, p, CFG.kv_lora_rank) and uv.shape == (n, CFG.kv_lora_rank, v)
  for h in range(n):
    np.testing.assert_array_equal(uk[h], w[h * (p + v):h * (p + v) + p, :])
    np.testing.assert_array_equal(uv[h], w[h * (p + v) + p:(h + 1) * (p + v), :].T)
  assert not np.array_equal(uk, old_uk)  # recomputed after loading, not left from init


def test_loaded_module_runs_the_hf_math():
  # the kv path of HF's forward, written in numpy: kv_a -> norm(kv_c) -> kv_b -> per-head k_nope, v
  m = _module(CFG)
  tensors = _hf_tensors(CFG, seed=2)
  load_attention_weights(m, tensors)
  x = np.random.default_rng(3).standard_normal((5, CFG.hidden_size)).astype(np.float32)
  kv = x.astype(np.float64) @ tensors["kv_a_proj_with_mqa.weight"].T
  kv_c = kv[:, :CFG.kv_lora_rank]
  kv_c = kv_c / np.sqrt((kv_c ** 2).mean(-1, keepdims=True) + CFG.rms_norm_eps)
  kv_c = kv_c * tensors["kv_a_layernorm.weight"]
  kv_c_got = m.project(jnp.asarray(x), jnp.zeros(5, jnp.int32)).kv_c_normed
  np.testing.assert_allclose(np.asarray(kv_c_got), kv_c, rtol=1e-4, atol=1e-4)


def _expect_error(tensors, match, prefix=""):
  m = _module(CFG)
  with pytest.raises(ValueError, match=match):
    load_attention_weights(m, tensors, prefix=prefix)


@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_missing_tensor(prefix):
  tensors = {prefix + k: v for k, v in _hf_tensors(CFG).items() if k != "kv_b_proj.weight"}
  _expect_error(tensors, f"missing.*{prefix}kv_b_proj.weight", prefix)


def test_unexpected_tensor():
  tensors = _hf_tensors(CFG)
  tensors["q_proj.weight"] = np.zeros((4, 4), np.float32)  # not used when q_lora_rank is set
  _expect_error(tensors, "unexpected.*q_proj.weight")


def test_tensors_of_other_layers_are_ignored():
  tensors = {PREFIX + k: v for k, v in _hf_tensors(CFG).items()}
  tensors["model.layers.4.self_attn.o_proj.weight"] = np.zeros((1,), np.float32)
  tensors["model.layers.3.mlp.gate_proj.weight"] = np.zeros((1,), np.float32)
  load_attention_weights(_module(CFG), tensors, prefix=PREFIX)


@pytest.mark.parametrize("name", ["q_b_proj.weight", "kv_a_layernorm.weight", "o_proj.weight"])
def test_wrong_shape(name):
  tensors = _hf_tensors(CFG)
  tensors[name] = tensors[name].T if tensors[name].ndim == 2 else tensors[name][:-1]
  _expect_error(tensors, f"{name}.*shape")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_value(bad):
  tensors = _hf_tensors(CFG)
  tensors["kv_b_proj.weight"][3, 5] = bad
  _expect_error(tensors, "kv_b_proj.weight")
