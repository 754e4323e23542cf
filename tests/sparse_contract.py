"""Shared tests of a backend's DSA functions: sparse attention, indexer logits, top-k.

A backend's test class subclasses these and sets `backend`; oracles are float64 numpy.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mla_jax import backends
from mla_jax.cache import DSMLACache, IndexerKCache, LatentCache
from oracles import attention_np

L, R = 128, 64  # one fp8_ds_mla tile keeps the shapes small; real models have L = 512


def cosine_diff(x, y):
  x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
  return 1 - 2 * np.sum(x * y) / np.sum(x * x + y * y)


def random_slots(rng, t, k, num_slots, frac_invalid=0.2):
  """[t, k] distinct slots per row, some -1 and some past the cache (both must be skipped)."""
  slots = np.stack([rng.permutation(num_slots)[:k] for _ in range(t)]).astype(np.int32)
  drop = rng.random((t, k)) < frac_invalid
  slots[drop] = np.where(rng.random(drop.sum()) < 0.5, -1, num_slots + 7)
  return slots


def sparse_np(q, rows_of, slots, num_slots, scale, kv_lora_rank):
  """Per row: attention over the rows of its valid slots only."""
  t, n, _ = q.shape
  o, lse = np.zeros((t, n, kv_lora_rank)), np.full((t, n), -np.inf)
  for i in range(t):
    ok = [s for s in slots[i] if 0 <= s < num_slots]
    if ok:
      k = rows_of(np.array(ok))
      o[i], lse[i] = (a[0] for a in attention_np(q[i:i + 1], k, k[:, :kv_lora_rank], scale))
  return o, lse


class SparseAttentionContract:
  backend = None
  NB, BS = 12, 16

  def fn(self):
    return backends.get_backend(self.backend).sparse_attention

  def _bf16_cache(self, rng, poison_rows=()):
    data = rng.standard_normal((self.NB, self.BS, L + R)).astype(ml_dtypes.bfloat16)
    data = data.astype(np.float32)
    flat = data.reshape(-1, L + R)
    flat[list(poison_rows)] = np.nan
    return LatentCache(jnp.asarray(data, jnp.bfloat16), jnp.float32(1.0)), flat

  # Head counts below, at and above one head block; slot lists that are not whole blocks.
  @pytest.mark.parametrize("n,k", [(16, 64), (4, 32), (128, 40)])
  def test_bf16_cache_matches_oracle(self, n, k):
    rng = np.random.default_rng(100 + n)
    num_slots = self.NB * self.BS
    slots = random_slots(rng, 6, k, num_slots)
    slots[2] = -1  # a row with nothing selected: 0 and -inf
    unused = sorted(set(range(num_slots)) - set(slots[(slots >= 0) & (slots < num_slots)].tolist()))
    cache, flat = self._bf16_cache(rng, poison_rows=unused)  # NaN wherever nothing selects
    q = rng.standard_normal((6, n, L + R)).astype(np.float32)
    o, lse = self.fn()(jnp.asarray(q), cache, jnp.asarray(slots), scale=0.05, kv_lora_rank=L)
    o_ref, lse_ref = sparse_np(q, lambda s: flat[s], slots, num_slots, 0.05, L)
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    assert np.isfinite(o).all()
    np.testing.assert_array_equal(lse[2], -np.inf)
    np.testing.assert_array_equal(o[2], 0.0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[lse_ref > -np.inf], lse_ref[lse_ref > -np.inf], rtol=1e-5,
                               atol=1e-5)

  # One 128-wide tile (L=128) and V3.2's four (L=512, each with its own scale), pages 16 and 64.
  @pytest.mark.parametrize("lora,nb,bs,n", [(L, 12, 16, 16), (512, 3, 64, 32)])
  def test_fp8_ds_mla_cache_matches_dequantized_oracle(self, lora, nb, bs, n):
    rng = np.random.default_rng(7 + lora)
    num_slots = nb * bs
    cache = DSMLACache.allocate(nb, bs, lora, R)
    # Per-row and per-tile magnitudes 20x apart, so a scale applied to the wrong tile shows.
    kv = (rng.standard_normal((num_slots, lora)).astype(np.float32)
          * rng.uniform(0.1, 2, (num_slots, 1))
          * np.repeat(rng.uniform(0.1, 2, (1, lora // 128)), 128, 1))
    pe = rng.standard_normal((num_slots, R)).astype(np.float32)
    cache = cache.write(jnp.asarray(kv), jnp.asarray(pe), jnp.arange(num_slots, dtype=jnp.int32))
    deq = np.asarray(cache.dequantize_rows(jnp.arange(num_slots, dtype=jnp.int32)), np.float64)
    slots = random_slots(rng, 5, 48, num_slots)
    q = rng.standard_normal((5, n, lora + R)).astype(np.float32)
    o, lse = self.fn()(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(slots), scale=0.03,
                       kv_lora_rank=lora)
    qb = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    o_ref, lse_ref = sparse_np(qb, lambda s: deq[s], slots, num_slots, 0.03, lora)
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, rtol=0.065, atol=0.05)
    assert cosine_diff(o.astype(jnp.float32), o_ref) < 1e-3
    np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=1e-3, atol=1e-3)

  def test_fp8_per_tensor_cache_matches_dequantized_oracle(self):
    rng = np.random.default_rng(8)
    num_slots = self.NB * self.BS
    values = rng.standard_normal((self.NB, self.BS, L + R)).astype(np.float32) / 10
    cache = LatentCache(jnp.asarray(values / 0.05, jnp.float8_e4m3fn), jnp.float32(0.05))
    deq = np.asarray(cache.data.astype(jnp.float32), np.float64).reshape(-1, L + R) * 0.05
    slots = random_slots(rng, 4, 64, num_slots)
    q = np.asarray(jnp.asarray(rng.standard_normal((4, 16, L + R)), jnp.bfloat16)
                   .astype(jnp.float32))
    o, lse = self.fn()(jnp.asarray(q, jnp.bfloat16), cache, jnp.asarray(slots), scale=0.05,
                       kv_lora_rank=L)
    o_ref, lse_ref = sparse_np(q, lambda s: deq[s], slots, num_slots, 0.05, L)
    assert cosine_diff(o.astype(jnp.float32), o_ref) < 1e-5
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, rtol=2 / 128, atol=1e-3)
    np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=1e-5, atol=1e-5)

  def test_topk_covering_the_window_equals_dense_decode(self):
    rng = np.random.default_rng(9)
    cache, _ = self._bf16_cache(rng)
    t, n = 4, 16
    tables = np.stack([rng.permutation(self.NB)[:4] for _ in range(t)]).astype(np.int32)
    lens = np.array([40, 1, 17, 33], np.int32)
    pos = np.where(np.arange(64)[None] < lens[:, None], np.arange(64)[None], -1)
    slots = np.where(pos >= 0,
                     np.take_along_axis(tables, np.maximum(pos, 0) // self.BS, 1) * self.BS
                     + np.maximum(pos, 0) % self.BS, -1).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((t, n, L + R)), jnp.float32)
    o, lse = self.fn()(q, cache, jnp.asarray(slots), scale=0.05, kv_lora_rank=L)
    o_d, lse_d = backends.REFERENCE.decode(q, cache, jnp.asarray(tables), jnp.asarray(lens),
                                           scale=0.05, kv_lora_rank=L)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_d), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_d), rtol=1e-5, atol=1e-5)

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "slots": a["slots"][:1]}, "want q"),
      (lambda a: {**a, "slots": a["slots"][0]}, "want q"),
      (lambda a: {**a, "slots": a["slots"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "floating point"),
      (lambda a: {**a, "q": a["q"][..., :L]}, "row width 192"),
      (lambda a: {**a, "kv_lora_rank": L + R}, "row width 192"),
      (lambda a: {**a, "cache": DSMLACache.allocate(4, 16, L, R), "kv_lora_rank": 64},
       "kv_lora_rank 64 != the fp8_ds_mla cache's 128"),
      (lambda a: {**a, "cache": LatentCache(a["cache"].data.astype(jnp.float8_e4m3fn), None)},
       "needs its per-tensor k_scale"),
      (lambda a: {**a, "cache": LatentCache(a["cache"].data.astype(jnp.float8_e4m3fn),
                                            jnp.float32(np.inf))}, "finite and positive"),
      (lambda a: {**a, "cache": LatentCache(a["cache"].data.astype(jnp.float8_e4m3fn), -1.0)},
       "finite and positive"),
  ])
  def test_bad_backend_input_raises(self, change, message):
    # The backend's own entry (not self.fn, which subclasses narrow): a ValueError before any
    # kernel is traced, the reference's included.
    args = dict(q=jnp.zeros((2, 16, L + R), jnp.bfloat16),
                cache=LatentCache(jnp.zeros((4, 16, L + R), jnp.bfloat16), jnp.float32(1.0)),
                slots=jnp.zeros((2, 8), jnp.int32), kv_lora_rank=L)
    with pytest.raises(ValueError, match=message):
      backends.get_backend(self.backend).sparse_attention(**change(args), scale=0.05)

  def test_empty_batch_gives_empty_results(self):
    # No rows (an idle step): empty outputs, no kernel to launch (the reference and the Mosaic
    # kernel divided by zero).
    for cache in (self._bf16_cache(np.random.default_rng(0))[0], DSMLACache.allocate(4, 16, L, R)):
      o, lse = self.fn()(jnp.zeros((0, 16, L + R), jnp.bfloat16), cache,
                         jnp.zeros((0, 8), jnp.int32), scale=0.05, kv_lora_rank=L)
      assert o.shape == (0, 16, L) and lse.shape == (0, 16) and lse.dtype == jnp.float32


def indexer_logits_np(q, weights, k, k_scale, positions_visible):
  """I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s] * k_scale[s]) over visible s, else -inf."""
  s = np.einsum("thd,sd->ths", q.astype(np.float64), k.astype(np.float64)) * k_scale[None, None, :]
  out = np.einsum("th,ths->ts", weights.astype(np.float64), np.maximum(s, 0.0))
  return np.where(positions_visible, out, -np.inf)


def lowest_index_topk(row, length, k):
  """The top-k positions of row[:length] among finite values in IEEE total order (-0.0 < 0.0), ties
  taken at the lowest positions: what `lax.top_k` takes and the kernels must."""
  finite = np.flatnonzero(np.isfinite(row[:length]))
  bits = row[finite].astype(np.float32).view(np.int32)
  keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)
  order = np.lexsort((finite, -keys))  # by value descending, then position ascending
  return set(finite[order[:k]].tolist())


class IndexerContract:
  backend = None
  NB = 10

  def be(self):
    return backends.get_backend(self.backend)

  def topk_variants(self):
    """The top-k functions the top-k tests check: the backend's; a backend class adds its kernel's
    other choices (which other shapes would take by default)."""
    return [self.be().topk]

  def topk_slots_variants(self):
    """The top-k-with-slots functions the slot tests check: the backend's; a backend class adds
    its kernel's other choices."""
    return [self.be().topk_slots]

  # Small heads (padded by kernels) and V3.2's 64 x 128 with 64-token pages.
  @pytest.mark.parametrize("h,d,bs", [(8, 32, 16), (64, 128, 64)])
  @pytest.mark.parametrize("fp8", [True, False])
  def test_logits_match_oracle(self, fp8, h, d, bs):
    rng = np.random.default_rng(11 + fp8 + h)
    t, mb = 5, 4
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    k_vals = jnp.asarray(rng.standard_normal((self.NB, bs, d)) * 3, dtype)
    k_scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (self.NB, bs)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((t, h, d)) * 3, dtype)
    w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    tables = np.stack([rng.permutation(self.NB)[:mb] for _ in range(t)]).astype(np.int32)
    tables[1, 3] = -1  # past row 1's length: must not be read
    lens = np.array([mb * bs, 5 * bs // 2, 1, 0, 2 * bs + 5], np.int32)
    got = np.asarray(self.be().indexer_logits(q, w, IndexerKCache(k_vals, k_scale),
                                              jnp.asarray(tables), jnp.asarray(lens)))
    assert got.shape == (t, mb * bs) and got.dtype == np.float32
    kf = np.asarray(k_vals.astype(jnp.float32))
    ks = np.asarray(k_scale)
    for i in range(t):
      rows = np.concatenate([kf[b] if b >= 0 else np.zeros((bs, d)) for b in tables[i]])
      sc = np.concatenate([ks[b] if b >= 0 else np.zeros(bs) for b in tables[i]])
      want = indexer_logits_np(np.asarray(q[i:i + 1].astype(jnp.float32)), np.asarray(w[i:i + 1]),
                               rows, sc, (np.arange(mb * bs) < lens[i])[None])[0]
      np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))  # the -inf pattern exactly
      fin = np.isfinite(want)
      if fin.any():
        assert cosine_diff(got[i][fin], want[fin]) < 1e-3
        np.testing.assert_allclose(got[i][fin], want[fin], rtol=1e-4, atol=1e-4)

  # distinct_tables is a speed hint, never a correctness one: the same logits, for rows of
  # distinct requests and for prefill-like rows of one request (one table, consecutive lengths;
  # what a kernel grouping rows that share a table would group, unless told not to look). The -inf
  # pattern exactly, the values to float32 rounding: a grouped program's products are another
  # shape, and XLA's CPU dot (the interpreter's) may sum them in another order, as the H200's
  # grouped kernel does (tests/test_dsa_gpu.py). Session 30: 1 ulp on one element of the
  # Mosaic indexer's shared rows, on numpy 2.5.5 / ml_dtypes 0.7.0 inputs (bit for bit before).
  @pytest.mark.parametrize("shared", [pytest.param(True, id="shared"), False])
  def test_distinct_tables_hint_gives_the_same_logits(self, shared):
    rng = np.random.default_rng(40 + shared)
    t, mb, h, d, bs = 4, 4, 64, 128, 64
    f8 = jnp.float8_e4m3fn
    k_cache = IndexerKCache(jnp.asarray(rng.standard_normal((self.NB, bs, d)) * 3, f8),
                            jnp.asarray(2.0 ** rng.integers(-3, 3, (self.NB, bs)), jnp.float32))
    q = jnp.asarray(rng.standard_normal((t, h, d)) * 3, f8)
    w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    tables = np.stack([rng.permutation(self.NB)[:mb] for _ in range(t)]).astype(np.int32)
    if shared:
      tables[:] = tables[0]
      lens = np.arange(t, dtype=np.int32) + 3 * bs - 7
    else:
      lens = np.array([mb * bs, 5 * bs // 2, 1, 0], np.int32)
    logits = lambda hint: np.asarray(self.be().indexer_logits(
        q, w, k_cache, jnp.asarray(tables), jnp.asarray(lens), distinct_tables=hint))
    alone, grouped = logits(True), logits(False)
    np.testing.assert_array_equal(np.isneginf(alone), np.isneginf(grouped))
    fin = np.isfinite(grouped)
    np.testing.assert_array_equal(np.isfinite(alone), fin)
    np.testing.assert_allclose(alone[fin], grouped[fin], rtol=1e-6, atol=0)

  @pytest.mark.parametrize("s,k", [(300, 64), (50, 64), (200, 200)])
  def test_topk_sets_match_brute_force(self, s, k):
    rng = np.random.default_rng(s + k)
    t = 6
    logits = rng.standard_normal((t, s)).astype(np.float32)
    lens = np.array([s, 1, 0, s // 2, min(k, s), s - 3], np.int32)
    for topk in self.topk_variants():
      got = np.asarray(topk(jnp.asarray(logits), jnp.asarray(lens), k))
      assert got.shape == (t, k) and got.dtype == np.int32
      for i in range(t):
        sel = got[i][got[i] >= 0]
        assert len(set(sel.tolist())) == len(sel)  # no duplicates
        assert (got[i][len(sel):] == -1).all() or len(sel) == k
        n_vis = int(lens[i])
        assert len(sel) == min(k, n_vis)
        assert (sel < n_vis).all()
        assert set(sel.tolist()) == lowest_index_topk(logits[i], n_vis, k)

  def test_topk_ties_and_neg_inf(self):
    """Long rows (S >> k), heavy ties, -inf inside the window: every selectable position (in the
    window, finite) counts; selected values dominate the unselected ones; of ties at the k-th
    value, the lowest positions."""
    rng = np.random.default_rng(5)
    s, k = 4096, 64
    logits = rng.standard_normal((5, s)).astype(np.float32)
    logits[1] = 0.0  # one value everywhere, and -0.0 (below 0.0 in lax.top_k's total order)
    logits[1, ::3] = -0.0
    logits[2] = np.round(logits[2] * 2)  # a handful of values
    logits[3, rng.random(s) < 0.99] = -np.inf  # fewer finite positions than k
    logits[4, ::2] = -np.inf
    lens = np.array([s, s, s - 100, s, 3000], np.int32)
    for topk in self.topk_variants():
      got = np.asarray(topk(jnp.asarray(logits), jnp.asarray(lens), k))
      for i in range(5):
        sel = got[i][got[i] >= 0]
        assert len(set(sel.tolist())) == len(sel) and (got[i][len(sel):] == -1).all()
        selectable = np.flatnonzero(np.isfinite(logits[i, :lens[i]]))
        assert len(sel) == min(k, len(selectable)) and np.isin(sel, selectable).all()
        assert set(sel.tolist()) == lowest_index_topk(logits[i], lens[i], k), (topk, i)

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "weights": a["weights"][:, :2]}, "want q"),
      (lambda a: {**a, "q": a["q"][..., :64]}, "want q"),  # keys are 128 wide
      (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "want q"),
      (lambda a: {**a, "weights": a["weights"].astype(jnp.bfloat16)}, "float32"),
      (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "int32"),
      (lambda a: {**a, "k_cache": IndexerKCache(a["k_cache"].values,
                                                a["k_cache"].scales.astype(jnp.bfloat16))},
       "float32"),
  ])
  def test_bad_backend_input_raises(self, change, message):
    args = dict(q=jnp.zeros((2, 64, 128), jnp.float8_e4m3fn),
                weights=jnp.zeros((2, 64), jnp.float32),
                k_cache=IndexerKCache.allocate(3, 64), block_tables=jnp.zeros((2, 3), jnp.int32),
                seq_lens=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match=message):
      self.be().indexer_logits(**change(args))

  def test_topk_slots_are_the_selections_cache_slots(self):
    """topk_slots: topk's selection, and each selected position's slot through its row's table:
    -1 past the table (rows wider than it), at a -1 block and at a block past the cache."""
    rng = np.random.default_rng(8)
    t, s, k, bs, nb, mb = 6, 300, 64, 16, 20, 17  # 17 blocks cover 272 of the 300 positions
    logits = rng.standard_normal((t, s)).astype(np.float32)
    lens = np.array([s, 1, 0, 150, k, s - 3], np.int32)
    tables = rng.integers(-1, nb + 3, (t, mb)).astype(np.int32)
    for topk_slots in self.topk_slots_variants():
      positions, slots = (np.asarray(a) for a in topk_slots(
          jnp.asarray(logits), jnp.asarray(lens), k, jnp.asarray(tables), block_size=bs,
          num_blocks=nb))
      assert positions.shape == slots.shape == (t, k) and slots.dtype == np.int32
      want = np.full((t, k), -1)
      for i in range(t):
        sel = positions[i][positions[i] >= 0]
        assert set(sel.tolist()) == lowest_index_topk(logits[i], lens[i], k), (topk_slots, i)
        for j, p in enumerate(positions[i]):
          block = tables[i, p // bs] if 0 <= p < mb * bs else -1
          if 0 <= block < nb:
            want[i, j] = block * bs + p % bs
      # Both kinds of selected position occur: mapped, and -1 (past the table or its blocks).
      assert (want >= 0).any() and ((positions >= 0) & (want < 0)).any()
      np.testing.assert_array_equal(slots, want)

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "want block_tables"),
      (lambda a: {**a, "block_tables": a["block_tables"][0]}, "want block_tables"),
      (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "int32"),
      (lambda a: {**a, "block_size": 0}, "block_size must be a positive int"),
      (lambda a: {**a, "num_blocks": 2.0}, "num_blocks must be a positive int"),
      (lambda a: {**a, "topk": 0}, "positive int"),
  ])
  def test_bad_backend_topk_slots_input_raises(self, change, message):
    args = dict(logits=jnp.zeros((2, 64), jnp.float32), seq_lens=jnp.ones((2,), jnp.int32),
                topk=8, block_tables=jnp.zeros((2, 4), jnp.int32), block_size=16, num_blocks=4)
    with pytest.raises(ValueError, match=message):
      self.be().topk_slots(**change(args))

  # topk past the row's width is no error: the positions past it are -1 (see the top-k cases).
  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "logits": a["logits"][0]}, "want logits"),
      (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "want logits"),
      (lambda a: {**a, "logits": a["logits"].astype(jnp.bfloat16)}, "float32"),
      (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.float32)}, "int32"),
      (lambda a: {**a, "topk": 0}, "positive int"),
      (lambda a: {**a, "topk": 8.0}, "positive int"),
      (lambda a: {**a, "topk": True}, "positive int"),
  ])
  def test_bad_backend_topk_input_raises(self, change, message):
    args = dict(logits=jnp.zeros((2, 64), jnp.float32), seq_lens=jnp.ones((2,), jnp.int32),
                topk=8)
    with pytest.raises(ValueError, match=message):
      self.be().topk(**change(args))
