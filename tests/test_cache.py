"""LatentCache: allocation, paged writes (slot -> block, offset), fp8 quantization, gather."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mla_jax import reference
from mla_jax.cache import LatentCache, gather_latent_cache

NB, BS, L, R = 6, 4, 24, 8


def _rows(t, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return ((rng.standard_normal((t, L)) * scale).astype(np.float32),
          (rng.standard_normal((t, R)) * scale).astype(np.float32))


def _write_np(cache, kv_c, k_pe, slots, convert):
  """Numpy oracle: row t goes to block s // BS, offset s % BS when 0 <= s < NB*BS."""
  out = cache.copy()
  for t, s in enumerate(slots):
    if 0 <= s < NB * BS:
      out[s // BS, s % BS] = convert(np.concatenate([kv_c[t], k_pe[t]]))
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_allocate(dtype):
  c = LatentCache.allocate(NB, BS, L + R, dtype=dtype, k_scale=0.5)
  assert c.data.shape == (NB, BS, L + R) and c.data.dtype == jnp.dtype(dtype)
  assert (c.num_blocks, c.block_size) == (NB, BS)
  assert c.k_scale.dtype == jnp.float32 and float(c.k_scale) == 0.5
  assert not np.any(np.asarray(c.data.astype(jnp.float32)))
  assert c.is_fp8 == (dtype == "float8_e4m3fn")
  assert (c.scale_or_none is None) == (dtype != "float8_e4m3fn")


def test_allocate_default_is_576_bf16():
  c = LatentCache.allocate(2, 16)
  assert c.data.shape == (2, 16, 576) and c.data.dtype == jnp.bfloat16


@pytest.mark.parametrize("alias, name", [("fp8", "float8_e4m3fn"), ("bf16", "bfloat16"),
                                         ("fp16", "float16"), ("fp32", "float32")])
def test_allocate_takes_vllm_dtype_names(alias, name):
  assert LatentCache.allocate(2, 16, dtype=alias).data.dtype == jnp.dtype(name)


def test_unknown_dtype_names_the_supported_ones():
  with pytest.raises(ValueError, match="latent cache dtype 'fp9' is not supported; supported: "
                                       "float32, bfloat16, float16, float8_e4m3fn .*fp8="):
    LatentCache.allocate(2, 16, dtype="fp9")


@pytest.mark.parametrize("kwargs", [
    dict(dtype="int8"), dict(dtype="float8_e5m2"), dict(dtype="float64"),
    dict(num_blocks=0), dict(block_size=0), dict(latent_dim=-1),
    dict(k_scale=0.0), dict(k_scale=-1.0), dict(k_scale=float("nan")),
], ids=str)
def test_allocate_errors(kwargs):
  args = dict(num_blocks=NB, block_size=BS, latent_dim=L + R, dtype="bfloat16", k_scale=1.0)
  LatentCache.allocate(**args)  # the base is valid
  with pytest.raises(ValueError):
    LatentCache.allocate(**{**args, **kwargs})


@pytest.mark.parametrize("dtype, convert", [
    ("float32", lambda r: r),
    ("bfloat16", lambda r: r.astype(ml_dtypes.bfloat16)),
    ("float16", lambda r: r.astype(np.float16)),
])
def test_write_places_rows_and_skips_bad_slots(dtype, convert):
  # start from a non-zero cache so "untouched" is visible
  base = np.random.default_rng(9).standard_normal((NB, BS, L + R)).astype(np.float32)
  cache = LatentCache(jnp.asarray(base, dtype), jnp.float32(1.0))
  slots = np.array([5, -1, 0, 23, 24, 11, -7, 100, 16], np.int32)
  kv_c, k_pe = _rows(len(slots))
  got = cache.write(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(slots))
  want = _write_np(np.asarray(cache.data), kv_c, k_pe, slots, convert)
  assert got.data.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got.data), want)
  # explicit spot checks of the slot -> (block, offset) rule
  for t, (block, offset) in [(0, (1, 1)), (3, (5, 3)), (2, (0, 0))]:
    np.testing.assert_array_equal(np.asarray(got.data[block, offset], np.float32),
                                  convert(np.concatenate([kv_c[t], k_pe[t]])).astype(np.float32))
  # exactly the five valid slots changed
  changed = np.any(np.asarray(got.data, np.float32) != np.asarray(cache.data, np.float32), axis=-1)
  assert sorted(np.flatnonzero(changed.reshape(-1))) == [0, 5, 11, 16, 23]


@pytest.mark.parametrize("k_scale", [1.0, 0.25, 3.0])
def test_fp8_write_quantizes_and_saturates(k_scale):
  cache = LatentCache.allocate(NB, BS, L + R, dtype="float8_e4m3fn", k_scale=k_scale)
  slots = np.array([3, 7, -1, 22, 30], np.int32)
  kv_c, k_pe = _rows(len(slots), seed=1, scale=200.0)
  kv_c[0, :4] = [1e4, -1e4, 447.9 * k_scale, -500.0 * k_scale]  # saturate, do not turn into NaN
  got = cache.write(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(slots))
  to_e4m3 = lambda r: np.clip(r / np.float32(k_scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
  want = _write_np(np.zeros((NB, BS, L + R), ml_dtypes.float8_e4m3fn), kv_c, k_pe, slots, to_e4m3)
  assert got.data.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), want.view(np.uint8))
  row = np.asarray(got.data[0, 3].astype(jnp.float32))
  assert list(row[:4]) == [448.0, -448.0, 448.0, -448.0]
  assert not np.any(np.isnan(np.asarray(got.data.astype(jnp.float32))))


def test_write_under_jit_with_donation():
  @functools.partial(jax.jit, donate_argnums=0)
  def step(cache, kv_c, k_pe, slots):
    return cache.write(kv_c, k_pe, slots)

  cache = LatentCache.allocate(NB, BS, L + R, dtype="float32")
  want = np.zeros((NB, BS, L + R), np.float32)
  for i, slots in enumerate([np.array([0, 9, -1], np.int32), np.array([9, 23, 2], np.int32)]):
    kv_c, k_pe = _rows(3, seed=10 + i)
    old = cache
    cache = step(cache, jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(slots))
    want = _write_np(want, kv_c, k_pe, slots, lambda r: r)
    np.testing.assert_array_equal(np.asarray(cache.data), want)
    assert old.data.is_deleted()  # the donated buffer was consumed, not copied


@pytest.mark.parametrize("kv_shape, pe_shape, slots", [
    ((3, L), (3, R), np.zeros(2, np.int32)),  # T mismatch with slots
    ((3, L), (2, R), np.zeros(3, np.int32)),  # k_pe rows
    ((3, L + 1), (3, R), np.zeros(3, np.int32)),  # row width
    ((3, L), (3, R - 2), np.zeros(3, np.int32)),
    ((3, L), (3, R), np.zeros(3, np.float32)),  # non-integer slots
])
def test_write_shape_errors(kv_shape, pe_shape, slots):
  cache = LatentCache.allocate(NB, BS, L + R)
  with pytest.raises(ValueError):
    cache.write(jnp.zeros(kv_shape), jnp.zeros(pe_shape), jnp.asarray(slots))


@pytest.mark.parametrize("dtype, k_scale",
                         [("float32", None), ("bfloat16", None), ("float8_e4m3fn", 0.5)])
def test_gather_dequantizes_and_zeros_invalid(dtype, k_scale):
  raw = np.random.default_rng(5).standard_normal((NB, BS, L + R)).astype(np.float32) * 50
  data = jnp.asarray(raw, dtype)
  slots = np.array([0, 23, -1, 24, 7, 1000, 7], np.int32)
  got = np.asarray(gather_latent_cache(data, jnp.asarray(slots), k_scale))
  as_f32 = np.asarray(data).astype(np.float32) * (1.0 if k_scale is None else k_scale)
  assert got.dtype == np.float32 and got.shape == (len(slots), L + R)
  for i, s in enumerate(slots):
    want = as_f32[s // BS, s % BS] if 0 <= s < NB * BS else np.zeros(L + R, np.float32)
    np.testing.assert_array_equal(got[i], want)


def test_fp8_roundtrip_through_gather():
  k_scale = 0.125
  cache = LatentCache.allocate(NB, BS, L + R, dtype="float8_e4m3fn", k_scale=k_scale)
  kv_c, k_pe = _rows(2, seed=6, scale=10.0)
  cache = cache.write(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray([4, 13], jnp.int32))
  got = np.asarray(gather_latent_cache(cache.data, jnp.asarray([4, 13], jnp.int32),
                                                 cache.scale_or_none))
  want = np.concatenate([kv_c, k_pe], -1)
  # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 (plus subnormal spacing near 0)
  np.testing.assert_allclose(got, want, rtol=2 ** -4, atol=2 ** -9 * k_scale)


@pytest.mark.parametrize("k_scale", [np.inf, -np.inf, np.nan, 0.0, -0.5])
def test_non_finite_or_non_positive_scales_are_refused(k_scale):
  with pytest.raises(ValueError, match="k_scale must be finite and positive"):
    LatentCache.allocate(NB, BS, L + R, dtype="float8_e4m3fn", k_scale=k_scale)


def test_float16_cache_saturates_like_fp8():
  # 1e6 overflows float16 (max 65504): stored as inf, every decode row seeing it would be NaN.
  kv_c, k_pe = _rows(3, scale=1e6)
  cache = LatentCache.allocate(NB, BS, L + R, "float16").write(
      jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.array([0, 5, 6], jnp.int32))
  rows = np.asarray(cache.data, np.float32).reshape(NB * BS, L + R)[[0, 5, 6]]
  want = np.clip(np.concatenate([kv_c, k_pe], -1), -65504, 65504).astype(np.float16)
  np.testing.assert_array_equal(rows, want)
  o, lse = reference.latent_decode(jnp.ones((1, 2, L + R), jnp.float16) * 1e-4, cache.data,
                                   jnp.array([[1, 0]], jnp.int32), jnp.array([7], jnp.int32),
                                   scale=1e-6, kv_lora_rank=L)
  assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
