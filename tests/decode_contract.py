"""The decode contract every backend meets, checked against the float64 oracle on CPU-sized shapes.

A subclass sets `backend`; tests reach the function through `mla_jax.backends.get_backend`.
Inputs are fresh per case: NaN in every cache slot no row may read, shuffled block tables, lengths
that include 0 and partial pages. Pallas interpret mode fills outputs with NaN before the kernel
runs (jax's `hlo_interpreter._initialize_output_vals`), so "no NaN" below also proves that the
kernel wrote every output element.
"""

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from mla_jax import backends
from mla_jax.cache import DSMLACache, LatentCache
from oracles import attention_np, latent_decode_np

L, R = 512, 64
SCALE = (128 + R) ** -0.5
FP8_SCALE = 0.05


def cos_diff(x, y):
  x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
  return 1 - 2 * np.sum(x * y) / max(np.sum(x * x + y * y), 1e-300)


def assert_decode_close(o, lse, ref_o, ref_lse, *, tight=False):
  """SPEC section 8: cosine difference < 1e-5 on out and lse, then per element abs 8e-4 or rel
  2/128 (float32 runs: both 1e-5). The -inf pattern of lse must match exactly."""
  o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
  assert not np.isnan(o).any() and not np.isnan(lse).any(), (
      "NaN in the outputs (unwritten or leaked)")
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  seen = np.isfinite(ref_lse)
  cos_o, cos_lse = cos_diff(o, ref_o), cos_diff(lse[seen], ref_lse[seen])
  worst = (f"worst abs error o {np.abs(o - ref_o).max():.3g}, lse "
           f"{np.abs(lse[seen] - ref_lse[seen]).max(initial=0):.3g}")
  assert cos_o < 1e-5 and cos_lse < 1e-5, (
      f"cosine difference o {cos_o:.3g}, lse {cos_lse:.3g} (limit 1e-5); {worst}")
  atol, rtol = (1e-5, 1e-5) if tight else (8e-4, 2 / 128)
  for name, got, want in (("o", o, ref_o), ("lse", lse[seen], ref_lse[seen])):
    err = np.abs(got - want)
    bad = (err > atol) & (err > rtol * np.abs(want))
    rel = err / np.maximum(np.abs(want), 1e-30)
    assert not bad.any(), (f"{name}: {bad.sum()} elements off; worst abs error {err.max():.3g}, "
                           f"worst rel error {rel.max():.3g} (cosine difference o {cos_o:.3g}, "
                           f"lse {cos_lse:.3g})")


def make_case(seed, *, n, page, req_lens, q_lens=None, q_dtype=jnp.bfloat16,
              cache_dtype=jnp.bfloat16, spare_blocks=3, extra_table=2):
  """Random decode inputs as numpy arrays, one request per entry of req_lens.

  Request r contributes q_lens[r] rows (default 1); row j of it sees req_lens[r] - q_len + j + 1
  tokens, all through the request's table. Cache values are randn / 10 as in FlashMLA's decode
  test (the tolerances above come from there); q is unit normal. Blocks are dealt from a random
  permutation; table slots past a request's pages hold -1 or some other request's (or a spare, NaN)
  block, and every slot past a request's length is NaN, so a read past the length shows up.
  """
  rng = np.random.default_rng(seed)
  q_lens = q_lens or [1] * len(req_lens)
  pages = [-(-s // page) for s in req_lens]
  max_blocks = max(pages) + extra_table
  num_blocks = sum(pages) + spare_blocks
  perm = rng.permutation(num_blocks).astype(np.int32)
  fp8 = jnp.dtype(cache_dtype) == jnp.float8_e4m3fn
  values = rng.standard_normal((num_blocks, page, L + R)).astype(np.float32) / 10
  if fp8:
    values /= FP8_SCALE
  cache = np.full((num_blocks, page, L + R), np.nan, np.float32)
  tables, lens, start = [], [], 0
  for s, p, ql in zip(req_lens, pages, q_lens):
    own = perm[start:start + p]
    start += p
    tail = np.where(rng.random(max_blocks - p) < 0.5, -1, rng.choice(perm, max_blocks - p))
    tables += [np.concatenate([own, tail]).astype(np.int32)] * ql
    lens += [max(s - ql + j + 1, 0) for j in range(ql)]
    for pos in range(s):
      cache[own[pos // page], pos % page] = values[own[pos // page], pos % page]
  q = rng.standard_normal((len(lens), n, L + R)).astype(np.float32)
  cache_dtype = ml_dtypes.float8_e4m3fn if fp8 else jnp.dtype(cache_dtype)
  return (np.asarray(jnp.asarray(q, q_dtype)), cache.astype(cache_dtype), np.stack(tables),
          np.asarray(lens, np.int32))


class DecodeContract:
  backend = None

  def decode(self, q, kv_cache, *args, k_scale=None, **kwargs):
    """The backend's decode over `kv_cache` (an array) as a LatentCache (`k_scale`: fp8's)."""
    cache = LatentCache(kv_cache, jnp.float32(1.0 if k_scale is None else k_scale))
    return backends.get_backend(self.backend).decode(q, cache, *args, scale=SCALE, kv_lora_rank=L,
                                                     **kwargs)

  def check(self, q, cache, tables, lens, *, k_scale=None, **kwargs):
    o, lse = self.decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(tables), jnp.asarray(lens),
                         k_scale=k_scale, **kwargs)
    assert o.shape == q.shape[:2] + (L,) and o.dtype == q.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
    ref_o, ref_lse = latent_decode_np(q.astype(np.float32), cache, tables, lens, SCALE, L,
                                      1.0 if k_scale is None else float(k_scale))
    assert_decode_close(np.asarray(o.astype(jnp.float32)), lse, ref_o, ref_lse,
                        tight=q.dtype == np.float32 and cache.dtype == np.float32)
    return o, lse

  @pytest.mark.parametrize("seed,n,page,splits,req_lens", [
      (0, 16, 16, 1, [37, 0, 16, 200]),
      (1, 16, 64, None, [130, 1, 64, 0, 65]),
      (2, 32, 16, 7, [199, 3, 0, 48]),
      (3, 20, 16, None, [90, 17]),
      (4, 128, 64, 2, [150, 0]),
      (5, 16, 48, 3, [100, 47, 0]),
  ])
  def test_bf16(self, seed, n, page, splits, req_lens):
    self.check(*make_case(seed, n=n, page=page, req_lens=req_lens), num_kv_splits=splits)

  @pytest.mark.parametrize("seed,n,page,splits,k_scale", [
      (10, 16, 64, 4, FP8_SCALE),
      (11, 32, 16, 1, jnp.float32(FP8_SCALE)),
      (12, 128, 64, 2, jnp.float32(FP8_SCALE)),
  ])
  def test_fp8_cache(self, seed, n, page, splits, k_scale):
    case = make_case(seed, n=n, page=page, req_lens=[150, 0, 33], cache_dtype=jnp.float8_e4m3fn)
    self.check(*case, k_scale=k_scale, num_kv_splits=splits)

  @pytest.mark.parametrize("seed,q_dtype,cache_dtype,splits", [
      (20, jnp.float32, jnp.float32, None),
      (21, jnp.float16, jnp.float16, 1),
  ])
  def test_other_dtypes(self, seed, q_dtype, cache_dtype, splits):
    case = make_case(seed, n=16, page=16, req_lens=[70, 0, 5], q_dtype=q_dtype,
                     cache_dtype=cache_dtype)
    self.check(*case, num_kv_splits=splits)

  def test_multi_token_rows(self):
    # Speculative decode: 4 query rows per request share its table, row j sees len - 4 + j + 1.
    case = make_case(30, n=16, page=16, req_lens=[61, 3], q_lens=[4, 4])
    self.check(*case, num_kv_splits=2)

  def test_batch_invariant(self, monkeypatch):
    """batch_invariant=True: request 0's output bits alone equal its bits in three other batches
    (other requests around it, another order and duplicates, tables 4 and 10 pages wider, which
    add splits that see nothing). The split size is cut to 128 tokens so that CPU-sized requests
    span several splits (request 0: 4)."""
    monkeypatch.setattr(backends, "BATCH_INVARIANT_SPLIT_TOKENS", 128)
    lengths = [434, 100, 0, 129, 64]
    q, cache, tables, lens = make_case(80, n=16, page=64, req_lens=lengths, extra_table=0)
    own = -(-lengths[0] // 64)

    def run(rows, width):
      table = np.full((len(rows), width), -1, np.int32)
      table[:, :min(width, tables.shape[1])] = tables[rows, :width]
      return [np.asarray(a) for a in self.decode(
          jnp.asarray(q[rows]), jnp.asarray(cache), jnp.asarray(table), jnp.asarray(lens[rows]),
          batch_invariant=True)]

    alone_o, alone_lse = run([0], own)
    assert_decode_close(alone_o.astype(np.float32), alone_lse, *latent_decode_np(
        q[:1].astype(np.float32), cache, tables[:1], lens[:1], SCALE, L))
    batches = (([0, 1, 2, 3, 4], own), ([3, 1, 0], own + 4), ([4, 0, 0, 2, 1, 3], own + 10))
    for rows, width in batches:
      o, lse = run(rows, width)
      np.testing.assert_array_equal(o[rows.index(0)], alone_o[0])
      np.testing.assert_array_equal(lse[rows.index(0)], alone_lse[0])

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "one row per query token"),
      (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.float32)}, "int32"),
      (lambda a: {**a, "q": a["q"][..., :L]}, "cache row width"),
      (lambda a: {**a, "kv_lora_rank": L + R}, r"kv_lora_rank must be in \[1, 576\)"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "floating point"),
      (lambda a: {**a, "cache": LatentCache(a["cache"].data.astype(jnp.float8_e4m3fn), None)},
       "needs its per-tensor k_scale"),
      (lambda a: {**a, "cache": LatentCache(a["cache"].data.astype(jnp.float8_e4m3fn),
                                            jnp.float32(np.nan))}, "finite and positive"),
      (lambda a: {**a, "cache": LatentCache(a["cache"].data.astype(jnp.float8_e4m3fn), 0.0)},
       "finite and positive"),
      (lambda a: {**a, "cache": DSMLACache.allocate(4, 64, L, R)}, "dense latent cache"),
  ])
  def test_bad_backend_input_raises(self, change, message):
    # The backend's own entry (not self.decode, which subclasses narrow): a ValueError before any
    # kernel is traced, the reference's included.
    args = dict(q=jnp.zeros((2, 16, L + R), jnp.bfloat16),
                cache=LatentCache(jnp.zeros((4, 64, L + R), jnp.bfloat16), jnp.float32(1.0)),
                block_tables=jnp.zeros((2, 2), jnp.int32), seq_lens=jnp.ones((2,), jnp.int32),
                kv_lora_rank=L)
    with pytest.raises(ValueError, match=message):
      backends.get_backend(self.backend).decode(**change(args), scale=SCALE)

  def test_bad_table_entries_inside_length_are_masked(self):
    self.check_bad_table_entries(page=16, req_lens=[80, 50])

  def check_bad_table_entries(self, *, page, req_lens, cache_dtype=jnp.bfloat16):
    """A -1 and an out-of-range entry inside the length (rows 0 and 1, their 2nd and 3rd page)."""
    q, cache, tables, lens = make_case(40, n=16, page=page, req_lens=req_lens, spare_blocks=0,
                                       cache_dtype=cache_dtype)
    k_scale = FP8_SCALE if jnp.dtype(cache_dtype) == jnp.float8_e4m3fn else None
    num_blocks = cache.shape[0]
    tables[0, 1], tables[1, 2] = -1, num_blocks + 5
    o, lse = self.decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(tables), jnp.asarray(lens),
                         k_scale=k_scale, num_kv_splits=2)
    # Oracle: attention over the positions whose table entry is a real block.
    ref_o, ref_lse = np.zeros(o.shape), np.zeros(lse.shape)
    for i, length in enumerate(lens):
      rows = np.stack([cache[tables[i, p // page], p % page] for p in range(length)
                       if 0 <= tables[i, p // page] < num_blocks]).astype(np.float64)
      rows *= k_scale or 1.0
      out = attention_np(q[i:i + 1].astype(np.float32), rows, rows[:, :L], SCALE)
      ref_o[i], ref_lse[i] = out[0][0], out[1][0]
    assert_decode_close(np.asarray(o.astype(jnp.float32)), lse, ref_o, ref_lse)


def assert_e4m3_split_is_exact():
  """`e4m3_operands.e4m3_queries` compiled for the default device: every finite bf16 magnitude
  below 256 in tokens whose largest is 255 (no scaling), hi + 2^-4 lo is the value exactly from
  2^-6 (e4m3's normals) up, and not always below it; then scaled heads (each its own power of
  two) give the same parts and the powers back. Compiled, not eager: XLA's GPU compiler may fold
  a convert round trip that the split relies on."""
  from pallas_kernels import e4m3_operands
  split = jax.jit(e4m3_operands.e4m3_queries)
  x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.bfloat16)
  x = x[np.isfinite(x) & (np.abs(x.astype(np.float32)) < 256)]
  per_token = 576 - 1
  x = np.pad(x, (0, -len(x) % per_token)).reshape(-1, 1, per_token)
  q = np.concatenate([x, np.full((len(x), 1, 1), 255, jnp.bfloat16)], axis=2)
  parts, back = (np.asarray(a) for a in split(jnp.asarray(q)))
  assert parts.dtype == jnp.float8_e4m3fn and parts.shape == (len(x), 2, 576)
  np.testing.assert_array_equal(back, np.ones((len(x), 1)))
  want = q.astype(np.float32)[:, 0]
  got = parts[:, 0].astype(np.float32) + e4m3_operands.E4M3_LO_SCALE * parts[:, 1].astype(
      np.float32)
  normal = np.abs(want) >= 2.0 ** -6
  np.testing.assert_array_equal(got[normal], want[normal])
  assert (got[~normal] != want[~normal]).any()
  heads = np.concatenate([q[:1], q[1:2] * 2.0 ** 20, q[2:3] * 2.0 ** -20], axis=1)
  scaled, back = (np.asarray(a) for a in split(jnp.asarray(heads)))
  np.testing.assert_array_equal(back, [[1, 2.0 ** 20, 2.0 ** -20]])
  np.testing.assert_array_equal(scaled.view(np.uint8).reshape(2, 3, 576),
                                parts[:3].view(np.uint8).transpose(1, 0, 2))
