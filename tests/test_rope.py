"""RoPE: DeepSeek-YaRN frequencies and the interleaved / NeoX rotations against float64 numpy."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.config import MLAConfig
from mla_jax.rope import RopeScaling, RotaryEmbedding

V3 = MLAConfig.preset("DeepSeek-V3")
POSITIONS = np.array([0, 1, 7, 100, 4095, 4096, 5000, 65535, 100000, 163839], np.int32)


def _yarn_inv_freq_np(dim, base, factor, orig_max, beta_fast, beta_slow):
  """vLLM's DeepseekScalingRotaryEmbedding._compute_inv_freq, in float64."""
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  extrap = 1.0 / pos_freqs
  interp = 1.0 / (factor * pos_freqs)
  d = lambda n: dim * math.log(orig_max / (n * 2 * math.pi)) / (2 * math.log(base))
  low = max(math.floor(d(beta_fast)), 0)
  high = min(math.ceil(d(beta_slow)), dim - 1)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  mask = 1 - ramp
  return interp * (1 - mask) + extrap * mask


def _mscale(f, m):
  return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0


def _rotate_np(x, positions, inv_freq, neox, scale=1.0, f32_angles=True):
  """x [T, H, D] rotated in float64; angles rounded as float32 products when f32_angles."""
  x = np.asarray(x, np.float64)
  if f32_angles:
    ang = (positions.astype(np.float32)[:, None]
           * inv_freq.astype(np.float32)[None, :]).astype(np.float64)
  else:
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
  cos, sin = np.cos(ang)[:, None] * scale, np.sin(ang)[:, None] * scale
  out = np.empty_like(x)
  h = x.shape[-1] // 2
  if neox:
    a, b = x[..., :h], x[..., h:]
    out[..., :h], out[..., h:] = a * cos - b * sin, b * cos + a * sin
  else:
    a, b = x[..., 0::2], x[..., 1::2]
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
  return out


def test_v3_yarn_inv_freq():
  s = V3.rope_scaling
  rope = RotaryEmbedding(V3.qk_rope_head_dim, V3.rope_theta, s)
  want = _yarn_inv_freq_np(64, 10000.0, 40.0, 4096, 32, 1)
  np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-13, atol=0)
  # the ramp actually mixes: high dims interpolated, low dims untouched, middle in between
  plain = 10000.0 ** (-np.arange(0, 64, 2) / 64)
  np.testing.assert_allclose(want[:10], plain[:10], rtol=1e-13)
  np.testing.assert_allclose(want[23:], plain[23:] / 40, rtol=1e-13)
  assert np.all((want[11:23] < plain[11:23]) & (want[11:23] > plain[11:23] / 40))


@pytest.mark.parametrize("dim, base, factor, orig",
                         [(128, 50000.0, 8.0, 8192), (32, 10000.0, 4.0, 2048)])
def test_yarn_inv_freq_other_configs(dim, base, factor, orig):
  rope = RotaryEmbedding(dim, base,
                         RopeScaling(factor=factor, original_max_position_embeddings=orig))
  np.testing.assert_allclose(rope.inv_freq, _yarn_inv_freq_np(dim, base, factor, orig, 32, 1),
                             rtol=1e-13)


def test_plain_inv_freq():
  rope = RotaryEmbedding(64, 10000.0)
  want = 1.0 / 10000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64)
  np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-13)
  assert rope.cos_sin_scale == 1.0


@pytest.mark.parametrize("mscale, mscale_all_dim",
                         [(1.0, 1.0), (0.707, 0.707), (1.0, 0.707), (0.5, 1.0)])
def test_cos_sin_scale(mscale, mscale_all_dim):
  s = RopeScaling(factor=40.0, mscale=mscale, mscale_all_dim=mscale_all_dim)
  rope = RotaryEmbedding(64, 10000.0, s)
  want = (0.1 * mscale * math.log(40) + 1) / (0.1 * mscale_all_dim * math.log(40) + 1)
  assert rope.cos_sin_scale == pytest.approx(want, rel=1e-12)
  if mscale != mscale_all_dim:
    assert abs(want - 1) > 0.05  # the non-trivial case really is non-trivial
  cos, sin = rope.cos_sin(jnp.asarray(POSITIONS))
  ang = (POSITIONS.astype(np.float32)[:, None]
         * rope.inv_freq.astype(np.float32)).astype(np.float64)
  np.testing.assert_allclose(np.asarray(cos), np.cos(ang) * want, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(np.asarray(sin), np.sin(ang) * want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("scaling", [None, V3.rope_scaling], ids=["plain", "yarn"])
def test_angles_close_to_float64(scaling):
  # Angles are f32 products: their error grows with |pos * inv_freq| (a few f32 ulps).
  rope = RotaryEmbedding(64, 10000.0, scaling)
  cos, sin = rope.cos_sin(jnp.asarray(POSITIONS))
  inv = (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64) if scaling is None
         else _yarn_inv_freq_np(64, 10000.0, 40.0, 4096, 32, 1))
  ang = POSITIONS.astype(np.float64)[:, None] * inv[None, :]
  tol = 4 * np.abs(ang) * 2.0 ** -24 + 2e-6
  assert np.all(np.abs(np.asarray(cos, np.float64) - np.cos(ang)) <= tol)
  assert np.all(np.abs(np.asarray(sin, np.float64) - np.sin(ang)) <= tol)
  assert cos.dtype == jnp.float32 and cos.shape == (len(POSITIONS), 32)


@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
@pytest.mark.parametrize("scaling", [None, V3.rope_scaling,
                                     RopeScaling(factor=40.0, mscale=1.0, mscale_all_dim=0.707)],
                         ids=["plain", "yarn-v3", "yarn-mscale"])
def test_rotation_matches_numpy(neox, scaling):
  rng = np.random.default_rng(0)
  t, h, d = 12, 3, 64
  positions = np.concatenate([rng.integers(0, 200000, t - 2), [0, 100000]]).astype(np.int32)
  x = rng.standard_normal((t, h, d)).astype(np.float32)
  rope = RotaryEmbedding(d, 10000.0, scaling, neox=neox)
  inv = (1.0 / 10000.0 ** (np.arange(0, d, 2) / d) if scaling is None
         else _yarn_inv_freq_np(d, 10000.0, scaling.factor, 4096, 32, 1))
  scale = (1.0 if scaling is None
           else _mscale(40.0, scaling.mscale) / _mscale(40.0, scaling.mscale_all_dim))
  got = np.asarray(rope(jnp.asarray(positions), jnp.asarray(x)))
  assert got.shape == x.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, _rotate_np(x, positions, inv, neox, scale), rtol=1e-4, atol=1e-4)
  # the other pairing gives a different answer: the test tells the two styles apart
  assert not np.allclose(got, _rotate_np(x, positions, inv, not neox, scale), atol=1e-2)


@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
def test_rotation_preserves_pair_norms(neox):
  rng = np.random.default_rng(1)
  positions = rng.integers(0, 150000, 16).astype(np.int32)
  x = rng.standard_normal((16, 2, 64)).astype(np.float32)
  got = np.asarray(RotaryEmbedding(64, 10000.0, V3.rope_scaling, neox=neox)(jnp.asarray(positions),
                                                                            jnp.asarray(x)))
  pairs = ((lambda a: np.stack([a[..., :32], a[..., 32:]], -1)) if neox
           else (lambda a: a.reshape(16, 2, 32, 2)))
  np.testing.assert_allclose(np.linalg.norm(pairs(got), axis=-1), np.linalg.norm(pairs(x), axis=-1),
                             rtol=1e-5, atol=1e-6)


def test_rotation_position_zero_is_identity():
  x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
  got = RotaryEmbedding(64)(jnp.zeros(3, jnp.int32), jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), x)


def test_two_dim_input_single_head():
  # k_pe is [T, R] (one shared head): same rotation as a one-head [T, 1, R]
  rng = np.random.default_rng(3)
  positions = rng.integers(0, 5000, 5).astype(np.int32)
  x = rng.standard_normal((5, 64)).astype(np.float32)
  rope = RotaryEmbedding(64, 10000.0, V3.rope_scaling)
  got = np.asarray(rope(jnp.asarray(positions), jnp.asarray(x)))
  want = _rotate_np(x[:, None], positions, _yarn_inv_freq_np(64, 10000.0, 40.0, 4096, 32, 1),
                    False)[:, 0]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("neox", [False, True])
def test_bf16_keeps_dtype(neox):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.bfloat16)
  positions = jnp.asarray([0, 3, 4096, 100000], jnp.int32)
  got = RotaryEmbedding(64, neox=neox)(positions, x)
  assert got.dtype == jnp.bfloat16
  want = _rotate_np(np.asarray(x.astype(jnp.float32)), np.asarray(positions),
                    1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64), neox)
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2)


def test_wrong_last_dim_raises():
  with pytest.raises(ValueError, match="64"):
    RotaryEmbedding(64)(jnp.zeros(2, jnp.int32), jnp.zeros((2, 4, 32)))


@pytest.mark.parametrize("dim", [63, 0, -2])
def test_bad_rotary_dim_raises(dim):
  with pytest.raises(ValueError):
    RotaryEmbedding(dim)
