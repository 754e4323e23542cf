"""Oracles that share no code with what they check (issue 17): the layers' RoPE styles against a
rotation written directly in numpy, every LSE merge against float64, the fp8 indexer's scores
against the unquantized indexer on the same weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import reference
from mla_jax.attention import merge_attn_states
from mla_jax.cache import IndexerKCache
from mla_jax.config import MLAConfig
from mla_jax.modules import DeepseekV2MLAAttention
from mla_jax.sharded_backend import DCP_MERGES, merge_across
from pallas_kernels.common import merge_splits

CONFIG = MLAConfig(hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, rope_theta=500.0,
                   index_n_heads=4, index_head_dim=32, index_topk=8)  # no YaRN: plain frequencies


def rotate_np(x, positions, theta, pairs):
  """x [T, ..., R] rotated by positions * theta**(-2i/R), the pair i being (x[2i], x[2i+1])
  (`pairs="interleaved"`) or (x[i], x[i + R/2]) (`"halves"`), as complex numbers."""
  x = np.asarray(x, np.float64)
  r = x.shape[-1]
  angle = np.asarray(positions, np.float64)[:, None] * theta ** (-np.arange(0, r, 2) / r)
  turn = np.exp(1j * angle).reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
  if pairs == "interleaved":
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
  z = (x[..., :r // 2] + 1j * x[..., r // 2:]) * turn
  return np.concatenate([z.real, z.imag], axis=-1)


def kernel(linear):
  return np.asarray(linear.kernel[...], np.float64)


@pytest.fixture(scope="module")
def layer():
  return DeepseekV2MLAAttention(CONFIG, backend="reference", dtype=jnp.float32,
                                param_dtype=jnp.float32, indexer_fp8=False, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((6, CONFIG.hidden_size)).astype(np.float32),
          np.array([0, 1, 7, 100, 1000, 4000], np.int32))


def test_mla_rope_is_interleaved(layer, inputs):
  x, positions = inputs
  c = CONFIG
  got = layer.project(jnp.asarray(x), jnp.asarray(positions))
  k_pe = (x.astype(np.float64) @ kernel(layer.kv_a_proj_with_mqa))[:, c.kv_lora_rank:]
  np.testing.assert_allclose(got.k_pe, rotate_np(k_pe, positions, c.rope_theta, "interleaved"),
                             rtol=1e-3, atol=2e-3)
  q = (np.asarray(got.q_c, np.float64) @ kernel(layer.q_b_proj)).reshape(6, c.num_heads, -1)
  np.testing.assert_allclose(got.q[..., c.qk_nope_head_dim:],
                             rotate_np(q[..., c.qk_nope_head_dim:], positions, c.rope_theta,
                                       "interleaved"), rtol=1e-3, atol=2e-3)


def test_indexer_rope_is_neox_on_the_leading_dims(layer, inputs):
  x, positions = inputs
  c, r = CONFIG, CONFIG.qk_rope_head_dim
  q_c = np.random.default_rng(1).standard_normal((6, c.q_lora_rank)).astype(np.float32)
  q, _, k = layer.indexer.project(jnp.asarray(x), jnp.asarray(q_c), jnp.asarray(positions))
  h = x.astype(np.float64) @ kernel(layer.indexer.wk)
  h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-6)
  h = h * np.asarray(layer.indexer.k_norm.scale[...]) + np.asarray(layer.indexer.k_norm.bias[...])
  want_k = np.concatenate([rotate_np(h[:, :r], positions, c.rope_theta, "halves"), h[:, r:]], -1)
  np.testing.assert_allclose(k, want_k, rtol=1e-3, atol=2e-3)
  qh = (q_c.astype(np.float64) @ kernel(layer.indexer.wq_b)).reshape(6, c.index_n_heads, -1)
  want_q = np.concatenate([rotate_np(qh[..., :r], positions, c.rope_theta, "halves"), qh[..., r:]],
                          -1)
  np.testing.assert_allclose(q, want_q, rtol=1e-3, atol=2e-3)


# (lse of each part) per row: large, very negative, unequal, far apart, empty parts, +inf (read as
# -inf by the merges that document it).
LSES = np.array([[100.0, 99.0, 100.0], [-120.0, -121.0, -119.5], [88.7, 88.5, -5.0],
                 [1000.0, -1000.0, 0.0], [-np.inf, 5.0, -np.inf], [-np.inf, -np.inf, -np.inf],
                 [3.0, 3.0, 3.0], [-np.inf, -110.0, 60.0]])


def merged_np(o_parts, lse_parts):
  """float64 [T, S, N, V], [T, S, N] -> o [T, N, V], lse [T, N]: each part weighted by
  exp(lse_i - lse), lse = log sum exp lse_i, parts with -inf lse left out."""
  o = np.zeros(o_parts.shape[:1] + o_parts.shape[2:])
  lse = np.full(lse_parts.shape[:1] + lse_parts.shape[2:], -np.inf)
  for t in range(o.shape[0]):
    for n in range(o.shape[1]):
      live = np.isfinite(lse_parts[t, :, n])
      if live.any():
        lse[t, n] = np.logaddexp.reduce(lse_parts[t, live, n])
        w = np.exp(lse_parts[t, live, n] - lse[t, n])
        o[t, n] = (w[:, None] * o_parts[t, live, n]).sum(0)
  return o, lse


@pytest.fixture
def parts():
  rng = np.random.default_rng(2)
  lse = np.repeat(LSES[:, :, None], 2, axis=2) + np.array([0.0, 0.25])  # [T, S=3, N=2]
  o = rng.standard_normal(lse.shape + (8,))
  o[~np.isfinite(lse)] = 0.0  # what a kernel gives a part that saw nothing
  return o, lse


def plus_inf(o, lse):
  """A part of row 0 with lse +inf, which merge_attn_states and the DCP merge read as empty."""
  lse = lse.copy()
  lse[0, 0] = np.inf
  return o, lse


def check(got_o, got_lse, o, lse):
  want_o, want_lse = merged_np(o, np.where(lse == np.inf, -np.inf, lse))
  np.testing.assert_allclose(np.asarray(got_lse, np.float64), want_lse, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got_o, np.float64), want_o, rtol=1e-5, atol=1e-6)


def test_merge_attn_states_against_float64(parts):
  o, lse = plus_inf(*parts)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  got_o, got_lse = merge_attn_states(f32(o[:, 0]), f32(lse[:, 0]), f32(o[:, 1]), f32(lse[:, 1]))
  check(got_o, got_lse, o[:, :2], lse[:, :2])
  got_o, got_lse = merge_attn_states(got_o, got_lse, f32(o[:, 2]), f32(lse[:, 2]))
  check(got_o, got_lse, o, lse)


def test_merge_attn_states_ignores_an_empty_part_whatever_its_o():
  o_a, lse_a = jnp.ones((1, 1, 4)), jnp.full((1, 1), 2.0)
  o, lse = merge_attn_states(o_a, lse_a, jnp.full((1, 1, 4), jnp.nan), jnp.full((1, 1), -jnp.inf))
  np.testing.assert_array_equal(o, o_a)
  np.testing.assert_array_equal(lse, lse_a)


def test_split_merge_against_float64(parts):
  o, lse = parts
  got_o, got_lse = merge_splits(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32),
                                jnp.float32)
  check(got_o, got_lse, o, lse)


@pytest.mark.parametrize("how", DCP_MERGES)
def test_dcp_merge_against_float64(parts, how):
  # The collective over devices, here over a vmapped axis standing for them.
  o, lse = plus_inf(*parts)
  merge = jax.vmap(functools.partial(merge_across, "dcp", how=how), axis_name="dcp")
  got_o, got_lse = merge(jnp.asarray(o.transpose(1, 0, 2, 3), jnp.float32),
                         jnp.asarray(lse.transpose(1, 0, 2), jnp.float32))
  if how == "o_proj":  # each device holds its part; o_proj's all-reduce sums the parts later
    got_o = jnp.broadcast_to(got_o.sum(0), got_o.shape)
  for device in range(o.shape[1]):
    check(got_o[device], got_lse[device], o, lse)


def test_fp8_indexer_scores_match_the_unquantized_indexer(layer, inputs):
  # The same weights with fp8 q (and its per-head scales folded into the weights) and an fp8 K
  # cache, against float q and a bfloat16 K cache.
  x, _ = inputs
  c = CONFIG
  positions = jnp.arange(6, dtype=jnp.int32)
  q_c = jnp.asarray(np.random.default_rng(3).standard_normal((6, c.q_lora_rank)), jnp.float32)
  tables = jnp.zeros((6, 1), jnp.int32)
  scores = {}
  for fp8, cache_dtype in ((False, "bfloat16"), (True, "float8_e4m3fn")):
    layer.indexer.fp8 = fp8
    q, weights, k = layer.indexer.project(jnp.asarray(x), q_c, positions)
    cache = IndexerKCache.allocate(1, 8, c.index_head_dim, cache_dtype).write(k, positions)
    scores[fp8] = np.asarray(reference.indexer_logits(q, weights, cache.values, cache.scales,
                                                      tables, positions + 1))
  layer.indexer.fp8 = False
  seen = np.isfinite(scores[False])
  assert (np.isfinite(scores[True]) == seen).all() and seen.sum() == 21
  want, got = scores[False][seen], scores[True][seen]
  # e4m3 keeps 3 mantissa bits: a few percent of the scores' scale per element.
  np.testing.assert_allclose(got, want, atol=0.08 * np.abs(want).max())
  assert np.corrcoef(got, want)[0, 1] > 0.99
