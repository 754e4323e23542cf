"""The Pallas decode kernels (Pallas-Triton and Mosaic GPU) at serving sizes on a GPU, against the
XLA reference run there.

Shapes too large for the numpy oracle: the reference (float32, HIGHEST precision) is the yardstick.
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from decode_contract import assert_decode_close, assert_e4m3_split_is_exact
from gpu_utils import poison_allocator
from mla_jax import reference
from mla_jax.backends import get_backend
from mla_jax.cache import LatentCache
from pallas_kernels import latent_decode, mosaic_decode
from pallas_kernels.common import BATCH_INVARIANT_SPLIT_TOKENS, RESCALE_SLACK

pytestmark = pytest.mark.gpu

def _pallas_default(q, kv_cache, tables, lens, *, k_scale=None, **kwargs):
  """The GPU default backend over `kv_cache` as a LatentCache: Mosaic from 16 heads (on Hopper),
  else Triton."""
  cache = LatentCache(kv_cache, jnp.float32(1.0 if k_scale is None else k_scale))
  return get_backend("pallas").decode(q, cache, tables, lens, kv_lora_rank=512, **kwargs)


KERNELS = {"pallas_triton": latent_decode.latent_decode,
           "pallas_mosaic": mosaic_decode.latent_decode,
           "pallas": _pallas_default}

L, PAGE = 512, 64
SCALE = 192 ** -0.5
FP8_SCALE = 0.05


def serving_case(seed, *, batch, max_len, n, cache_dtype):
  """Device-side inputs: each request owns max_len / PAGE blocks of a shuffled cache with 8 spare
  blocks; lengths are random in [0, max_len] (some 0); every slot no row may read is NaN."""
  keys = jax.random.split(jax.random.key(seed), 4)
  per_req = max_len // PAGE
  num_blocks = batch * per_req + 8
  perm = jax.random.permutation(keys[0], num_blocks).astype(jnp.int32)
  tables = perm[:batch * per_req].reshape(batch, per_req)
  lens = jax.random.randint(keys[1], (batch,), 0, max_len + 1, jnp.int32)
  lens = lens.at[::17].set(0).at[1].set(max_len)
  owner = jnp.argsort(perm)  # position of each block in the dealt order
  pos = (owner % per_req)[:, None] * PAGE + jnp.arange(PAGE)[None, :]
  used = ((owner[:, None] < batch * per_req)
          & (pos < lens[jnp.minimum(owner // per_req, batch - 1)][:, None]))
  values = jax.random.normal(keys[2], (num_blocks, PAGE, L + 64), jnp.float32) / 10
  fp8 = jnp.dtype(cache_dtype) == jnp.float8_e4m3fn
  cache = jnp.where(used[..., None], values / FP8_SCALE if fp8 else values,
                    jnp.nan).astype(cache_dtype)
  q = jax.random.normal(keys[3], (batch, n, L + 64), jnp.float32).astype(jnp.bfloat16)
  return q, cache, tables, lens


@pytest.mark.parametrize("seed,batch,max_len,n,cache_dtype,splits", [
    (0, 128, 32768, 16, jnp.bfloat16, None),
    (1, 128, 8192, 128, jnp.bfloat16, None),
    (2, 128, 8192, 128, jnp.float8_e4m3fn, None),
    (7, 128, 8192, 16, jnp.float8_e4m3fn, None),
    (3, 128, 32768, 16, jnp.float8_e4m3fn, 1),  # 2**31+ e4m3 values: past int32 byte offsets
    (4, 32, 4096, 16, jnp.bfloat16, 16),
    (6, 64, 8192, 20, jnp.bfloat16, None),  # heads that fill no tile size
])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_matches_reference(kernel, seed, batch, max_len, n, cache_dtype, splits):
  check_serving_case(seed, batch, max_len, n, cache_dtype,
                     functools.partial(KERNELS[kernel], num_kv_splits=splits))


def check_serving_case(seed, batch, max_len, n, cache_dtype, decode, q_scale=None, scale=SCALE):
  """decode(q, cache, tables, lens, scale=, k_scale=) on a serving-size case against the XLA
  reference, the output buffers poisoned first; q_scale [batch] multiplies each row's q."""
  q, cache, tables, lens = serving_case(seed, batch=batch, max_len=max_len, n=n,
                                        cache_dtype=cache_dtype)
  if q_scale is not None:
    q = (q * q_scale[:, None, None]).astype(q.dtype)
  k_scale = jnp.float32(FP8_SCALE) if jnp.dtype(cache_dtype) == jnp.float8_e4m3fn else None
  ref = jax.jit(reference.latent_decode, static_argnames=("scale", "kv_lora_rank"))
  ref_o, ref_lse = (np.asarray(a, np.float64) for a in
                    ref(q, cache, tables, lens, scale=scale, kv_lora_rank=L, k_scale=k_scale))
  poison_allocator()
  o, lse = decode(q, cache, tables, lens, scale=scale, k_scale=k_scale)
  assert o.dtype == q.dtype
  assert_decode_close(np.asarray(o.astype(jnp.float32)), np.asarray(lse), ref_o, ref_lse)


@pytest.mark.parametrize("seed,batch,max_len,n,splits", [
    (2, 128, 4096, 128, None),  # the timed shape (bench_decode --mosaic-configs)
    (7, 128, 8192, 16, None),
    (3, 128, 32768, 16, 1),  # 2**31+ e4m3 values
])
@pytest.mark.parametrize("pipeline", ["half_pages", "shared_widening"])
def test_fp8_half_pages_matches_reference(pipeline, seed, batch, max_len, n, splits):
  # The Mosaic kernel's half-page fp8 pipelines (two 32-row bf16 slots; "shared_widening" also
  # widens in warpgroup 1) at serving sizes.
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, fp8_pipeline=pipeline))


@pytest.mark.parametrize("seed,batch,max_len,n,cache_dtype,splits,pipeline", [
    (7, 128, 8192, 16, jnp.bfloat16, None, None),  # the timed shape (one split, one-wave rule)
    (8, 128, 8192, 32, jnp.bfloat16, 1, None),  # one split: the bf16 output stored transposed
    (4, 32, 4096, 20, jnp.bfloat16, 16, None),  # 20 heads padded to 32
    (7, 128, 8192, 16, jnp.float8_e4m3fn, None, "serial"),
    (7, 128, 8192, 16, jnp.float8_e4m3fn, None, "shared_widening"),
    (9, 32, 8192, 32, jnp.float8_e4m3fn, 1, "serial"),
    (9, 32, 8192, 32, jnp.float8_e4m3fn, 1, "shared_widening"),
    (3, 128, 32768, 16, jnp.float8_e4m3fn, 4, "shared_widening"),  # 2**31+ e4m3 values
])
def test_heads_n_matches_reference(seed, batch, max_len, n, cache_dtype, splits, pipeline):
  # The Mosaic kernel's heads_in="n" (heads as wgmma's N; fp8 through the "serial" pipeline or
  # 64-token "shared_widening") at serving sizes, every output form: bf16 transposed, float32
  # partials written [T, splits, L, N].
  check_serving_case(seed, batch, max_len, n, cache_dtype, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="n",
      **({"fp8_pipeline": pipeline} if pipeline else {})))


@pytest.mark.parametrize("seed,batch,max_len,n,splits,fixed", [
    (7, 128, 8192, 16, None, {}),  # the timed shape (one split): bf16 output stored transposed
    (8, 128, 8192, 32, None, {}),  # the default from session 14 at 32 heads, its timed shape
    (9, 32, 8192, 32, 4, {}),  # float32 partials
    (4, 32, 4096, 20, None, {"split_tokens": BATCH_INVARIANT_SPLIT_TOKENS}),  # padded to 32
    (3, 128, 32768, 16, 4, {}),  # 2**31+ e4m3 values
])
def test_register_a_matches_reference(seed, batch, max_len, n, splits, fixed):
  # fp8_pipeline="register_a": the e4m3 value tiles as wgmma's register A operands, whose layouts
  # only the GPU runs (the interpreter takes them through shared memory), and the default
  # e4m3_scores, whose fp8 wgmma accumulates in Hopper's reduced precision (576 columns in one).
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="n",
      fp8_pipeline="register_a", **fixed))


@pytest.mark.parametrize("seed,batch,max_len,n,splits,fixed,ring", [
    (7, 128, 8192, 16, None, {}, 5),  # the timed shapes (one split), rings of 5 and 4 at 16 heads
    (7, 128, 8192, 16, None, {}, 4),
    (8, 128, 8192, 32, None, {}, 4),
    (9, 32, 8192, 16, 4, {}, 5),  # float32 partials
    (4, 32, 4096, 20, None, {"split_tokens": BATCH_INVARIANT_SPLIT_TOKENS}, 4),  # padded to 32
])
def test_two_pages_matches_reference(seed, batch, max_len, n, splits, fixed, ring):
  # register_a's pages_per_step=2 (random lengths: odd and even page counts, NaN past them): what
  # only the GPU runs, warpgroup 1 releasing each page's ring slot once it has loaded the page's
  # value tiles (register A operands), before their products, and the products accumulating in
  # place over both pages.
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="n",
      fp8_pipeline="register_a", pages_per_step=2, ring_slots=ring, **fixed))


@pytest.mark.parametrize("seed,batch,max_len,n,splits,fixed", [
    (7, 128, 8192, 16, None, {}),  # the timed shape (one split): bf16 output stored transposed
    (8, 128, 8192, 32, None, {}),  # 32 heads, its timed shape
    (9, 32, 8192, 32, 4, {}),  # float32 partials
    (4, 32, 4096, 20, None, {"split_tokens": BATCH_INVARIANT_SPLIT_TOKENS}),  # padded to 32
])
def test_wide_keys_matches_reference(seed, batch, max_len, n, splits, fixed):
  # register_a's wide_keys (its f16 keys: e4m3_scores off): the key fragments from 16-byte loads
  # by lane-level code (its swizzled addresses and register order), which only the GPU runs,
  # against q permuted alike.
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="n",
      fp8_pipeline="register_a", wide_keys=True, **fixed))


@pytest.mark.parametrize("seed,batch,max_len,n,splits", [
    (7, 128, 8192, 16, None),  # the timed shapes (one split): bf16 output stored transposed
    (8, 128, 8192, 32, None),  # 8-byte loads in two passes at 32 heads
    (9, 32, 8192, 16, 4),  # float32 partials, put back before the merge
])
def test_wide_values_matches_reference(seed, batch, max_len, n, splits):
  # register_a's wide_values: V^T's fragments from wide loads by lane-level code (its swizzled
  # addresses, prmt selectors and register order), which only the GPU runs, and o's columns put
  # back after the call.
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="n",
      fp8_pipeline="register_a", wide_values=True))


@pytest.mark.parametrize("seed,batch,max_len,n,split_tokens", [
    (12, 128, 8192, 16, None), (13, 128, 8192, 32, None), (14, 32, 8192, 32, 2048)])
def test_wide_values_is_bit_identical(seed, batch, max_len, n, split_tokens):
  # Each O^T row (a value column) sums the same products in the same order with or without
  # wide_values: only the rows' order differs, and the call puts it back. With splits, only the
  # fixed-order merge (split_tokens) is elementwise: the default merge is an XLA reduction whose
  # add order follows the layout the put-back transpose gives it (H200, session 17: 5 of 524288
  # outputs 1 bf16 ulp apart at 4 splits).
  q, cache, tables, lens = serving_case(seed, batch=batch, max_len=max_len, n=n,
                                        cache_dtype=jnp.float8_e4m3fn)
  run = lambda wide: jax.device_get(mosaic_decode.latent_decode(
      q, cache, tables, lens, scale=SCALE, k_scale=jnp.float32(FP8_SCALE),
      split_tokens=split_tokens, fp8_pipeline="register_a", wide_values=wide))
  for a, b in zip(run(True), run(False)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed,batch,max_len,n,knobs", [
    (15, 128, 8192, 128, {"fp8_pipeline": "shared_widening"}),  # the timed shape (one split)
    (16, 128, 8192, 128, {"fp8_pipeline": "half_pages"}),  # the default there
    (17, 128, 8192, 128, {"fp8_pipeline": "serial"}),
    (18, 32, 8192, 128, {"fp8_pipeline": "shared_widening", "num_kv_splits": 4}),
    (19, 128, 8192, 16, {"fp8_pipeline": "shared_widening", "heads_in": "n"}),
])
def test_wide_widening_is_bit_identical(seed, batch, max_len, n, knobs):
  # The lane-level widening (16-byte loads, bit placement, 16-byte stores into the swizzled bf16
  # slots; only the GPU runs it) writes the slots' bits as the Pallas-level one does: e4m3
  # values are exact in bf16, rows past a step's length (NaN bytes here) +0 in both.
  q, cache, tables, lens = serving_case(seed, batch=batch, max_len=max_len, n=n,
                                        cache_dtype=jnp.float8_e4m3fn)
  run = lambda wide: jax.device_get(mosaic_decode.latent_decode(
      q, cache, tables, lens, scale=SCALE, k_scale=jnp.float32(FP8_SCALE), wide_widening=wide,
      **knobs))
  for a, b in zip(run(True), run(False)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed,batch,max_len,n,splits", [
    (20, 128, 8192, 128, None),  # the timed shape (one split)
    (21, 32, 8192, 128, 4),
    (22, 128, 32768, 16, 1),  # 2**31+ e4m3 values (heads in M)
])
def test_in_slot_is_bit_identical_to_serial(seed, batch, max_len, n, splits):
  # fp8_pipeline="in_slot" widens each page in place inside the bf16 slot it landed in (lane-level
  # code whose stores overwrite the page's own bytes); "serial" widens the same pages from a stage
  # of their own into one slot. The consumers run the same 64-token steps, so the outputs are the
  # same bits unless the in-place widening reads a byte after it was overwritten.
  q, cache, tables, lens = serving_case(seed, batch=batch, max_len=max_len, n=n,
                                        cache_dtype=jnp.float8_e4m3fn)
  poison_allocator()
  run = lambda pipeline: jax.device_get(mosaic_decode.latent_decode(
      q, cache, tables, lens, scale=SCALE, k_scale=jnp.float32(FP8_SCALE), heads_in="m",
      num_kv_splits=splits, fp8_pipeline=pipeline))
  for a, b in zip(run("in_slot"), run("serial")):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_in_slot_matches_reference():
  check_serving_case(2, 128, 8192, 128, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, fp8_pipeline="in_slot"))


@pytest.mark.parametrize("seed,batch,max_len,n,splits", [
    (2, 128, 8192, 128, None),  # the timed shape
    (3, 128, 32768, 16, 1),  # 2**31+ e4m3 values (heads in M: half pages)
])
def test_wide_widening_matches_reference(seed, batch, max_len, n, splits):
  # wide_widening with "shared_widening" (the default is half_pages, whose Pallas-level form has
  # its own reference tests and the bit-identity above) at serving sizes.
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="m",
      fp8_pipeline="shared_widening", wide_widening=True))


def test_wide_keys_queries_past_f16_range():
  # The f16 queries scaled by powers of two, then permuted.
  q_scale = jnp.where(jnp.arange(32) % 3 == 0, 2.0 ** 15, 1.0)
  check_serving_case(11, 32, 4096, 16, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, heads_in="n", fp8_pipeline="register_a", wide_keys=True),
      q_scale=q_scale)


def test_register_a_f16_queries_past_f16_range():
  # register_a's f16 queries (e4m3_scores=False): rows past f16's 65504 run scaled by a power of
  # two, scaled back in the kernel's score scale. Their logits are ~2**15 times the others', so
  # nearly one-hot: products and sums in float32 keep them within SPEC's tolerance; e4m3_scores'
  # fp8 accumulation does not (cosine difference 9.4e-5 at 192-column promotion, H200, session
  # 19: its logits carry ~2**-14 of their magnitude in error; see MosaicDecodeConfig).
  q_scale = jnp.where(jnp.arange(32) % 3 == 0, 2.0 ** 15, 1.0)
  check_serving_case(11, 32, 4096, 16, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, heads_in="n", fp8_pipeline="register_a", e4m3_scores=False),
      q_scale=q_scale)


@pytest.mark.parametrize("power", [15, -20])
def test_register_a_queries_far_from_e4m3_range(power):
  # The e4m3 query parts of register_a (the fp8 default at 16 and 32 heads): every row's q scaled
  # by 2**power (past f16's range, or far below e4m3's smallest subnormal), the softmax scale by
  # 2**-power, so the logits are the unscaled case's and only the queries' range differs.
  q_scale = jnp.full((32,), 2.0 ** power)
  check_serving_case(11, 32, 4096, 16, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, heads_in="n", fp8_pipeline="register_a"), q_scale=q_scale,
      scale=SCALE * 2.0 ** -power)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_one_split_is_batch_independent(kernel):
  q, cache, tables, lens = serving_case(5, batch=128, max_len=4096, n=16, cache_dtype=jnp.bfloat16)
  run = lambda *a: jax.device_get(KERNELS[kernel](*a, scale=SCALE, num_kv_splits=1))
  poison_allocator()
  full = run(q, cache, tables, lens)
  rev = run(q[::-1], cache, tables[::-1], lens[::-1])
  few = run(q[3:8], cache, tables[3:8], lens[3:8])
  for a, b, c in zip(full, rev, few):
    np.testing.assert_array_equal(a, b[::-1])
    np.testing.assert_array_equal(a[3:8], c)


@pytest.mark.parametrize("n,cache_dtype", [(16, jnp.bfloat16), (128, jnp.bfloat16),
                                           (128, jnp.float8_e4m3fn)])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_batch_invariant_is_bit_exact(kernel, n, cache_dtype):
  # Row 1 (8192 tokens: 4 splits of 2048) alone, in the batch of 128, in 5 rows reversed, and in 7
  # rows with a table 64 pages wider: the same bits; and the batch within SPEC tolerances.
  q, cache, tables, lens = serving_case(7, batch=128, max_len=8192, n=n, cache_dtype=cache_dtype)
  k_scale = jnp.float32(FP8_SCALE) if jnp.dtype(cache_dtype) == jnp.float8_e4m3fn else None
  mode = ({"batch_invariant": True} if kernel == "pallas" else
          {"split_tokens": BATCH_INVARIANT_SPLIT_TOKENS})
  run = lambda *a: jax.device_get(KERNELS[kernel](*a, scale=SCALE, k_scale=k_scale, **mode))
  poison_allocator()
  full = run(q, cache, tables, lens)
  alone = run(q[1:2], cache, tables[1:2], lens[1:2])
  few = run(q[5::-1], cache, tables[5::-1], lens[5::-1])
  wide = run(q[:7], cache, jnp.pad(tables[:7], ((0, 0), (0, 64)), constant_values=-1), lens[:7])
  for i, out in ((1, full), (0, alone), (4, few), (1, wide)):
    for a, b in zip(out, alone):
      np.testing.assert_array_equal(a[i], b[0])
  ref = jax.jit(reference.latent_decode, static_argnames=("scale", "kv_lora_rank"))
  ref_o, ref_lse = (np.asarray(a, np.float64) for a in
                    ref(q, cache, tables, lens, scale=SCALE, kv_lora_rank=L, k_scale=k_scale))
  assert_decode_close(np.asarray(full[0].astype(jnp.float32)), np.asarray(full[1]), ref_o, ref_lse)


@pytest.mark.parametrize("seed,batch,max_len,n,splits", [
    (7, 128, 8192, 16, None),  # the timed shapes (one split)
    (10, 128, 8192, 32, 4),  # float32 partials
])
@pytest.mark.parametrize("cols", [64, 128, 576], ids=lambda c: f"cols{c}")
def test_e4m3_promote_cols_match_reference(seed, batch, max_len, n, splits, cols):
  # e4m3_scores' other promotion chunks (the default, 192: the register_a tests; 576 is one
  # accumulation), each chunk's accumulator summed in float32; NaN bytes in unused pages.
  check_serving_case(seed, batch, max_len, n, jnp.float8_e4m3fn, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, heads_in="n",
      fp8_pipeline="register_a", e4m3_promote_cols=cols))


def test_e4m3_split_is_exact_on_gpu():
  # XLA's GPU compiler folded hi's f32 -> e4m3 -> f32 round trip (lo was 0) until a barrier kept it.
  assert_e4m3_split_is_exact()


@pytest.mark.parametrize("seed,batch,max_len,cache_dtype,knobs", [
    (30, 128, 8192, jnp.bfloat16, {}),  # the timed shape (one split)
    (31, 32, 8192, jnp.bfloat16, {"num_kv_splits": 4}),
    (32, 128, 8192, jnp.float8_e4m3fn, {"fp8_pipeline": "half_pages"}),
    (33, 128, 8192, jnp.float8_e4m3fn, {"fp8_pipeline": "in_slot"}),
])
def test_rescale_slack_zero_is_bit_identical_to_default(seed, batch, max_len, cache_dtype, knobs):
  # rescale_slack=0 keeps the exact running max, so the lane-level skip
  # (`mosaic_lanes.rows_rescaled`) leaves a warp's registers as they are only where all its alpha
  # are 1 (x * 1 == x) and multiplies them otherwise: the same bits as the default, which
  # multiplies every step. Early steps move many rows' maxima and later ones few, so both of the
  # branch's sides run, in different warps of one step.
  q, cache, tables, lens = serving_case(seed, batch=batch, max_len=max_len, n=128,
                                        cache_dtype=cache_dtype)
  k_scale = jnp.float32(FP8_SCALE) if cache_dtype == jnp.float8_e4m3fn else None
  poison_allocator()
  run = lambda slack: jax.device_get(mosaic_decode.latent_decode(
      q, cache, tables, lens, scale=SCALE, k_scale=k_scale, rescale_slack=slack, **knobs))
  for a, b in zip(run(0.0), run(None)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_rescale_slack_matches_reference(cache_dtype):
  # Every third row's q times 6: scores spread ~6x wider, so maxima also move past the slack
  # after the first step (both sides of the skip with running sums in the registers).
  q_scale = jnp.where(jnp.arange(128) % 3 == 0, 6.0, 1.0)
  check_serving_case(34, 128, 8192, 128, cache_dtype, functools.partial(
      mosaic_decode.latent_decode, rescale_slack=RESCALE_SLACK), q_scale=q_scale)


@pytest.mark.parametrize("seed,batch,max_len,n,splits", [
    (44, 128, 8192, 128, None),  # the timed shape: heads in M
    (45, 32, 8192, 128, 4),
    (46, 128, 8192, 16, None),  # heads in N
    (47, 16, 32768, 64, 1),  # long rows
])
def test_auto_barriers_matches_reference(seed, batch, max_len, n, splits):
  # auto_barriers=True, Pallas's barrier around every shared-memory store and before bulk copies
  # (the default, False, runs without them in every other test); serving_case's ragged lengths
  # give partial last pages and empty rows.
  check_serving_case(seed, batch, max_len, n, jnp.bfloat16, functools.partial(
      mosaic_decode.latent_decode, num_kv_splits=splits, auto_barriers=True))
