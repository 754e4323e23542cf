"""V3.2 caches: ue8m0 scales, the fp8_ds_mla latent cache and the indexer K cache, and their exact
vLLM byte layouts. Oracles are numpy (float64 formulas, ml_dtypes casts, bytes assembled by
hand)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mla_jax import quant
from mla_jax.cache import DSMLACache, IndexerKCache

E4M3, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16
NB, BS, L, R = 3, 4, 512, 64
ROW_BYTES = L + 4 * (L // 128) + 2 * R
# valid: 5, 0, 10, 7, 9; -1 and -4 would wrap (numpy-style) onto the unwritten slots 11 and 8
BAD_SLOTS = np.array([5, -1, 0, 10, 12, 7, -4, 100, 9], np.int32)


def _scale_np(amax, floor):
  """float64 `2**ceil(log2(max(amax / 448, floor)))`."""
  return 2.0 ** np.ceil(np.log2(np.maximum(np.asarray(amax, np.float64) / 448.0, floor)))


def _e4m3_np(x, scale):
  return np.clip(np.asarray(x, np.float64) / scale, -448, 448).astype(E4M3)


def _is_pow2(x):
  mantissa, _ = np.frexp(np.asarray(x, np.float64))
  return np.all(mantissa == 0.5)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint8 if x.dtype.itemsize == 1 else f"u{x.dtype.itemsize}")


def _latent_rows(t, seed=0):
  """kv_c [t, L] with each 128-tile at its own magnitude (1e-3 .. 1e3), k_pe [t, R]."""
  rng = np.random.default_rng(seed)
  mags = 10.0 ** rng.uniform(-3, 3, (t, L // 128, 1))
  kv_c = (rng.standard_normal((t, L // 128, 128)) * mags).reshape(t, L).astype(np.float32)
  return kv_c, rng.standard_normal((t, R)).astype(np.float32) * 3


def _random_ds_parts(seed, nb=NB, bs=BS, l=L, r=R):
  """Finite random (nope e4m3, positive f32 tile scales, bf16 rope) as numpy arrays."""
  rng = np.random.default_rng(seed)
  nope = (rng.standard_normal((nb, bs, l)) * 100).astype(E4M3)
  scales = rng.uniform(1e-3, 4.0, (nb, bs, l // 128)).astype(np.float32)  # not powers of two
  rope = rng.standard_normal((nb, bs, r)).astype(BF16)
  return nope, scales, rope


def _ds_bytes_np(nope, scales, rope):
  """vLLM's fp8_ds_mla row, by hand: e4m3 bytes | little-endian f32 scales | little-endian bf16."""
  return np.concatenate([nope.view(np.uint8), scales.astype("<f4").view(np.uint8),
                         rope.view(np.uint16).astype("<u2").view(np.uint8)], axis=-1)


def _indexer_bytes_np(values, scales):
  """vLLM's indexer block, by hand: all BS*D value bytes, then BS little-endian f32 scales."""
  nb, bs, d = values.shape
  blocks = [np.concatenate([values[b].reshape(-1).view(np.uint8),
                            scales[b].astype("<f4").view(np.uint8)])
            for b in range(nb)]
  return np.stack(blocks).reshape(nb, bs, d + 4)


# ----------------------------------------------------------------------------- ue8m0 scales

@pytest.mark.parametrize("floor", [quant.DS_MLA_SCALE_FLOOR, quant.INDEXER_K_SCALE_FLOOR,
                                   quant.INDEXER_Q_SCALE_FLOOR])
def test_ue8m0_scale_matches_float64_rule(floor):
  rng = np.random.default_rng(0)
  exact = 448.0 * 2.0 ** np.arange(-30, 30)  # amax/448 exactly a power of two: no rounding up
  amax = np.concatenate([exact, exact * (1 + 2.0 ** -20), exact * (1 - 2.0 ** -20),
                         10.0 ** rng.uniform(-12, 30, 500), [0.0, 1e-30]]).astype(np.float32)
  got = np.asarray(quant.ue8m0_scale(jnp.asarray(amax), floor))
  assert got.dtype == np.float32 and _is_pow2(got)
  np.testing.assert_array_equal(got, _scale_np(amax, floor))


def test_ue8m0_scale_without_floor():
  amax = np.array([448 * 2.0 ** -13, 448 * 2.0 ** -13 * 1.001, 3.0, 448.0, 1e20], np.float32)
  np.testing.assert_array_equal(np.asarray(quant.ue8m0_scale(jnp.asarray(amax))),
                                [2.0 ** -13, 2.0 ** -12, 2.0 ** -7, 1.0, 2.0 ** 58])
  # amax == 0 still gives a usable (normal, positive) scale, never 0 -> NaN
  assert float(quant.ue8m0_scale(jnp.float32(0.0))) == 2.0 ** -126
  with pytest.raises(ValueError):
    quant.ue8m0_scale(jnp.float32(1.0), floor=0.0)


def test_quantize_ue8m0_groups():
  rng = np.random.default_rng(1)
  x = (rng.standard_normal((3, 5, 64)) * 10.0 ** rng.uniform(-3, 3, (3, 5, 1))).astype(np.float32)
  x[1, 2, 16:32] = 0  # one all-zero group
  values, scales = quant.quantize_ue8m0(jnp.asarray(x), 16, floor=1e-4)
  want_scales = _scale_np(np.abs(x.reshape(3, 5, 4, 16)).max(-1), 1e-4)
  np.testing.assert_array_equal(np.asarray(scales), want_scales)
  assert float(scales[1, 2, 1]) == 2.0 ** -13
  want = _e4m3_np(x.reshape(3, 5, 4, 16), want_scales[..., None]).reshape(x.shape)
  np.testing.assert_array_equal(_bits(values), _bits(want))
  with pytest.raises(ValueError):
    quant.quantize_ue8m0(jnp.asarray(x), 24)


def test_quantize_indexer_q_per_token_head():
  rng = np.random.default_rng(2)
  q = (rng.standard_normal((4, 3, 128)) * 10.0 ** rng.uniform(-2, 2, (4, 3, 1))).astype(np.float32)
  q[2, 1] = 0
  values, scales = quant.quantize_indexer_q(jnp.asarray(q))
  assert values.shape == q.shape and values.dtype == jnp.float8_e4m3fn and scales.shape == (4, 3)
  # vLLM per_token_group_quant_fp8: max(amax, eps=1e-10) / 448, rounded up to a power of two
  want = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(q).max(-1), 1e-10) / 448.0))
  np.testing.assert_array_equal(np.asarray(scales), want)
  np.testing.assert_array_equal(_bits(values), _bits(_e4m3_np(q, want[..., None])))


# ----------------------------------------------------------------------------- fp8_ds_mla cache

def test_ds_allocate():
  c = DSMLACache.allocate(NB, BS)
  assert (c.nope.shape, c.tile_scales.shape, c.rope.shape) == (
      (NB, BS, L), (NB, BS, 4), (NB, BS, R))
  assert (c.nope.dtype, c.tile_scales.dtype, c.rope.dtype) == (
      jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16)
  assert (c.num_blocks, c.block_size, c.bytes_per_token) == (NB, BS, 656)
  assert c.nope.nbytes + c.tile_scales.nbytes + c.rope.nbytes == NB * BS * 656
  assert not np.any(np.asarray(c.to_vllm_bytes()))


@pytest.mark.parametrize("in_dtype", [np.float32, BF16])
def test_ds_write_quantizes_per_tile(in_dtype):
  slots = np.array([0, 5, 11, 2], np.int32)
  kv_c, k_pe = _latent_rows(len(slots))
  kv_c[1, 256:384] = 0  # an all-zero tile
  kv_c, k_pe = kv_c.astype(in_dtype), k_pe.astype(in_dtype)
  c = DSMLACache.allocate(NB, BS).write(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(slots))
  x = kv_c.astype(np.float64).reshape(-1, 4, 128)
  want_scales = _scale_np(np.abs(x).max(-1), 1e-4)
  blocks, offsets = slots // BS, slots % BS
  got_scales = np.asarray(c.tile_scales)[blocks, offsets]
  np.testing.assert_array_equal(got_scales, want_scales)
  assert _is_pow2(got_scales) and got_scales[1, 2] == 2.0 ** -13
  want_nope = _e4m3_np(x, want_scales[..., None]).reshape(-1, L)
  np.testing.assert_array_equal(_bits(np.asarray(c.nope)[blocks, offsets]), _bits(want_nope))
  np.testing.assert_array_equal(_bits(np.asarray(c.rope)[blocks, offsets]),
                                _bits(k_pe.astype(BF16)))
  # round trip within e4m3's error: half an ulp (2**-4 relative) or, below e4m3's smallest
  # normal, half the subnormal spacing (scale * 2**-10; checked against the looser 2**-9)
  deq = np.asarray(c.dequantize_rows(jnp.asarray(slots)), np.float64)
  err = np.abs(deq[:, :L].reshape(-1, 4, 128) - x)
  assert np.all(err <= 2.0 ** -4 * np.abs(x) + want_scales[..., None] * 2.0 ** -9)
  np.testing.assert_array_equal(deq[:, L:], k_pe.astype(BF16).astype(np.float64))
  assert np.all(deq[1, 256:384] == 0)


def test_ds_write_large_values_do_not_overflow():
  kv_c = np.zeros((4, L), np.float32)
  kv_c[0, :128] = 448.0 * 2.0 ** np.arange(-127, 1)  # amax/448 == 1: scale 1, max maps to 448
  kv_c[1, :3] = [3.0e38, -2.5e38, 1.0]  # near float32 max (whose e4m3 rounding stays finite)
  kv_c[2, 128:256] = np.linspace(-1e30, 1e30, 128)
  kv_c[3, 384:] = 448.0 * 2.0 ** 20 * (1 - 2.0 ** -20)  # just under a power-of-two boundary
  c = DSMLACache.allocate(1, 4).write(jnp.asarray(kv_c), jnp.zeros((4, R)), jnp.arange(4))
  nope = np.asarray(c.nope).astype(np.float32)
  assert not np.any(np.isnan(nope)) and np.abs(nope).max() <= 448
  assert nope[0, 0, 127] == 448 and float(c.tile_scales[0, 0, 0]) == 1.0
  deq = np.asarray(c.dequantize(), np.float64)[0, :, :L]
  assert np.all(np.isfinite(deq))
  scales = np.repeat(np.asarray(c.tile_scales[0], np.float64), 128, axis=-1)
  assert np.all(np.abs(deq - kv_c)
                <= 2.0 ** -4 * np.abs(kv_c.astype(np.float64)) + scales * 2.0 ** -9)


def test_ds_write_skips_bad_slots():
  nope, scales, rope = _random_ds_parts(3)
  base = DSMLACache(jnp.asarray(nope), jnp.asarray(scales), jnp.asarray(rope))
  kv_c, k_pe = _latent_rows(len(BAD_SLOTS), seed=4)
  got = base.write(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(BAD_SLOTS))
  changed = np.zeros((NB, BS), bool)
  for part, old in [(got.nope, nope), (got.tile_scales, scales), (got.rope, rope)]:
    changed |= np.any(_bits(part) != _bits(old), axis=-1)
  assert sorted(np.flatnonzero(changed)) == [0, 5, 7, 9, 10]
  # the row written at slot 9 is token 8's (slot -> block 2, offset 1)
  np.testing.assert_array_equal(_bits(np.asarray(got.rope)[2, 1]), _bits(k_pe[8].astype(BF16)))


def test_ds_dequantize_rows_and_whole_cache():
  nope, scales, rope = _random_ds_parts(5)
  c = DSMLACache(jnp.asarray(nope), jnp.asarray(scales), jnp.asarray(rope))
  full = np.concatenate([(nope.astype(np.float32).reshape(NB, BS, 4, 128)
                          * scales[..., None]).reshape(NB, BS, L),
                         rope.astype(np.float32)], axis=-1)
  got = np.asarray(c.dequantize())
  assert got.dtype == np.float32 and got.shape == (NB, BS, L + R)
  np.testing.assert_array_equal(got, full)
  slots = np.array([0, 11, -1, 12, 6, 1000, 6], np.int32)
  rows = np.asarray(c.dequantize_rows(jnp.asarray(slots)))
  for i, s in enumerate(slots):
    want = full[s // BS, s % BS] if 0 <= s < NB * BS else np.zeros(L + R, np.float32)
    np.testing.assert_array_equal(rows[i], want)


def test_ds_bytes_literal_row():
  """One row with values whose bytes are known: e4m3 1.0 = 0x38, f32 1.0 = 00 00 80 3f and
  0.5 = 00 00 00 3f (little-endian), bf16 1.0 = 80 3f, bf16 -2.0 = 00 c0."""
  row = np.zeros(ROW_BYTES, np.uint8)
  row[0], row[511] = 0x38, 0xB8  # nope[0] = 1.0, nope[511] = -1.0
  row[512:516] = [0x00, 0x00, 0x80, 0x3F]  # tile 0 scale = 1.0
  row[524:528] = [0x00, 0x00, 0x00, 0x3F]  # tile 3 scale = 0.5
  row[528:530] = [0x80, 0x3F]  # rope[0] = 1.0
  row[654:656] = [0x00, 0xC0]  # rope[63] = -2.0
  data = np.zeros((1, 2, ROW_BYTES), np.uint8)
  data[0, 1] = row
  c = DSMLACache.from_vllm_bytes(jnp.asarray(data))
  assert (float(c.nope[0, 1, 0].astype(jnp.float32)) == 1.0
          and float(c.nope[0, 1, 511].astype(jnp.float32)) == -1.0)
  np.testing.assert_array_equal(np.asarray(c.tile_scales[0, 1]), [1.0, 0.0, 0.0, 0.5])
  assert float(c.rope[0, 1, 0]) == 1.0 and float(c.rope[0, 1, 63]) == -2.0
  deq = np.asarray(c.dequantize_rows(jnp.asarray([1])))[0]
  assert deq[0] == 1.0 and deq[511] == -0.5 and deq[512] == 1.0 and deq[575] == -2.0
  np.testing.assert_array_equal(np.asarray(c.to_vllm_bytes()), data)


@pytest.mark.parametrize("l, r", [(L, R), (256, 32)])
def test_ds_bytes_match_hand_built(l, r):
  nope, scales, rope = _random_ds_parts(6, l=l, r=r)
  want = _ds_bytes_np(nope, scales, rope)
  c = DSMLACache(jnp.asarray(nope), jnp.asarray(scales), jnp.asarray(rope))
  got = np.asarray(c.to_vllm_bytes())
  assert got.dtype == np.uint8 and got.shape == (NB, BS, l + 4 * (l // 128) + 2 * r) == want.shape
  np.testing.assert_array_equal(got, want)
  back = DSMLACache.from_vllm_bytes(jnp.asarray(want), kv_lora_rank=l, rope_dim=r)
  for part, ref in [(back.nope, nope), (back.tile_scales, scales), (back.rope, rope)]:
    assert part.dtype == ref.dtype
    np.testing.assert_array_equal(_bits(part), _bits(ref))


def test_ds_bytes_roundtrip_every_bit_pattern_under_jit():
  data = np.random.default_rng(7).integers(0, 256, (NB, BS, ROW_BYTES), dtype=np.uint8)  # NaNs too
  from_b = jax.jit(DSMLACache.from_vllm_bytes)
  to_b = jax.jit(lambda c: c.to_vllm_bytes())
  c = from_b(jnp.asarray(data))
  np.testing.assert_array_equal(np.asarray(to_b(c)), data)
  # and cache -> bytes -> cache
  kv_c, k_pe = _latent_rows(NB * BS, seed=8)
  c = DSMLACache.allocate(NB, BS).write(jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.arange(NB * BS))
  back = from_b(to_b(c))
  for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(back)):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_ds_write_under_jit_with_donation():
  @functools.partial(jax.jit, donate_argnums=0)
  def step(cache, kv_c, k_pe, slots):
    return cache.write(kv_c, k_pe, slots)

  kv_c, k_pe = _latent_rows(len(BAD_SLOTS), seed=9)
  eager = DSMLACache.allocate(NB, BS).write(jnp.asarray(kv_c), jnp.asarray(k_pe),
                                            jnp.asarray(BAD_SLOTS))
  old = DSMLACache.allocate(NB, BS)
  got = step(old, jnp.asarray(kv_c), jnp.asarray(k_pe), jnp.asarray(BAD_SLOTS))
  np.testing.assert_array_equal(np.asarray(got.to_vllm_bytes()), np.asarray(eager.to_vllm_bytes()))
  assert old.nope.is_deleted()


# ----------------------------------------------------------------------------- indexer K cache

D = 128


def _keys(t, seed=0, d=D):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((t, d)) * 10.0 ** rng.uniform(-3, 3, (t, 1))).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_indexer_allocate(dtype):
  c = IndexerKCache.allocate(NB, BS, dtype=dtype)
  assert c.values.shape == (NB, BS, D) and c.values.dtype == jnp.dtype(dtype)
  assert c.scales.shape == (NB, BS) and c.scales.dtype == jnp.float32
  assert (c.num_blocks, c.block_size, c.head_dim, c.is_fp8) == (NB, BS, D, dtype == "float8_e4m3fn")
  np.testing.assert_array_equal(np.asarray(c.scales), 0.0 if dtype == "float8_e4m3fn" else 1.0)


def test_indexer_fp8_write_per_token_scale():
  slots = np.array([0, 3, 6, 11, 1], np.int32)
  k = _keys(len(slots), seed=1)
  k[2] = 0  # all zero: vLLM's max(amax, 1e-4)/448 gives 2**-22
  k[4] *= 1e-6 / np.abs(k[4]).max()  # amax 1e-6 < 1e-4: floored too
  c = IndexerKCache.allocate(NB, BS).write(jnp.asarray(k), jnp.asarray(slots))
  want_scales = 2.0 ** np.ceil(
      np.log2(np.maximum(np.abs(k).max(-1).astype(np.float64), 1e-4) / 448))
  got_scales = np.asarray(c.scales)[slots // BS, slots % BS]
  np.testing.assert_array_equal(got_scales, want_scales)
  assert got_scales[2] == got_scales[4] == 2.0 ** -22
  np.testing.assert_array_equal(_bits(np.asarray(c.values)[slots // BS, slots % BS]),
                                _bits(_e4m3_np(k, want_scales[:, None])))
  values, scales = c.gather(jnp.asarray(slots))
  deq = np.asarray(values, np.float64) * np.asarray(scales, np.float64)[:, None]
  assert np.all(np.abs(deq - k) <= 2.0 ** -4 * np.abs(k) + want_scales[:, None] * 2.0 ** -9)


def test_indexer_bf16_write_stores_as_is():
  k = _keys(3, seed=2)
  c = IndexerKCache.allocate(NB, BS, dtype="bfloat16").write(jnp.asarray(k), jnp.asarray([4, 0, 9]))
  np.testing.assert_array_equal(_bits(np.asarray(c.values)[[1, 0, 2], [0, 0, 1]]),
                                _bits(k.astype(BF16)))
  np.testing.assert_array_equal(np.asarray(c.scales), 1.0)
  with pytest.raises(ValueError):
    c.to_vllm_bytes()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_indexer_write_skips_bad_slots_and_gather_zeros_invalid(dtype):
  rng = np.random.default_rng(3)
  base_v = (rng.standard_normal((NB, BS, D)) * 50).astype(
      E4M3 if dtype == "float8_e4m3fn" else BF16)
  base_s = rng.uniform(0.5, 2.0, (NB, BS)).astype(np.float32)
  base = IndexerKCache(jnp.asarray(base_v), jnp.asarray(base_s))
  k = _keys(len(BAD_SLOTS), seed=4)
  got = base.write(jnp.asarray(k), jnp.asarray(BAD_SLOTS))
  changed = np.any(_bits(got.values) != _bits(base_v), axis=-1) | (np.asarray(got.scales) != base_s)
  assert sorted(np.flatnonzero(changed)) == [0, 5, 7, 9, 10]
  slots = np.array([2, -1, 12, 5, 1000], np.int32)
  values, scales = got.gather(jnp.asarray(slots))
  assert values.dtype == jnp.dtype(dtype) and values.shape == (5, D) and scales.shape == (5,)
  vals, scs = _bits(values), np.asarray(scales)
  new_v, new_s = _bits(got.values).reshape(NB * BS, D), np.asarray(got.scales).reshape(-1)
  for i, s in enumerate(slots):
    if 0 <= s < NB * BS:
      np.testing.assert_array_equal(vals[i], new_v[s])
      assert scs[i] == new_s[s]
    else:
      assert not np.any(vals[i]) and scs[i] == 0


@pytest.mark.parametrize("d", [D, 16])
def test_indexer_bytes_block_major(d):
  rng = np.random.default_rng(5)
  values = (rng.standard_normal((NB, BS, d)) * 100).astype(E4M3)
  scales = (2.0 ** rng.integers(-20, 5, (NB, BS))).astype(np.float32)
  want = _indexer_bytes_np(values, scales)
  got = np.asarray(IndexerKCache(jnp.asarray(values), jnp.asarray(scales)).to_vllm_bytes())
  assert got.dtype == np.uint8 and got.shape == (NB, BS, d + 4)
  np.testing.assert_array_equal(got, want)
  # the layout spelled out: block b's first BS*D bytes are its values token by token, then its
  # BS scales; token i's scale sits at byte BS*D + 4*i of the block
  flat = got.reshape(NB, BS * (d + 4))
  for b in range(NB):
    for i in range(BS):
      np.testing.assert_array_equal(flat[b, i * d:(i + 1) * d], values[b, i].view(np.uint8))
      assert flat[b, BS * d + 4 * i:BS * d + 4 * i + 4].view("<f4")[0] == scales[b, i]
  back = IndexerKCache.from_vllm_bytes(jnp.asarray(want))
  assert back.values.dtype == jnp.float8_e4m3fn and back.head_dim == d
  np.testing.assert_array_equal(_bits(back.values), values.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(back.scales), scales)


def test_indexer_bytes_roundtrip_under_jit():
  data = np.random.default_rng(6).integers(0, 256, (NB, BS, D + 4), dtype=np.uint8)
  from_b = jax.jit(IndexerKCache.from_vllm_bytes)
  to_b = jax.jit(lambda c: c.to_vllm_bytes())
  np.testing.assert_array_equal(np.asarray(to_b(from_b(jnp.asarray(data)))), data)
  c = IndexerKCache.allocate(NB, BS).write(jnp.asarray(_keys(NB * BS, seed=7)), jnp.arange(NB * BS))
  back = from_b(to_b(c))
  np.testing.assert_array_equal(_bits(back.values), _bits(c.values))
  np.testing.assert_array_equal(_bits(back.scales), _bits(c.scales))


def test_indexer_write_under_jit_with_donation():
  @functools.partial(jax.jit, donate_argnums=0)
  def step(cache, k, slots):
    return cache.write(k, slots)

  k = _keys(len(BAD_SLOTS), seed=8)
  eager = IndexerKCache.allocate(NB, BS).write(jnp.asarray(k), jnp.asarray(BAD_SLOTS))
  old = IndexerKCache.allocate(NB, BS)
  got = step(old, jnp.asarray(k), jnp.asarray(BAD_SLOTS))
  np.testing.assert_array_equal(np.asarray(got.to_vllm_bytes()), np.asarray(eager.to_vllm_bytes()))
  assert old.values.is_deleted()


# ----------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=0), dict(block_size=-1), dict(kv_lora_rank=0), dict(kv_lora_rank=200),
    dict(rope_dim=0), dict(num_blocks=2.0),
], ids=str)
def test_ds_allocate_errors(kwargs):
  with pytest.raises(ValueError):
    DSMLACache.allocate(**{**dict(num_blocks=NB, block_size=BS), **kwargs})


@pytest.mark.parametrize("kwargs", [
    dict(num_blocks=0), dict(block_size=0), dict(head_dim=-4), dict(dtype="float32"),
    dict(dtype="float8_e5m2"), dict(dtype="int8"), dict(dtype="not_a_dtype"),
], ids=str)
def test_indexer_allocate_errors(kwargs):
  with pytest.raises(ValueError):
    IndexerKCache.allocate(**{**dict(num_blocks=NB, block_size=BS), **kwargs})


@pytest.mark.parametrize("kv_shape, pe_shape, slots", [
    ((3, L), (3, R), np.zeros(2, np.int32)),  # T mismatch with slots
    ((3, L), (2, R), np.zeros(3, np.int32)),  # k_pe rows
    ((3, L + 128), (3, R), np.zeros(3, np.int32)),  # latent width
    ((3, L), (3, R - 2), np.zeros(3, np.int32)),  # rope width
    ((3, 1, L), (3, R), np.zeros(3, np.int32)),  # rank
    ((3, L), (3, R), np.zeros(3, np.float32)),  # non-integer slots
    ((3, L), (3, R), np.zeros((3, 1), np.int32)),  # slots not 1-D
], ids=str)
def test_ds_write_errors(kv_shape, pe_shape, slots):
  with pytest.raises(ValueError):
    DSMLACache.allocate(NB, BS).write(jnp.zeros(kv_shape), jnp.zeros(pe_shape), jnp.asarray(slots))


@pytest.mark.parametrize("k, slots", [
    (np.zeros((3, D), np.float32), np.zeros(2, np.int32)),
    (np.zeros((3, D + 1), np.float32), np.zeros(3, np.int32)),
    (np.zeros((3, D), np.int32), np.zeros(3, np.int32)),  # integer keys
    (np.zeros((3, D), np.float32), np.zeros(3, np.float32)),
], ids=["T", "width", "int_keys", "float_slots"])
def test_indexer_write_errors(k, slots):
  with pytest.raises(ValueError):
    IndexerKCache.allocate(NB, BS).write(jnp.asarray(k), jnp.asarray(slots))


def test_from_bytes_errors():
  with pytest.raises(ValueError):
    DSMLACache.from_vllm_bytes(jnp.zeros((NB, BS, ROW_BYTES - 1), jnp.uint8))
  with pytest.raises(ValueError):
    DSMLACache.from_vllm_bytes(jnp.zeros((NB, BS, ROW_BYTES), jnp.int8))
  with pytest.raises(ValueError):
    DSMLACache.from_vllm_bytes(jnp.zeros((NB * BS, ROW_BYTES), jnp.uint8))
  with pytest.raises(ValueError):
    IndexerKCache.from_vllm_bytes(jnp.zeros((NB, BS * (D + 4)), jnp.uint8))
  with pytest.raises(ValueError):
    IndexerKCache.from_vllm_bytes(jnp.zeros((NB, BS, 4), jnp.uint8))
