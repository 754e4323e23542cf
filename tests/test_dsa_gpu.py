"""The Pallas DSA kernels at V3.2 sizes on a GPU (Triton; Mosaic GPU sparse attention), against the
XLA reference run there.

Sparse attention (T=128, top-k 2048 over a 32K-token cache, 1M tokens for the Mosaic kernel's
named heads_in; T=4096 for its default fp8_ds_mla pipeline there), indexer logits (128 rows over 32K
context) and top-k (128 x 32768, k=2048). Cache rows and pages that nothing may read hold NaN, and
the allocator is poisoned before every kernel call, so a stray read or an unwritten output shows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_utils import poison_allocator
from mla_jax import backends, reference
from mla_jax.cache import DSMLACache, IndexerKCache, LatentCache, positions_to_slots
from mla_jax.quant import dequantize, quantize_fp8, quantize_indexer_q
from pallas_kernels import mosaic_indexer, mosaic_sparse
from pallas_kernels import topk as pallas_topk
from pallas_kernels.common import RESCALE_SLACK
from sparse_contract import cosine_diff, lowest_index_topk

pytestmark = pytest.mark.gpu

L, R, PAGE, TOPK = 512, 64, 64, 2048
SCALE = 192 ** -0.5
CACHE_TOKENS = 32768


def selected_slots(seed, t, tokens=CACHE_TOKENS):
  """[t, TOPK] int32: distinct slots of the first 3/4 of the cache per row (the last quarter is
  never selected), ~10% -1 and a few past the cache; row 0 selects nothing, row 1 a single slot."""
  rng = np.random.default_rng(seed)
  live = 3 * tokens // 4
  slots = np.stack([rng.permutation(live)[:TOPK] for _ in range(t)]).astype(np.int32)
  drop = rng.random(slots.shape)
  slots[drop < 0.1] = -1
  slots[drop > 0.995] = tokens + 5
  slots[0] = -1
  slots[1, 1:] = -1
  return slots


def unselected(slots, tokens=CACHE_TOKENS):
  rows = np.ones(tokens, bool)
  rows[slots[(slots >= 0) & (slots < tokens)]] = False
  return jnp.asarray(rows.reshape(tokens // PAGE, PAGE))


def sparse_case(seed, n, kind, t=128, tokens=CACHE_TOKENS):
  keys = jax.random.split(jax.random.key(seed), 3)
  slots = selected_slots(seed, t, tokens)
  poison = unselected(slots, tokens)[..., None]
  nb = tokens // PAGE
  kv = jax.random.normal(keys[0], (nb, PAGE, L + R), jnp.float32) / 10
  if kind in ("bf16", "fp8"):  # fp8: e4m3 of x / 0.05, one per-tensor scale
    scale = 0.05 if kind == "fp8" else 1.0
    dtype = jnp.float8_e4m3fn if kind == "fp8" else jnp.bfloat16
    cache = LatentCache(jnp.where(poison, jnp.nan, kv / scale).astype(dtype), jnp.float32(scale))
  else:
    flat = kv.reshape(-1, L + R)
    c = DSMLACache.allocate(nb, PAGE, L, R).write(flat[:, :L], flat[:, L:],
                                                    jnp.arange(tokens, dtype=jnp.int32))
    cache = DSMLACache(jnp.where(poison, jnp.nan, c.nope.astype(jnp.float32)).astype(c.nope.dtype),
                       jnp.where(poison, jnp.nan, c.tile_scales),
                       jnp.where(poison, jnp.nan, c.rope.astype(jnp.float32)).astype(jnp.bfloat16))
  q = jax.random.normal(keys[1], (t, n, L + R), jnp.float32).astype(jnp.bfloat16)
  return q, cache, jnp.asarray(slots)


@pytest.mark.parametrize("n", [128, 16])
@pytest.mark.parametrize("kind,backend", [
    ("bf16", "pallas_triton"), ("fp8", "pallas_triton"), ("fp8_ds_mla", "pallas_triton"),
    ("bf16", "pallas_mosaic"), ("fp8_ds_mla", "pallas_mosaic")])
def test_sparse_attention_matches_reference(n, kind, backend):
  check_sparse_attention(n, kind, backends.get_backend(backend).sparse_attention)


# The Mosaic kernel's fp8_ds_mla pipelines (MosaicSparseConfig.fp8_pipeline) besides the one the
# backend cases run at 128 tokens (the default's "half_rows": two 32-row bf16 slots, a ring of 2
# 32-row staging buffers): "serial" (one 64-row slot), "half_rows" with 3 staging buffers, and
# "in_place" (two 64-row slots, each step staged and widened inside its own; the default where
# many one-split programs run).
@pytest.mark.parametrize("n", [128, 16])
@pytest.mark.parametrize("fp8_pipeline,halves", [("serial", 2), ("half_rows", 3), ("in_place", 2)])
def test_mosaic_sparse_fp8_pipeline_matches_reference(n, fp8_pipeline, halves):
  def run(q, cache, slots, *, scale, kv_lora_rank):
    assert kv_lora_rank == cache.kv_lora_rank
    return mosaic_sparse.sparse_attention_fp8_ds_mla(q, cache.nope, cache.tile_scales, cache.rope,
                                                     slots, scale=scale, fp8_pipeline=fp8_pipeline,
                                                     fp8_stage_halves=halves)
  check_sparse_attention(n, "fp8_ds_mla", run)


# "in_place" widens the values "serial" widens, and its consumers run serial's 64-slot products in
# the same order: equal bits, which checks what the interpreter cannot (it neither aliases the
# staging views onto the row slots nor swizzles): the in-place overwrites and their barriers.
@pytest.mark.parametrize("n", [128, 16])
def test_mosaic_sparse_in_place_equals_serial_bit_for_bit(n):
  q, cache, slots = sparse_case(n + 1, n, "fp8_ds_mla")
  run = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, q, cache.nope,
                          cache.tile_scales, cache.rope, slots, scale=SCALE)
  poison_allocator()
  want = [np.asarray(a, np.float32) for a in run(fp8_pipeline="serial")]
  poison_allocator()
  got = [np.asarray(a, np.float32) for a in run(fp8_pipeline="in_place")]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# hand_over_first moves only when the memory warpgroup signals a bf16 step's rows (before it waits
# for the next slot, not after issuing its gather): the same products in the same order, equal
# bits. At T=128 (rows from HBM) and 4096 (from L2), the two shapes it is timed at.
@pytest.mark.parametrize("t", [128, 4096])
def test_mosaic_sparse_hand_over_first_equals_default_bit_for_bit(t):
  q, cache, slots = sparse_case(t + 5, 128, "bf16", t=t, tokens=CACHE_TOKENS if t <= 128
                                else 32768)
  run = functools.partial(mosaic_sparse.sparse_attention, q, cache.data, slots, scale=SCALE,
                          kv_lora_rank=L)
  poison_allocator()
  want = [np.asarray(a, np.float32) for a in run()]
  poison_allocator()
  got = [np.asarray(a, np.float32) for a in run(hand_over_first=False)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# rescale_slack=0 keeps the exact running max, so the consumers' lane-level skip of the rescale
# (`mosaic_lanes.rows_rescaled`) leaves a warp's registers only where its alpha are all 1 (x * 1
# == x) and multiplies them elsewhere: the default's bits. bf16 at T=128 and 4096, fp8_ds_mla's
# heads-in-M pipelines at T=128, 128 heads; one split too, so a program runs 32 steps (maxima
# move often early, seldom late: both sides of the branch).
@pytest.mark.parametrize("kind,t,knobs", [
    ("bf16", 128, {}), ("bf16", 128, {"num_splits": 1}), ("bf16", 4096, {}),
    ("fp8_ds_mla", 128, {"fp8_pipeline": "in_place"}),
    ("fp8_ds_mla", 128, {"fp8_pipeline": "half_rows", "num_splits": 1})])
def test_mosaic_sparse_rescale_slack_zero_equals_default_bit_for_bit(kind, t, knobs):
  q, cache, slots = sparse_case(t + 7, 128, kind, t=t, tokens=CACHE_TOKENS if t <= 128
                                else 32768)
  if kind == "bf16":
    run = functools.partial(mosaic_sparse.sparse_attention, q, cache.data, slots, scale=SCALE,
                            kv_lora_rank=L, **knobs)
  else:
    run = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, q, cache.nope,
                            cache.tile_scales, cache.rope, slots, scale=SCALE, **knobs)
  poison_allocator()
  want = [np.asarray(a, np.float32) for a in run(rescale_slack=None)]
  poison_allocator()
  got = [np.asarray(a, np.float32) for a in run(rescale_slack=0.0)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("kind", ["bf16", "fp8_ds_mla"])
def test_mosaic_sparse_rescale_slack_matches_reference(kind):
  def run(q, cache, slots, *, scale, kv_lora_rank):
    if kind == "bf16":
      return mosaic_sparse.sparse_attention(q, cache.data, slots, scale=scale,
                                            kv_lora_rank=kv_lora_rank, rescale_slack=RESCALE_SLACK)
    return mosaic_sparse.sparse_attention_fp8_ds_mla(q, cache.nope, cache.tile_scales, cache.rope,
                                                     slots, scale=scale, fp8_pipeline="in_place",
                                                     rescale_slack=RESCALE_SLACK)
  check_sparse_attention(128, kind, run)


# wide_widening (the default: lane-level widening by bit placement, `mosaic_sparse._wide_widen`,
# and with "in_place" `_wide_widen_in_place`) widens the values the Pallas-level widening does,
# bit for bit, and the consumers run the same products: equal outputs, which checks what the
# interpreter cannot (it runs the Pallas-level form): the 16-byte loads and stores over both
# swizzles, the bit placement, the bf16x2 multiply (e4m3 subnormals included), and "in_place"'s
# stores over the staged rows and scales other lanes read (its barriers). "mixed": the
# quantizer's per-tile scales (2^-11 to 2^-9 here) times 1, 2^18 (above 2^7: today's conversion
# in the lane code), 1/3 (not a bf16: the same) and 1.5 (a bf16: the bit placement), so both of
# the lane code's paths run, in the same warp.
@pytest.mark.parametrize("n", [128, 16])
@pytest.mark.parametrize("fp8_pipeline", ["half_rows", "serial", "in_place"])
@pytest.mark.parametrize("scales", ["quantizer", "mixed"])
def test_mosaic_sparse_wide_widening_equals_pallas_widening_bit_for_bit(n, fp8_pipeline, scales):
  q, cache, slots = sparse_case(n + 3, n, "fp8_ds_mla")
  tile_scales = cache.tile_scales
  if scales == "mixed":
    factors = jnp.asarray([1.0, 2.0 ** 18, 1 / 3, 1.5], jnp.float32)
    rows = jnp.arange(tile_scales.shape[1])[:, None]
    tile_scales = tile_scales * factors[(rows + jnp.arange(4)) % 4]
  run = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, q, cache.nope, tile_scales,
                          cache.rope, slots, scale=SCALE, fp8_pipeline=fp8_pipeline)
  poison_allocator()
  want = [np.asarray(a, np.float32) for a in run(wide_widening=False)]
  poison_allocator()
  got = [np.asarray(a, np.float32) for a in run(wide_widening=True)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# landing_groups: "in_place"'s step landing in 1, 2 (the default) or 4 cp.async groups, widened
# group by group while the later ones land (`_wide_widen_in_place`'s waits and barriers), and
# gather_by="values" (warpgroup 1 gathers, the lane barriers; the default up to 256 rows): the
# same values as the memory warpgroup's gather in 2 groups, bit for bit, with the scales in the
# rows' copies (prep in the kernel, T <= 256) or XLA's.
@pytest.mark.parametrize("n,t", [(128, 131), (16, 19), (128, 300)])
@pytest.mark.parametrize("knobs", [dict(landing_groups=1), dict(landing_groups=4),
                                   dict(gather_by="values"),
                                   dict(gather_by="values", wide_widening=False)],
                         ids=["landing1", "landing4", "values", "values_pallas_widening"])
def test_mosaic_sparse_in_place_knobs_equal_the_default_bit_for_bit(n, t, knobs):
  q, cache, slots = sparse_case(t + n, n, "fp8_ds_mla", t=t)
  run = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, q, cache.nope,
                          cache.tile_scales, cache.rope, slots, scale=SCALE,
                          fp8_pipeline="in_place")
  poison_allocator()
  want = [np.asarray(a, np.float32) for a in run(gather_by="memory")]
  poison_allocator()
  got = [np.asarray(a, np.float32) for a in run(**{"gather_by": "memory", **knobs})]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# heads_in="n" (RESULTS, sparse v12): N <= 32 heads in wgmma's N (S^T = K Q^T, P^T stored
# transposed, O^T = V^T P^T stored transposed) against the reference at the timed shape: 2048 slots
# a token over a 1M-token cache (NaN in every unselected row). bf16: 16 and 32 heads (the tiles),
# 27 (padded to 32); fp8_ds_mla with the two pipelines that take it. What the interpreter cannot
# check: the swizzled transposed stores of P^T and O^T, the MN-major V^T operand, the cross-warp
# reductions (and "in_place"'s aliases behind a query tile of 16 or 32 heads). bf16 runs "n" by
# default up to 32 heads (`default_heads_in`), so the pallas_mosaic case at 16 heads above does too.
def named_heads_in(q, cache, slots, *, scale, kv_lora_rank, heads_in, fp8_pipeline=None):
  if isinstance(cache, DSMLACache):
    return mosaic_sparse.sparse_attention_fp8_ds_mla(q, cache.nope, cache.tile_scales, cache.rope,
                                                     slots, scale=scale, fp8_pipeline=fp8_pipeline,
                                                     heads_in=heads_in)
  return mosaic_sparse.sparse_attention(q, cache.data, slots, scale=scale,
                                        kv_lora_rank=kv_lora_rank, heads_in=heads_in)


heads_in_n = functools.partial(named_heads_in, heads_in="n")


@pytest.mark.parametrize("n", [16, 32, 27])
def test_mosaic_sparse_heads_in_n_bf16_matches_reference(n):
  check_sparse_attention(n, "bf16", heads_in_n, tokens=1 << 20)


@pytest.mark.parametrize("n", [16, 32])
@pytest.mark.parametrize("fp8_pipeline", ["serial", "in_place"])
def test_mosaic_sparse_heads_in_n_fp8_ds_mla_matches_reference(n, fp8_pipeline):
  check_sparse_attention(n, "fp8_ds_mla",
                         functools.partial(heads_in_n, fp8_pipeline=fp8_pipeline), tokens=1 << 20)


# fp8_pipeline="register_a" (`mosaic_sparse_register_a`): S^T by fp8 wgmma from the gathered e4m3
# rows (q split into exact e4m3 parts), V^T converted and scaled in registers. Against the
# reference at the contract's tolerance, and against "in_place" (exact bf16 widening, the same
# slots) at SPEC's cosine for bf16 caches: its products differ only by the fp8 accumulation and P
# in f16.
@pytest.mark.parametrize("n", [16, 32])
def test_mosaic_sparse_register_a_matches_reference(n):
  register_a = functools.partial(named_heads_in, heads_in=None, fp8_pipeline="register_a")
  check_sparse_attention(n, "fp8_ds_mla", register_a, tokens=1 << 20)
  q, cache, slots = sparse_case(n + 3, n, "fp8_ds_mla", tokens=1 << 20)
  poison_allocator()
  o, lse = (np.asarray(a, np.float64) for a in register_a(q, cache, slots, scale=SCALE,
                                                          kv_lora_rank=L))
  want_o, want_lse = (np.asarray(a, np.float64) for a in heads_in_n(
      q, cache, slots, scale=SCALE, kv_lora_rank=L, fp8_pipeline="in_place"))
  seen = np.isfinite(want_lse)
  assert cosine_diff(o, want_o) < 1e-5 and cosine_diff(lse[seen], want_lse[seen]) < 1e-5


# heads_in="m" named where the bf16 default runs "n": 64-head tiles that copy in and store only the
# N query rows (16 and 32 heads, multiples of 8), at the same shape.
@pytest.mark.parametrize("n", [16, 32])
def test_mosaic_sparse_heads_in_m_bf16_matches_reference(n):
  check_sparse_attention(n, "bf16", functools.partial(named_heads_in, heads_in="m"), tokens=1 << 20)


# fp8_pipeline=None, the default, picks "in_place" where many one-split programs run: 4096 tokens
# (8192 programs at 128 heads; RESULTS v11), rows picked from the 32K-token cache as in
# bench_sparse's prefill chunk; at 128 tokens it picks "half_rows", which the pallas_mosaic
# fp8_ds_mla cases above check against the reference. At 4096 tokens: bit for bit against
# "serial" (as the in_place case above), which its reference case checks.
def test_mosaic_sparse_default_fp8_pipeline_at_4096_tokens_equals_serial_bit_for_bit():
  pick = functools.partial(mosaic_sparse.default_fp8_pipeline, num_splits=None,
                           split_rule=mosaic_sparse.CONFIG.split_rule,
                           gather=mosaic_sparse.CONFIG.gather)
  assert (pick(4096, 128, TOPK), pick(1, 16, TOPK)) == ("in_place", "half_rows")
  q, cache, slots = sparse_case(4096, 128, "fp8_ds_mla", t=4096)
  run = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, q, cache.nope,
                          cache.tile_scales, cache.rope, slots, scale=SCALE)
  poison_allocator()
  want = [np.asarray(a, np.float32) for a in run(fp8_pipeline="serial")]
  poison_allocator()
  got = [np.asarray(a, np.float32) for a in run()]
  assert not np.isnan(got[0]).any() and np.isneginf(got[1][0]).all()  # row 0 selects nothing
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


# prep_in_kernel (RESULTS, sparse v13, v14): the kernel takes the raw slots (-1 and past-the-cache
# slots: the cp.async gather's unsigned compare and the bulk copy's signed coordinates read nothing
# there, the scores mask them) and each warpgroup counts the steps up to its row's last valid slot
# (every warp reads the row from GMEM: the inline count the interpreter does not run). At one split
# (T=128) it equals the default (o bit for bit), whose count XLA takes: checked with rows 2 and 3
# ending early (-1 and past-the-cache tails), row 4 valid only within slots 700 to 719 (10 leading
# steps all -1: a count of the leading valid run would give 0), row 5 with 256 valid slots (the
# short rows v13 walked in full), beside rows 0 (nothing) and 1 (one slot); then again over the
# first 960 slots (15 steps: the count's last load group is half a row's lanes); and against the
# reference. Both gathers for bf16; fp8_ds_mla's two pipelines, whose memory warpgroup also gathers
# the rows' tile scales (4-byte cp.async copies in the rows' group, zeros for invalid slots) where
# the default copies XLA's gathered blocks: the widened bits equal.
@pytest.mark.parametrize("n,kind,options", [
    (128, "bf16", {}), (16, "bf16", {}), (128, "bf16", {"gather": "bulk"}),
    (128, "fp8_ds_mla", {"fp8_pipeline": "half_rows"}),
    (16, "fp8_ds_mla", {"fp8_pipeline": "half_rows"}),
    (128, "fp8_ds_mla", {"fp8_pipeline": "in_place"})])
def test_mosaic_sparse_prep_in_kernel_matches_reference_and_the_default(n, kind, options):
  def run(q, cache, slots, *, scale, kv_lora_rank, prep_in_kernel=True):
    if isinstance(cache, DSMLACache):
      return mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, cache.nope, cache.tile_scales, cache.rope, slots, scale=scale,
          prep_in_kernel=prep_in_kernel, **options)
    return mosaic_sparse.sparse_attention(q, cache.data, slots, scale=scale,
                                          kv_lora_rank=kv_lora_rank,
                                          prep_in_kernel=prep_in_kernel, **options)

  check_sparse_attention(n, kind, run)
  q, cache, slots = sparse_case(n + 3, n, kind)
  slots = slots.at[2, 1000:].set(-1).at[3, 5 * 64 + 3:].set(CACHE_TOKENS + 5)
  slots = slots.at[4, :700].set(-1).at[4, 720:].set(-1).at[5, 256:].set(-1)
  for k in (TOPK, 960):
    results = []
    for prep in (False, True):
      poison_allocator()
      results.append([np.asarray(a, np.float32)
                      for a in run(q, cache, slots[:, :k], scale=SCALE, kv_lora_rank=L,
                                   prep_in_kernel=prep)])
    (o, lse), (want_o, want_lse) = results[1], results[0]
    assert np.isfinite(lse[4]).all()  # row 4 selects some of its slots 700 to 719
    np.testing.assert_array_equal(o, want_o)
    # v13's static trip count compiled the log-sum-exp's epilogue differently from the default's
    # dynamic one: 1 ulp apart in ~25% of entries on the H200 (session 12), o equal.
    np.testing.assert_allclose(lse, want_lse, rtol=2 * np.finfo(np.float32).eps, atol=0)


def check_sparse_attention(n, kind, sparse_attention, tokens=CACHE_TOKENS):
  """sparse_attention (the backend contract's signature) against the XLA reference on the GPU."""
  q, cache, slots = sparse_case(n + len(kind), n, kind, tokens=tokens)
  ref = jax.jit(backends.REFERENCE.sparse_attention, static_argnames=("scale", "kv_lora_rank"))
  ref_o, ref_lse = (np.asarray(a, np.float64)
                    for a in ref(q, cache, slots, scale=SCALE, kv_lora_rank=L))
  poison_allocator()
  o, lse = sparse_attention(q, cache, slots, scale=SCALE, kv_lora_rank=L)
  assert o.dtype == q.dtype and lse.dtype == jnp.float32
  o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
  assert not np.isnan(o).any() and not np.isnan(lse).any(), (
      "NaN in the outputs (unwritten or leaked)")
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  assert np.isneginf(lse[0]).all() and (o[0] == 0).all()  # the row that selects nothing
  seen = np.isfinite(ref_lse)
  if kind != "fp8_ds_mla":  # SPEC 8, sparse: cosine < 1e-5, then per element abs 1e-3 or rel 2/128
    assert cosine_diff(o, ref_o) < 1e-5 and cosine_diff(lse[seen], ref_lse[seen]) < 1e-5
    for got, want in ((o, ref_o), (lse[seen], ref_lse[seen])):
      err = np.abs(got - want)
      bad = (err > 1e-3) & (err > 2 / 128 * np.abs(want))
      assert not bad.any(), f"{bad.sum()} elements off; worst abs error {err.max():.3g}"
  else:  # vLLM's fp8 backend test, against the reference on the same DSMLACache
    np.testing.assert_allclose(o, ref_o, rtol=0.065, atol=0.05)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=0.065, atol=0.05)


def indexer_case(requests, per_req):
  """128 rows over 32K-token contexts, unreadable keys NaN: the kernels' arguments (k as values
  and scales) and the jitted reference's logits."""
  h, d = 64, 128
  rng = np.random.default_rng(0)
  pages = CACHE_TOKENS // PAGE
  nb = requests * pages + 8
  perm = rng.permutation(nb).astype(np.int32)
  tables = perm[:requests * pages].reshape(requests, pages)
  req_lens = rng.integers(1, CACHE_TOKENS + 1, requests)
  req_lens[0], req_lens[1] = CACHE_TOKENS, 1
  # Table entries past a request's pages: -1 or a spare (NaN) page, neither inside the window.
  for r, n_tok in enumerate(req_lens):
    used = -(-n_tok // PAGE)
    tables[r, used:] = np.where(rng.random(pages - used) < 0.5, -1, perm[-1])
  row_tables = np.repeat(tables, per_req, axis=0)
  lens = np.concatenate([np.maximum(n - per_req + 1 + np.arange(per_req), 0) for n in req_lens])
  lens[min(5, len(lens) - 1)] = 0
  visible = np.zeros((nb, PAGE), bool)
  for r, n_tok in enumerate(req_lens):
    for p in range(-(-n_tok // PAGE)):
      visible[tables[r, p], :min(PAGE, n_tok - p * PAGE)] = True
  keys = jax.random.split(jax.random.key(1), 3)
  k = jax.random.normal(keys[0], (nb * PAGE, d), jnp.float32)
  k_cache = IndexerKCache.allocate(nb, PAGE, d).write(k, jnp.arange(nb * PAGE, dtype=jnp.int32))
  visible = jnp.asarray(visible)
  k_values = jnp.where(visible[..., None], k_cache.values.astype(jnp.float32), jnp.nan)
  k_values = k_values.astype(jnp.float8_e4m3fn)
  k_scales = jnp.where(visible, k_cache.scales, jnp.nan)
  q, q_scale = quantize_indexer_q(
      jax.random.normal(keys[1], (requests * per_req, h, d), jnp.float32))
  weights = (jax.random.normal(keys[2], (requests * per_req, h), jnp.float32) * q_scale
             / (h * d) ** 0.5)
  args = (q, weights, k_values, k_scales, jnp.asarray(row_tables), jnp.asarray(lens, jnp.int32))
  return args, np.asarray(jax.jit(reference.indexer_logits)(*args))


def assert_indexer_logits_close(got, want):
  """SPEC 8: -inf pattern exact, cosine difference < 1e-3 over all and per row."""
  got = np.asarray(got)
  assert not np.isnan(got).any()
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  fin = np.isfinite(want)
  assert cosine_diff(got[fin], want[fin]) < 1e-3
  for i in np.flatnonzero(fin.any(axis=1)):
    assert cosine_diff(got[i][fin[i]], want[i][fin[i]]) < 1e-3, i


# 16 requests of 8 rows (like speculative decode: Mosaic takes groups of 4 rows sharing a table)
# and 128 requests of 1 row (decode: Mosaic's one-row programs).
@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_mosaic"])
@pytest.mark.parametrize("requests,per_req", [(16, 8), (128, 1)])
def test_indexer_logits_fp8_match_reference(backend, requests, per_req):
  args, want = indexer_case(requests, per_req)
  poison_allocator()
  q, weights, k_values, k_scales, tables, lens = args
  assert_indexer_logits_close(backends.get_backend(backend).indexer_logits(
      q, weights, IndexerKCache(k_values, k_scales), tables, lens), want)


@pytest.mark.parametrize("backend", ["pallas_mosaic", "pallas"])
def test_indexer_distinct_tables_hint_gives_the_same_logits(backend):
  # Rows in groups of 8 sharing a table (what the 4-row programs take): the hint's 1-row programs
  # give the grouped ones' logits up to float32 rounding (H200, session 19: 18% of the elements
  # differ, by at most 4.8e-7; bit for bit in the CPU interpreter) and the same -inf pattern.
  args, want = indexer_case(16, 8)
  q, weights, k_values, k_scales, tables, lens = args
  run = lambda hint: np.asarray(backends.get_backend(backend).indexer_logits(
      q, weights, IndexerKCache(k_values, k_scales), tables, lens, distinct_tables=hint))
  grouped, alone = run(False), run(True)
  assert_indexer_logits_close(alone, want)
  np.testing.assert_array_equal(np.isneginf(alone), np.isneginf(grouped))
  fin = np.isfinite(grouped)
  np.testing.assert_allclose(alone[fin], grouped[fin], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("compute_wgs", [2, 4])
def test_mosaic_indexer_compute_wgs_match_reference(compute_wgs):
  # The Mosaic kernel's rows=4 programs with 2 compute warpgroups (the default) or 4 (each step's
  # rows split over two), called directly at 16 requests x 8 rows.
  args, want = indexer_case(16, 8)
  poison_allocator()
  assert_indexer_logits_close(
      mosaic_indexer.indexer_logits(*args, rows=4, compute_wgs=compute_wgs), want)


@pytest.mark.parametrize("variant", [
    {}, {"per_lane": True, "sectors": False}, {"fused_theta": True, "sectors": False},
    {"fused_theta": True}, {"sectors": True, "per_lane": False, "fused_theta": False,
                            "s": 131072},
    {"lean_select": True}, {"lean_select": True, "select_warps": 4},
    {"row_resident": True}, {"row_resident": True, "s": 16384},
    {"row_resident": True, "interpolate": True},
    {"row_resident": False, "interpolate": True, "s": 131072},
    {"row_resident": False, "interpolate": True, "fused_theta": True, "lean_select": True}],
    ids=["default", "per_lane", "fused_theta", "sectors_fused", "sectors", "lean_select",
         "lean_select_w4", "row_resident", "row_resident_16k", "row_resident_interpolate",
         "interpolate_131072", "interpolate_sectors_fused"])
@pytest.mark.parametrize("kind", ["normal", "ties", "few_ties"])
def test_topk_sets_match_lax_top_k(kind, variant):
  # variant: {} through the backend (this shape's default, v9's sector maxima and threshold with
  # separate theta); else merged into that default: v3's per-lane threshold, v3's theta fused with
  # the maxima (both without sectors, which take no per-lane threshold), the sector form with theta
  # fused (many rows' default), or the sector form at 131072 positions (what it is for); v10b's
  # lean select at 8 and 4 warps ("ties" rows overflow half the list: its streamed path); v11's
  # one kernel a row at 32768 (16 warps) and 16384 positions (8 warps), and with v11b's
  # interpolating search; v12's interpolating select on the four-kernel path, at 131072 (few long
  # rows' form) and in many rows' form.
  variant = dict(variant)
  t, s = 128, variant.pop("s", 32768)
  x = jax.random.normal(jax.random.key(2), (t, s), jnp.float32)
  if kind == "ties":  # a few values only: the candidate list overflows on some rows
    x = jnp.round(x * 4) / 4
  elif kind == "few_ties":  # ~100 ties a value above 1 (the k-th's range): found among candidates
    x = jnp.where(x > 1, jnp.round(x * 64) / 64, x)
  lens = jnp.asarray(np.random.default_rng(3).integers(0, s + 1, t), jnp.int32).at[:4].set(
      jnp.asarray([s, 0, 1, TOPK], jnp.int32))
  want = np.asarray(jax.jit(reference.topk_positions, static_argnums=2)(x, lens, TOPK))
  poison_allocator()
  if variant:
    got = np.asarray(pallas_topk.topk_positions(x, lens, TOPK, **variant))
  else:
    got = np.asarray(backends.get_backend("pallas_triton").topk(x, lens, TOPK))
  xs = np.asarray(x)
  for i in range(t):
    g, w = got[i][got[i] >= 0], want[i][want[i] >= 0]
    assert (got[i][len(g):] == -1).all() and len(set(g.tolist())) == len(g), i
    assert len(g) == len(w) and (g < lens[i]).all(), i
    # The same sets, ties at the k-th value taken at the lowest positions.
    assert set(g.tolist()) == lowest_index_topk(xs[i], int(lens[i]), TOPK), i
    if kind == "normal":
      assert set(g.tolist()) == set(w.tolist()), i


@pytest.mark.parametrize("s", [32768, 131072])  # v11b's one kernel; the four kernels' select
def test_topk_slots_are_the_mapped_selection(s):
  # The backend's top-k writing the selection's cache slots too (what the layer runs), at the
  # decode step's shapes: the positions are `topk`'s, the slots `positions_to_slots` of them
  # exactly (tables of 64-token blocks, shuffled, with -1 and past-the-cache entries).
  t, page, nb = 128, 64, 4 * s // 64
  rng = np.random.default_rng(s)
  x = jax.random.normal(jax.random.key(5), (t, s), jnp.float32)
  lens = jnp.asarray(rng.integers(0, s + 1, t), jnp.int32).at[:4].set(
      jnp.asarray([s, 0, 1, TOPK], jnp.int32))
  tables = rng.integers(0, nb, (t, s // page)).astype(np.int32)
  tables[::3, ::7] = -1
  tables[1::3, ::5] = nb + 1
  be = backends.get_backend("pallas")
  poison_allocator()
  positions, slots = be.topk_slots(x, lens, TOPK, jnp.asarray(tables), block_size=page,
                                   num_blocks=nb)
  positions, slots = np.asarray(positions), np.asarray(slots)
  want = np.asarray(positions_to_slots(jnp.asarray(positions), jnp.asarray(tables), page, nb))
  np.testing.assert_array_equal(slots, want)
  assert (want >= 0).any() and ((positions >= 0) & (want < 0)).any()
  np.testing.assert_array_equal(np.sort(positions, 1), np.sort(np.asarray(be.topk(x, lens, TOPK)),
                                                               1))


def test_quantize_fp8_rounds_inside_a_jit():
  # Quantized and dequantized in one compiled function, as a reference path does: the values are
  # the e4m3 ones (XLA's GPU compiler folded the convert pair into the identity without the
  # barrier), against numpy's rounding.
  x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100
  got = jax.jit(lambda v: dequantize(quantize_fp8(v, 0.5), 0.5))(x)
  want = np.clip(x / 0.5, -448, 448).astype(jnp.float8_e4m3fn).astype(np.float32) * 0.5
  np.testing.assert_array_equal(np.asarray(got), want)
