"""Every backend's DSA functions against the float64 oracles; Pallas runs in interpret mode on
CPUs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_jax import backends, reference
from mla_jax.cache import DSMLACache, IndexerKCache, LatentCache
from pallas_kernels import indexer as pallas_indexer
from pallas_kernels import mosaic_indexer, mosaic_lanes
from pallas_kernels import mosaic_sparse, mosaic_sparse_register_a
from pallas_kernels import sparse_attention as pallas_sparse
from pallas_kernels import topk as pallas_topk
from pallas_kernels.common import RESCALE_SLACK, register_pool
from sparse_contract import (L, R, IndexerContract, SparseAttentionContract, cosine_diff,
                             lowest_index_topk, random_slots, sparse_np)


class TestReferenceSparseAttention(SparseAttentionContract):
  backend = "reference"


class TestReferenceIndexer(IndexerContract):
  backend = "reference"


class TestPallasTritonSparseAttention(SparseAttentionContract):
  backend = "pallas_triton"

  def test_splits_and_small_steps_match_reference(self):
    # Several splits of the slot axis (merged by LSE) and 16-slot steps; a row with nothing valid.
    rng = np.random.default_rng(3)
    num_slots = self.NB * self.BS
    cache = LatentCache(jnp.asarray(rng.standard_normal((self.NB, self.BS, L + R)), jnp.float32),
                        jnp.float32(1.0))
    slots = random_slots(rng, 4, 100, num_slots)
    slots[3] = -1
    q = jnp.asarray(rng.standard_normal((4, 20, L + R)), jnp.float32)
    o, lse = pallas_sparse.sparse_attention(q, cache.data, jnp.asarray(slots), scale=0.05,
                                            kv_lora_rank=L, num_splits=3, block_k=16,
                                            interpret=True)
    o_ref, lse_ref = backends.REFERENCE.sparse_attention(q, cache, jnp.asarray(slots), scale=0.05,
                                                         kv_lora_rank=L)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(lse)[3]).all() and (np.asarray(o)[3] == 0).all()

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "slots": a["slots"][:1]}, "want q"),
      (lambda a: {**a, "kv_lora_rank": 96}, "powers of two"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "q dtype"),
      (lambda a: {**a, "slots": a["slots"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "kv_cache": a["kv_cache"][..., :-16]}, "kv_cache"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.int8)}, "cache dtype"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn)}, "needs k_scale"),
      (lambda a: {**a, "block_k": 24}, "block_k"),
      (lambda a: {**a, "block_h": 8}, "block_h"),
      (lambda a: {**a, "num_splits": 0}, "num_splits"),
  ])
  def test_bad_input_raises(self, change, message):
    args = dict(q=jnp.zeros((2, 16, L + R), jnp.bfloat16),
                kv_cache=jnp.zeros((4, 16, L + R), jnp.bfloat16),
                slots=jnp.zeros((2, 8), jnp.int32), kv_lora_rank=L)
    with pytest.raises(ValueError, match=message):
      pallas_sparse.sparse_attention(**change(args), scale=0.1, interpret=True)

  def test_bad_ds_mla_layout_raises(self):
    q, slots = jnp.zeros((2, 16, L + R), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    nope = jnp.zeros((4, 16, L), jnp.float8_e4m3fn)
    rope = jnp.zeros((4, 16, R), jnp.bfloat16)
    with pytest.raises(ValueError, match="tile_scales"):
      pallas_sparse.sparse_attention_fp8_ds_mla(q, nope, jnp.zeros((4, 16, 2), jnp.float32), rope,
                                                slots, scale=0.1, interpret=True)

  def test_fp8_cache_past_int32_offsets_raises(self):
    q = jax.ShapeDtypeStruct((1, 16, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2 ** 16, 64, 576), jnp.float8_e4m3fn)
    slots = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    with pytest.raises(ValueError, match="int32 offsets"):
      jax.eval_shape(functools.partial(pallas_sparse.sparse_attention, scale=0.1, k_scale=1.0), q,
                     cache, slots)


# v9's knobs at any shape (the sector filter takes no per-lane threshold): with the separate
# maxima and theta kernels, and with theta fused (many rows).
SECTORS = {"sectors": True, "per_lane": False, "fused_theta": False}
SECTORS_FUSED = {**SECTORS, "fused_theta": True}
# Many rows' default form: theta fused with the sector maxima, v10b's lean select.
SECTORS_FUSED_LEAN = {**SECTORS_FUSED, "lean_select": True}
# v11: a program a row, the row's keys in registers (rows up to 32768 positions); v11b: its search
# interpolating.
RESIDENT = {"row_resident": True}
RESIDENT_INTERPOLATED = {**RESIDENT, "interpolate": True}
# v12: the four-kernel path's select interpolating (theta apart, and many rows' fused form).
INTERPOLATED = {"row_resident": False, "interpolate": True}
SECTORS_FUSED_LEAN_INTERPOLATED = {**SECTORS_FUSED_LEAN, **INTERPOLATED}


class TestPallasTritonIndexer(IndexerContract):
  backend = "pallas_triton"

  def topk_variants(self):
    # The contract's small rows take the block-wide threshold and separate maxima and theta
    # kernels; v9's sector filter (few long rows' and, theta fused, many rows' default) too. The
    # forms no default takes (v3's per-lane threshold, theta fused without sectors): the segments
    # and lane-slot cases below. Many rows' form with v10b's lean select (`SECTORS_FUSED_LEAN`);
    # v11's one kernel (`RESIDENT`, and v11b's search: `RESIDENT_INTERPOLATED`); v12's
    # interpolating select (`INTERPOLATED`, and in many rows' form).
    return super().topk_variants() + [
        functools.partial(pallas_topk.topk_positions, interpret=True, **knobs)
        for knobs in (SECTORS, SECTORS_FUSED, SECTORS_FUSED_LEAN, RESIDENT, RESIDENT_INTERPOLATED,
                      INTERPOLATED, SECTORS_FUSED_LEAN_INTERPOLATED)]

  def topk_slots_variants(self):
    # The backend's (this shape's default: the four kernels, the slots written by the select) and
    # v11's one kernel writing them, with either search; many rows' four-kernel form.
    paged = lambda knobs: lambda *args, **kwargs: pallas_topk.topk_positions(
        *args[:3], block_tables=args[3], **kwargs, interpret=True, **knobs)
    return super().topk_slots_variants() + [
        paged(knobs) for knobs in (RESIDENT, RESIDENT_INTERPOLATED,
                                   SECTORS_FUSED_LEAN_INTERPOLATED)]

  def test_topk_slots_mapped_by_the_kernel_for_few_rows_only(self, monkeypatch):
    # Decode-sized calls (rows at most 2 an SM, up to 32K positions) have the kernel map the
    # slots; many rows' or longer rows' calls map them in XLA after it (`maps_slots_in_kernel`,
    # timed: RESULTS.md "Top-k v14").
    assert pallas_topk.maps_slots_in_kernel(264, 32768)
    assert not pallas_topk.maps_slots_in_kernel(265, 32768)
    assert not pallas_topk.maps_slots_in_kernel(128, 32769)
    calls = []
    kernel = pallas_topk.topk_positions
    monkeypatch.setattr(pallas_topk, "topk_positions",
                        lambda *a, **kw: calls.append("block_tables" in kw) or kernel(*a, **kw))
    rng = np.random.default_rng(9)
    logits = jnp.asarray(rng.standard_normal((3, 200)), jnp.float32)
    lens = jnp.asarray([200, 50, 0], jnp.int32)
    tables = jnp.asarray(rng.integers(-1, 14, (3, 13)), jnp.int32)
    run = lambda: [np.asarray(a) for a in self.be().topk_slots(logits, lens, 16, tables,
                                                               block_size=16, num_blocks=12)]
    fused = run()
    monkeypatch.setattr(pallas_topk, "maps_slots_in_kernel", lambda rows, positions: False)
    apart = run()
    assert calls == [True, False]
    for a, b in zip(fused, apart):
      np.testing.assert_array_equal(a, b)

  @pytest.mark.parametrize("dtype,widen_fp8", [(jnp.bfloat16, False), (jnp.float8_e4m3fn, True)])
  def test_chunks_and_steps_match_reference(self, dtype, widen_fp8):
    # Several programs per row and several steps per program, pages smaller than a step.
    rng = np.random.default_rng(4)
    nb, bs, t, mb = 12, 16, 3, 10
    k_vals = jnp.asarray(rng.standard_normal((nb, bs, 32)), dtype)
    k_scale = jnp.asarray(rng.uniform(0.5, 2, (nb, bs)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((t, 4, 32)), dtype)
    w = jnp.asarray(rng.standard_normal((t, 4)), jnp.float32)
    tables = jnp.asarray(np.stack([rng.permutation(nb)[:mb] for _ in range(t)]), jnp.int32)
    lens = jnp.asarray([160, 70, 33], jnp.int32)
    got = pallas_indexer.indexer_logits(q, w, k_vals, k_scale, tables, lens, block_n=16, chunk=64,
                                        widen_fp8=widen_fp8, interpret=True)
    want = reference.indexer_logits(q, w, k_vals, k_scale, tables, lens)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(np.where(np.isinf(want), 0, got), np.where(np.isinf(want), 0, want),
                               rtol=1e-4, atol=1e-4)

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "weights": a["weights"][:, :2]}, "want q"),
      (lambda a: {**a, "q": a["q"][..., :24], "k_values": a["k_values"][..., :24]}, "power of two"),
      (lambda a: {**a, "q": a["q"].astype(jnp.int8)}, "must be one of"),
      (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "block_n": 12}, "block_n"),
      (lambda a: {**a, "block_n": 64, "chunk": 32}, "must not exceed"),
  ])
  def test_bad_input_raises(self, change, message):
    args = dict(q=jnp.zeros((2, 4, 32), jnp.bfloat16), weights=jnp.zeros((2, 4), jnp.float32),
                k_values=jnp.zeros((3, 16, 32), jnp.bfloat16),
                k_scales=jnp.ones((3, 16), jnp.float32),
                block_tables=jnp.zeros((2, 3), jnp.int32), seq_lens=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match=message):
      pallas_indexer.indexer_logits(**change(args), interpret=True)

  @pytest.mark.parametrize("variant", [
      {}, {"per_lane": True}, {"fused_theta": True}, SECTORS, SECTORS_FUSED,
      {"lean_select": True}, RESIDENT, RESIDENT_INTERPOLATED, INTERPOLATED,
      {**INTERPOLATED, "lean_select": True}, SECTORS_FUSED_LEAN_INTERPOLATED],
      ids=["default", "per_lane", "fused_theta", "sectors", "sectors_fused", "lean_select",
           "row_resident", "interpolate", "four_kernel_interpolate", "lean_interpolate",
           "sectors_fused_lean_interpolate"])
  def test_topk_segments_ties_and_overflow_match_reference(self, variant):
    # Small chunks split rows into several segments that claim candidate places concurrently;
    # row 1's ties overflow the candidate list (the slow exact path); row 3 mixes signs and
    # magnitudes so every bit of the keys matters; row 4 ties 5 positions in 4 segments at the
    # k-th value (one fits): the lowest wins, found among the candidates; row 5 repeats each of 625
    # values at 4 of the 8 members of its strided group (G = 8), so 256-512 candidates (past half
    # the 512-entry list: the full-width select) tie in fours. Variants: the default for these
    # rows (block-wide threshold, separate maxima and theta kernels), v3's per-lane threshold
    # (its slots: the lane-slot test below), theta fused with the maxima and v9's sector filter
    # (`sectors`, long and many rows' default, theta apart or fused: groups of m8 = 632, so row
    # 5's repeats fall in different groups and its ~100 candidates take the half-width select);
    # v10b's lean select (row 5's full-width path streamed in two halves); v11's one kernel (the
    # lists do not exist there: rows 1, 3, 4 and 5 are its ties, bits and repeats).
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((6, 5000)).astype(np.float32)
    logits[5] = np.where(np.arange(5000) // 625 < 4, np.tile(logits[5, :625], 8), -10)
    logits[1] = np.round(logits[1] / 2) * 2
    logits[3] *= np.exp2(rng.integers(-60, 60, 5000)).astype(np.float32)
    kth = np.argsort(-logits[4])[99]
    logits[4, [4900, 3100, 2000, 1500]] = logits[4, kth]
    lens = jnp.asarray([5000, 4999, 1300, 5000, 5000, 5000], jnp.int32)
    logits[1, 4999:] = logits[2, 1300:] = np.nan  # past the rows' lengths: never selected
    got = np.asarray(pallas_topk.topk_positions(jnp.asarray(logits), lens, 100, chunk=256,
                                                interpret=True, **variant))
    for i in range(6):
      g = got[i][got[i] >= 0]
      assert len(set(g.tolist())) == len(g) == 100
      assert set(g.tolist()) == lowest_index_topk(logits[i], int(lens[i]), 100), i
    assert min(kth, 1500) in got[4] and not np.isin([2000, 3100, 4900], got[4]).any()
    # The rows' candidate counts: row 1 past the list (the row path), row 5 past half of it.
    params = pallas_topk.plgpu.CompilerParams(num_warps=4, num_stages=1)
    if variant.get("sectors"):
      maxima, sectors = pallas_topk.sector_maxima(jnp.asarray(logits), lens, 8, 632, 1024,
                                                  interpret=True)
      theta = pallas_topk.row_theta(maxima, 100, params, interpret=True)
      counts = pallas_topk.sector_candidates(theta, sectors, jnp.asarray(logits), lens, 632, 512,
                                             256, params, interpret=True)[2].sum(axis=1)
      assert counts[1] > 512, counts
      return
    maxima = pallas_topk.group_maxima(jnp.asarray(logits), lens, 8, 1024, interpret=True)
    theta = pallas_topk.row_theta(maxima, 100, params, interpret=True)
    slots = 8 if variant.get("per_lane") else 0
    counts = pallas_topk.threshold_candidates(theta, jnp.asarray(logits), lens, 512, 256, params,
                                              slots=slots, interpret=True)[2].sum(axis=1)
    assert counts[1] > 512 and 256 < counts[5] <= 512, counts

  def test_lane_slots_hold_the_candidates_or_overflow(self):
    # The per-lane threshold kernel (v3, `per_lane`) with 2 slots a lane (16
    # lanes, 32 segments of 64 positions: 4 a lane): a segment's list holds exactly its positions
    # with key >= theta, unless a lane had more than 2 (row 0, segment 0: positions 5, 21, 37 of
    # lane 5), which must mark it past cap; the select then still finds the exact top-k (the row
    # path). Row 1 ends inside a segment (2000 = 31 x 64 + 16).
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((2, 2048)).astype(np.float32)
    logits[0, [5, 21, 37]] = [10.0, 11.0, 12.0]
    logits[1, 2000:] = np.nan  # past row 1's length: never a candidate
    lens = jnp.asarray([2048, 2000], jnp.int32)
    x = jnp.asarray(logits)
    params = pallas_topk.plgpu.CompilerParams(num_warps=4, num_stages=1)
    theta = pallas_topk.row_theta(pallas_topk.group_maxima(x, lens, 4, 512, interpret=True), 100,
                                  params, interpret=True)
    keys, pos, counts = (np.asarray(a) for a in pallas_topk.threshold_candidates(
        theta, x, lens, 512, 16, params, slots=2, interpret=True))
    assert pallas_topk.threshold_segments(2, 2048, 16) == (32, 64) and counts.shape == (2, 32)
    bits = logits.view(np.int32)
    want_keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    inside = np.arange(2048) < np.asarray(lens)[:, None]
    taken = (want_keys >= np.asarray(theta)[:, None]) & inside
    per_lane = taken.reshape(2, 32, 4, 16).sum(axis=2)  # [row, segment, lane]
    assert per_lane[0, 0, 5] == 3
    for i, p in np.ndindex(2, 32):
      if (per_lane[i, p] > 2).any():
        assert counts[i, p] > 512, (i, p)
        continue
      n = taken[i, 64 * p:64 * (p + 1)].sum()
      assert counts[i, p] == n, (i, p)
      got_pos = pos[i, 512 * p:512 * p + n]
      np.testing.assert_array_equal(np.sort(got_pos), 64 * p + np.flatnonzero(
          taken[i, 64 * p:64 * (p + 1)]))
      np.testing.assert_array_equal(keys[i, 512 * p:512 * p + n], want_keys[i, got_pos])
    got = np.asarray(pallas_topk.select_positions(theta, jnp.asarray(keys), jnp.asarray(pos),
                                                  jnp.asarray(counts), x, lens, 100, 16, params,
                                                  interpret=True))
    for i in range(2):
      assert set(got[i].tolist()) == lowest_index_topk(logits[i], int(lens[i]), 100), i

  @pytest.mark.parametrize("t,s,k,chunk", [(5, 1000, 32, 64), (4, 2048, 64, 64),
                                            (3, 40000, 64, 16)],
                           ids=["masked", "unmasked", "spans"])
  def test_sector_candidates_are_the_positions_reaching_theta(self, t, s, k, chunk):
    # v9 (`sectors`), each kernel against numpy. "masked": S = 1000 with G = 4 groups of m8 = 256
    # (the maxima load masked past S), rows: 100 ties at the top (~100 candidates, the k-th's ties
    # bisected), empty, 997 long (not whole sectors; NaN past it), all equal (each of its 4
    # programs' candidates past cap: the row path), 20 long (fewer than k: every position a
    # candidate). "unmasked": S = 2048 = G x m8 (no mask on the load), rows full, 2047 long, empty,
    # 40 long. "spans": 167 programs a row of 50 sectors, 4 steps of 16 each (the others take
    # one); G = 128 groups of m8 = 320 in rows of 512 (sectors past m8 are padding); rows full,
    # 39999 long, 40 finite positions among -inf (fewer than k: theta INT_MIN, and no padding
    # sector may stand for positions of the next group row).
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((t, s)).astype(np.float32)
    lens = np.full(t, s, np.int32)
    if s == 1000:
      logits[0, :100] = 5.0
      logits[3] = 1.5
      lens[1:5] = [0, 997, 1000, 20]
    elif s == 2048:
      lens[1:4] = [2047, 0, 40]
    else:
      lens[1] = s - 1
      logits[2, rng.permutation(s)[40:]] = -np.inf
    # A row ending inside a sector has its largest visible value there (so the sector is read);
    # past the lengths: never a candidate (NaN, or larger values).
    ends = np.flatnonzero((lens % 8 > 0) & (lens < s))
    logits[ends, lens[ends] - 1] = 9.0
    logits[np.arange(s) >= lens[:, None]] = np.nan if s == 1000 else 10.0
    x, lens_j = jnp.asarray(logits), jnp.asarray(lens)
    g = pallas_topk.group_size(s, k)
    m8 = -(-(-(-s // g)) // 8) * 8  # cdiv(S, G) rounded up to whole sectors
    width = pallas_topk.next_pow2(m8)
    w8 = width // 8
    maxima, sectors = pallas_topk.sector_maxima(x, lens_j, g, m8, width, interpret=True)
    bits = logits.view(np.int32)
    selectable = (np.arange(s) < lens[:, None]) & (logits > -np.inf)  # NaN: False
    keys = np.where(selectable, bits ^ ((bits >> 31) & 0x7FFFFFFF), -2 ** 31)
    padded = np.pad(keys, ((0, 0), (0, g * m8 - s)), constant_values=-2 ** 31)
    grouped = padded.reshape(t, g, m8)
    # v16: both maxima written as their keys' top 16 bits, int16.
    high = lambda a: (a >> 16).astype(np.int16)
    assert maxima.dtype == sectors.dtype == jnp.int16
    np.testing.assert_array_equal(maxima, high(np.pad(
        grouped.max(axis=1), ((0, 0), (0, width - m8)), constant_values=-2 ** 31)))
    want_sectors = np.pad(grouped.reshape(t, g, m8 // 8, 8).max(axis=3),
                          ((0, 0), (0, 0), (0, w8 - m8 // 8)), constant_values=-2 ** 31)
    np.testing.assert_array_equal(sectors, high(want_sectors.reshape(t, g * w8)))
    params = pallas_topk.plgpu.CompilerParams(num_warps=4, num_stages=1)
    theta = np.asarray(pallas_topk.row_theta(maxima, k, params, interpret=True))
    # Theta fused with the maxima (many rows' form): the same theta and sectors.
    fused = pallas_topk.fused_sector_theta(x, lens_j, k, g, m8, params, interpret=True)
    np.testing.assert_array_equal(fused[0], theta)
    np.testing.assert_array_equal(fused[1], sectors)
    cap = pallas_topk.next_pow2(min(4 * k, s))
    cand_keys, cand_pos, counts = (np.asarray(a) for a in pallas_topk.sector_candidates(
        jnp.asarray(theta), sectors, x, lens_j, m8, cap, chunk, params, interpret=True))
    programs = pallas_topk.threshold_segments(t, s, chunk)[0]
    span = -(-g * w8 // programs)
    assert counts.shape == (t, programs)
    overflowed = 0
    for i, p in np.ndindex(t, programs):
      f = np.arange(p * span, min((p + 1) * span, g * w8))
      f = f[f % w8 < m8 // 8]
      pos = ((f // w8) * m8 + (f % w8) * 8)[:, None] + np.arange(8)
      pos = pos[pos < s]
      want = pos[(keys[i, pos] >= theta[i]) & (keys[i, pos] > -2 ** 31)]
      assert counts[i, p] == len(want), (i, p)
      if len(want) > cap:
        overflowed += 1
        continue
      got = cand_pos[i, p * cap:p * cap + len(want)]
      np.testing.assert_array_equal(np.sort(got), np.sort(want))
      np.testing.assert_array_equal(cand_keys[i, p * cap:p * cap + len(want)], keys[i, got])
    assert overflowed == (4 if s == 1000 else 0), overflowed  # row 3 of "masked" only
    got = np.asarray(pallas_topk.select_positions(jnp.asarray(theta), jnp.asarray(cand_keys),
                                                  jnp.asarray(cand_pos), jnp.asarray(counts), x,
                                                  lens_j, k, chunk, params, interpret=True))
    for i in range(t):
      g_i, want = got[i][got[i] >= 0], lowest_index_topk(logits[i], int(lens[i]), k)
      assert len(g_i) == len(want) and (got[i][len(g_i):] == -1).all(), i
      assert set(g_i.tolist()) == want, i

  @pytest.mark.parametrize("knobs", [RESIDENT, RESIDENT_INTERPOLATED],
                           ids=["bisect", "interpolate"])
  def test_row_resident_rows(self, knobs):
    # v11 (`row_resident`) at its widest rows (32768 positions, 16 warps in the GPU module), k =
    # 2048: a random row (the search stops at a threshold exactly k keys reach); one value
    # everywhere (32768 ties: their ranks fill the cumsum's high 16 bits, the sum past INT_MAX);
    # a few values (the search runs to the last bit, ties at v ranked); exactly k visible (no
    # pass); a window ending off any power of two with NaN past it and -inf inside; the k-th
    # value tied at 5 positions, one of which fits (the lowest); a row of one value above the
    # rest at the end of the window. And k = 32768 on rows of 32768: every visible key.
    rng = np.random.default_rng(13)
    s, k = 32768, 2048
    logits = rng.standard_normal((7, s)).astype(np.float32)
    logits[1] = 1.0
    logits[2] = np.round(logits[2] * 4) / 4
    logits[4, 20001:] = np.nan
    logits[4, rng.random(s) < 0.3] = -np.inf
    kth = np.argsort(-logits[5])[k - 1]
    logits[5, [30000, 20000, 10000, 9000]] = logits[5, kth]
    logits[6, :-1] = -1.0
    logits[6, -1] = 1.0
    lens = np.array([s, s, s, k, 20001, s, s], np.int32)
    x, lens_j = jnp.asarray(logits), jnp.asarray(lens)
    for topk in (k, s):
      got = np.asarray(pallas_topk.topk_positions(x, lens_j, topk, interpret=True, **knobs))
      for i in range(7):
        g, want = got[i][got[i] >= 0], lowest_index_topk(logits[i], int(lens[i]), topk)
        assert len(g) == len(want) and (got[i][len(g):] == -1).all(), (topk, i)
        assert set(g.tolist()) == want, (topk, i)

  def test_interpolated_search_finds_the_kth_largest(self):
    # v11b's search in plain JAX against numpy: random, tied (the largest value too), wide-exponent
    # and mostly-INT_MIN keys, k from 1 to all valid keys less one: the k-th largest key, or a
    # threshold exactly k keys reach (n == k).
    rng = np.random.default_rng(14)

    def search(keys, k):
      valid = keys > -2 ** 31
      count = lambda threshold: (keys >= threshold).astype(jnp.int32).sum()
      return pallas_topk._interpolated_search(count, k, jnp.where(valid, keys, 2 ** 31 - 1).min(),
                                              keys.max(), valid.astype(jnp.int32).sum())

    search = jax.jit(search, static_argnums=1)
    for trial in range(32):
      x = rng.standard_normal(512).astype(np.float32)
      if trial % 4 == 1:  # ties, the largest value 4 times
        x = np.round(x * 2) / 2
        x[:4] = 9.0
      elif trial % 4 == 2:
        x *= np.exp2(rng.integers(-60, 60, x.shape)).astype(np.float32)
      bits = x.view(np.int32)
      keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
      if trial % 4 == 3:
        keys[rng.random(keys.shape) < 0.8] = -2 ** 31
      n_valid = int((keys > -2 ** 31).sum())
      ordered = np.sort(keys)[::-1]
      for k in {1, 2, n_valid // 3, n_valid - 1} - {0}:
        v, n = (int(a) for a in search(jnp.asarray(keys), k))
        reach = int((keys >= v).sum())
        if n == k:
          assert reach == k and ordered[k] < v <= ordered[k - 1], (trial, k)
        else:
          assert v == ordered[k - 1], (trial, k, v, ordered[k - 1])

  @pytest.mark.parametrize("interpolate", [False, True], ids=["bisect", "interpolate"])
  @pytest.mark.parametrize("lean", [False, True], ids=["held", "lean_select"])
  def test_select_full_width_candidates(self, lean, interpolate):
    # The select's full-width path (more than cap / 2 candidates; v10b streams it in two halves)
    # on a list whose largest keys come last: 400 candidates of 512 places in ascending order, k =
    # 20 (the k-th largest past 2.0: no leading bits in common with the first half's keys).
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((1, 4096)).astype(np.float32)
    bits = logits.view(np.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF))[0]
    order = np.argsort(keys)[-400:]  # ascending
    cand_keys = np.full((1, 512), -2 ** 31, np.int32)
    cand_pos = np.zeros((1, 512), np.int32)
    cand_keys[0, :400], cand_pos[0, :400] = keys[order], order
    params = pallas_topk.plgpu.CompilerParams(num_warps=4, num_stages=1)
    got = np.asarray(pallas_topk.select_positions(
        jnp.asarray(keys[order[:1]]), jnp.asarray(cand_keys), jnp.asarray(cand_pos),
        jnp.asarray([[400]], jnp.int32), jnp.asarray(logits), jnp.asarray([4096], jnp.int32), 20,
        16, params, lean=lean, interpolate=interpolate, interpret=True))
    assert set(got[0].tolist()) == lowest_index_topk(logits[0], 4096, 20)

  def test_group_maxima_match_xla(self):
    # Rows of several lengths (one empty, one not a multiple of anything), G = 4 strided groups;
    # the oracle: keys of the window padded to G rows of m, the maximum over the G rows, its top
    # 16 bits (v16: int16, all theta reads).
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)
    lens = np.array([1000, 0, 777], np.int32)
    got = pallas_topk.group_maxima(jnp.asarray(logits), jnp.asarray(lens), 4, 256, tile=256,
                                   interpret=True)
    bits = logits.view(np.int32)
    keys = np.where(np.arange(1000) < lens[:, None], bits ^ ((bits >> 31) & 0x7FFFFFFF), -2 ** 31)
    want = np.pad(keys.reshape(3, 4, 250).max(axis=1), ((0, 0), (0, 6)), constant_values=-2 ** 31)
    assert got.dtype == jnp.int16
    np.testing.assert_array_equal(got, (want >> 16).astype(np.int16))

  @staticmethod
  def lowered_topk_modules(monkeypatch, t, s, knobs, paged=False):
    """The top-k with `knobs` at [t, s] (topk 2048; paged: with block tables, the slots too),
    lowered to Triton IR for compute capability
    9.0 on this CPU (the lowering asks the device for it; there is none here): the StableHLO
    text, and each kernel's (module verified, module text) by kernel name. The GPU's Triton parser
    refuses a module that does not verify: session 12's v7 failed so on the GPU, a select of two
    constants typed i1. The four-kernel path unless `knobs` name row_resident (v11b's one kernel
    is the default from 16384 positions)."""
    from jax._src.pallas.triton import lowering, pallas_call_registration
    knobs = {"row_resident": False, **knobs}
    gpu_info = pallas_call_registration.gpu_info_lib  # its module moved in jax 0.12.1
    hopper = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: hopper)
    modules = {}

    def lower_and_verify(*args, lower=lowering.lower_jaxpr_to_triton_module, **kwargs):
      result = lower(*args, **kwargs)
      name = result.module.body.operations[0].attributes["sym_name"].value
      modules[name] = (result.module.operation.verify(), str(result.module))
      return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module",
                        lower_and_verify)
    args = [jax.ShapeDtypeStruct((t, s), jnp.float32), jax.ShapeDtypeStruct((t,), jnp.int32)]
    if paged:  # the selection's slots too, through 64-token blocks
      knobs = {**knobs, "block_size": 64, "num_blocks": 4 * s // 64}
      args.append(jax.ShapeDtypeStruct((t, s // 64), jnp.int32))
    traced = jax.jit(lambda x, lens, *tables: pallas_topk.topk_positions(
        x, lens, 2048, **({"block_tables": tables[0]} if tables else {}), **knobs)).trace(*args)
    return traced.lower(lowering_platforms=("cuda",)).as_text(), modules

  @pytest.mark.parametrize("t,s,knobs,last", [
      (128, 32768, RESIDENT_INTERPOLATED, "topk_resident_slots"),
      (128, 131072, SECTORS, "topk_select_slots"),
      (4096, 32768, SECTORS_FUSED_LEAN_INTERPOLATED, "topk_select_slots")])
  def test_slots_lower_for_hopper(self, monkeypatch, t, s, knobs, last):
    # With block tables the last kernel (v11's, or the select) also maps the positions to slots
    # after a block barrier: each module verified.
    text, modules = self.lowered_topk_modules(monkeypatch, t, s, knobs, paged=True)
    assert last in modules and all(ok for ok, _ in modules.values()), modules
    assert "gpu.barrier" in modules[last][1]

  @pytest.mark.parametrize("interpolate", [False, True], ids=["bisect", "interpolate"])
  @pytest.mark.parametrize("t,s", [(128, 32768), (4096, 32768), (128, 16384), (6, 5000)])
  def test_row_resident_lowers_for_hopper(self, monkeypatch, t, s, interpolate):
    # v11 (`row_resident`) at the benchmark's shapes up to its limit and at short rows: one
    # kernel, its module verified; the logits load carries the hint that keeps it in the layout of
    # the positions' stores (no 32768-pointer conversion through shared memory).
    text, modules = self.lowered_topk_modules(monkeypatch, t, s,
                                              {**RESIDENT, "interpolate": interpolate})
    assert text.count("__gpu$xla.gpu.triton") == 1 and sorted(modules) == ["topk_resident"]
    assert modules["topk_resident"][0], modules
    assert "tt.divisibility = dense<1>" in modules["topk_resident"][1]

  def test_per_lane_lowers_for_hopper(self, monkeypatch):
    # v3's per-lane threshold (no shape's default: kept selectable) at 128 x 131072
    # (`lowered_topk_modules`): four kernels, each module verified.
    text, modules = self.lowered_topk_modules(monkeypatch, 128, 131072,
                                              {"per_lane": True, "sectors": False})
    names = ["topk_maxima", "topk_theta", "topk_threshold_lanes", "topk_select"]
    assert text.count("__gpu$xla.gpu.triton") == len(names) and sorted(modules) == sorted(names)
    assert all(ok for ok, _ in modules.values()), modules

  @pytest.mark.parametrize("t,s,knobs", [
      (4096, 32768, {**SECTORS_FUSED_LEAN, "select_warps": 8}), (6, 5000, {"lean_select": True}),
      (128, 131072, {**SECTORS, "interpolate": True}),
      (4096, 32768, SECTORS_FUSED_LEAN_INTERPOLATED), (6, 5000, INTERPOLATED)],
      ids=["select_warps8", "short", "interpolate_long", "interpolate_many", "interpolate_short"])
  def test_four_kernel_forms_lower_for_hopper(self, monkeypatch, t, s, knobs):
    # v10b's lean select at 8 warps with many rows' other knobs, and with short rows' (theta
    # apart); v12's interpolating select in few long rows', many rows' and short rows' forms: each
    # module verified. v10b at 4 warps (SECTORS_FUSED_LEAN at 4096 x 32768) is
    # test_sectors_lowers_for_hopper[4096-32768-sectors_fused]'s program (lean_select None picks
    # DEFAULT_MANY_ROWS' True there: equal jaxprs), whose checks include these.
    text, modules = self.lowered_topk_modules(monkeypatch, t, s, knobs)
    first = (["topk_sector_maxima_theta"] if knobs.get("fused_theta") else
             ["topk_sector_maxima" if knobs.get("sectors") else "topk_maxima", "topk_theta"])
    names = first + ["topk_sector_threshold" if knobs.get("sectors") else "topk_threshold",
                     "topk_select"]
    assert text.count("__gpu$xla.gpu.triton") == len(names) and sorted(modules) == sorted(names)
    assert all(ok for ok, _ in modules.values()), modules

  @pytest.mark.parametrize("rows,positions,want", [
      (128, 131072, "DEFAULT_LONG_ROWS"), (128, 32768, "DEFAULT_LONG_ROWS"),
      (128, 16384, "DEFAULT"), (4096, 32768, "DEFAULT_MANY_ROWS"), (128, 8192, "DEFAULT"),
      (4096, 65536, "DEFAULT_MANY_ROWS")])
  def test_default_config(self, rows, positions, want, monkeypatch):
    # The four-kernel path: few rows from 32768 positions and many rows (theta fused) take v9's
    # sector threshold (H200, session 13: faster at 131072 and at 4096 rows, equal at 32768); the
    # H200's 132 SMs.
    monkeypatch.setattr(pallas_topk, "sm_count", lambda: 132)
    four = getattr(pallas_topk, want)
    assert pallas_topk.four_kernel_config(rows, positions) == four
    # v11b's one kernel a row (row_resident, interpolating; session 15: 1.06-1.6x at 16 to 4096
    # rows of 32768 and 16 to 512 of 16384) from 16384 to RESIDENT_MAX positions, the four-kernel
    # fields of the shape kept (row_resident=False alone gives that path back); else that path.
    resident = pallas_topk.RESIDENT_MAX >= positions >= 16384
    want_config = (dataclasses.replace(four, row_resident=True, interpolate=True) if resident
                   else four)
    assert pallas_topk.default_config(rows, positions) == want_config
    assert pallas_topk.DEFAULT_LONG_ROWS.sectors and pallas_topk.DEFAULT_MANY_ROWS.sectors
    assert pallas_topk.DEFAULT_MANY_ROWS.fused_theta and not pallas_topk.DEFAULT.sectors
    # v10b's streamed full-width select for many rows (session 14: 1.06x at 4096 x 32768).
    assert pallas_topk.DEFAULT_MANY_ROWS.lean_select
    assert not pallas_topk.DEFAULT_LONG_ROWS.lean_select
    # v12's interpolating select for many rows (session 25: 1.09x at 4096 x 32768, equal at 128).
    assert pallas_topk.DEFAULT_MANY_ROWS.interpolate
    assert not (pallas_topk.DEFAULT_LONG_ROWS.interpolate or pallas_topk.DEFAULT.interpolate)

  @pytest.mark.parametrize("fused", [False, True], ids=["sectors", "sectors_fused"])
  @pytest.mark.parametrize("t,s", [(128, 131072), (128, 32768), (4096, 32768), (6, 5000)])
  def test_sectors_lowers_for_hopper(self, monkeypatch, t, s, fused):
    # The v9 top-k (`sectors`, theta apart or fused) at the benchmark's shapes and at 5000
    # positions (G = 1: one group row of m8 = 5000 in 8192): four kernels (three fused), each
    # module verified; the sector maxima's logits load takes a mask only where a tile can reach
    # past S or m8; the threshold's sector maxima load carries the hint that keeps it in the
    # stores' layout.
    text, modules = self.lowered_topk_modules(monkeypatch, t, s,
                                              SECTORS_FUSED if fused else SECTORS)
    first = ["topk_sector_maxima_theta"] if fused else ["topk_sector_maxima", "topk_theta"]
    names = first + ["topk_sector_threshold", "topk_select"]
    assert text.count("__gpu$xla.gpu.triton") == len(names) and sorted(modules) == sorted(names)
    assert all(ok for ok, _ in modules.values()), modules
    loads = [line for line in modules[first[0]][1].splitlines()
             if "tt.load" in line and "x!tt.ptr<f32>" in line]
    assert len(loads) == 1 and ("," in loads[0].split(":")[0]) == (s == 5000), loads
    assert "tt.divisibility = dense<1>" in modules["topk_sector_threshold"][1]

  def test_group_size(self):
    # At least 4k strided groups, G a power of two; V3.2 at 128K and 32K context.
    assert pallas_topk.group_size(131072, 2048) == 16
    assert pallas_topk.group_size(32768, 2048) == 4
    assert pallas_topk.group_size(12000, 2048) == 1
    assert pallas_topk.group_size(300, 64) == 1

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "logits": a["logits"][0]}, "want logits"),
      (lambda a: {**a, "logits": a["logits"].astype(jnp.bfloat16)}, "float32"),
      (lambda a: {**a, "topk": 0}, "topk"),
      (lambda a: {**a, "topk": True}, "topk"),
      (lambda a: {**a, "chunk": 100}, "chunk"),
      (lambda a: {**a, "per_lane": 1}, "per_lane"),
      (lambda a: {**a, "sectors": 1}, "sectors"),
      (lambda a: {**a, "sectors": True, "per_lane": True}, "no per_lane"),
      (lambda a: {**a, "lean_select": 1}, "lean_select must be a bool"),
      (lambda a: {**a, "row_resident": 1}, "row_resident must be a bool"),
      (lambda a: {**a, "interpolate": 1}, "interpolate must be a bool"),
      (lambda a: {**a, "logits": jnp.zeros((2, 32769), jnp.float32), "row_resident": True},
       "row_resident takes rows of at most 32768"),
  ])
  def test_topk_bad_input_raises(self, change, message):
    args = dict(logits=jnp.zeros((2, 64), jnp.float32), seq_lens=jnp.ones((2,), jnp.int32), topk=8)
    with pytest.raises(ValueError, match=message):
      pallas_topk.topk_positions(**change(args), interpret=True)


def mosaic_indexer_case(seed, t, nb=12, mb=8, shared=False, lens=None):
  """e4m3 q, weights, keys, ue8m0-like scales, tables (row 0's for all when shared; one column
  -1). With lens, every key no row sees (pages no table names, positions past the windows, also
  inside a fetched tile) holds NaN in its values and its scale."""
  rng = np.random.default_rng(seed)
  k_vals = jnp.asarray(rng.standard_normal((nb, 64, 128)) * 3, jnp.float8_e4m3fn)
  k_scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (nb, 64)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((t, 64, 128)) * 3, jnp.float8_e4m3fn)
  w = jnp.asarray(rng.standard_normal((t, 64)), jnp.float32)
  tables = np.stack([rng.permutation(nb)[:mb] for _ in range(t)]).astype(np.int32)
  if shared:
    tables[:] = tables[0]
  tables[:, mb - 2] = -1  # inside some windows: -inf there, never read
  if lens is not None:
    seen = np.zeros((nb, 64), bool)
    for row, n in zip(tables, lens):
      for p, block in enumerate(row):
        if block >= 0:
          seen[block, :max(0, min(64, n - p * 64))] = True
    k_vals = jnp.where(seen[..., None], k_vals.astype(jnp.float32), jnp.nan).astype(k_vals.dtype)
    k_scale = jnp.where(seen, k_scale, jnp.nan)
  return q, w, k_vals, k_scale, jnp.asarray(tables)


def assert_logits_close(got, want):
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  assert not np.isnan(got).any()
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-4)


class TestPallasMosaicIndexer(IndexerContract):
  backend = "pallas_mosaic"

  # Lengths not a multiple of a step, rows that see nothing, pages behind -1, NaN in every key no
  # row sees (row 0's last tile is fetched with 12 of them); several programs per row (chunk 256);
  # rows=4 groups (shared tables, 5 rows: one padded group whose program has 3 steps, so the
  # pairs end unevenly) and rows=1; compute_wgs=4 splits each rows=4 step over two warpgroups.
  @pytest.mark.parametrize("rows,lens,compute_wgs", [
      (1, [300, 70, 0, 512, 1], None),
      pytest.param(4, [500, 450, 1, 0, 129], None, id="rows4"),
      pytest.param(4, [500, 450, 1, 0, 129], 4, id="rows4-w4")])
  def test_rows_and_chunks_match_reference(self, rows, lens, compute_wgs):
    q, w, k_vals, k_scale, tables = mosaic_indexer_case(20 + rows, 5, shared=rows == 4, lens=lens)
    lens = jnp.asarray(lens, jnp.int32)
    got = mosaic_indexer.indexer_logits(q, w, k_vals, k_scale, tables, lens, rows=rows, chunk=256,
                                        compute_wgs=compute_wgs, interpret=True)
    assert_logits_close(got, reference.indexer_logits(q, w, k_vals, k_scale, tables, lens))

  @pytest.mark.parametrize("shared", [pytest.param(True, id="shared"),
                                      False])
  def test_variant_chosen_by_tables(self, shared):
    # rows=None: groups of 4 rows with one table take rows=4, else rows=1; both exact here.
    q, w, k_vals, k_scale, tables = mosaic_indexer_case(30, 4, nb=8, mb=4, shared=shared)
    lens = jnp.asarray([256, 200, 65, 0], jnp.int32)
    assert bool(mosaic_indexer.groups_share_tables(tables)) == shared
    got = mosaic_indexer.indexer_logits(q, w, k_vals, k_scale, tables, lens, interpret=True)
    assert_logits_close(got, reference.indexer_logits(q, w, k_vals, k_scale, tables, lens))

  def test_distinct_tables_skips_the_table_check(self):
    # distinct_tables=True: the one-row kernel alone; False: groups_share_tables and a lax.cond
    # between the 4-row and 1-row kernels, outside them (the kernels' bodies have conds of their
    # own, so the walk stops at them).
    def outside(jaxpr):
      names = []
      for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name not in ("pallas_call", "custom_vmap_call"):
          for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += outside(sub)
      return names

    s = jax.ShapeDtypeStruct
    args = (s((8, 64, 128), jnp.float8_e4m3fn), s((8, 64), jnp.float32),
            IndexerKCache(s((16, 64, 128), jnp.float8_e4m3fn), s((16, 64), jnp.float32)),
            s((8, 4), jnp.int32), s((8,), jnp.int32))
    traced = lambda hint: jax.make_jaxpr(functools.partial(
        self.be().indexer_logits, distinct_tables=hint))(*args)
    checked, distinct = traced(False), traced(True)
    assert "cond" in outside(checked.jaxpr) and "reduce_and" in outside(checked.jaxpr)
    assert not {"cond", "reduce_and"} & set(outside(distinct.jaxpr))
    assert "_r4_" in str(checked) and "_r4_" not in str(distinct) and "_r1_" in str(distinct)

  @pytest.mark.parametrize("t,ctx,rows,compute_wgs", [
      (2048, 32768, None, None), (128, 131072, 1, None), (5, 4096, 4, None), (2048, 32768, 4, 4)])
  def test_lowers_for_hopper(self, t, ctx, rows, compute_wgs):
    # Lowering for CUDA (it runs on this CPU) checks wgmma operand layouts, bulk-copy boxes and
    # that shared memory fits, which the interpreter does not.
    s = jax.ShapeDtypeStruct
    pages = ctx // 64
    args = (s((t, 64, 128), jnp.float8_e4m3fn), s((t, 64), jnp.float32),
            s((4 * pages, 64, 128), jnp.float8_e4m3fn), s((4 * pages, 64), jnp.float32),
            s((t, pages), jnp.int32), s((t,), jnp.int32))
    traced = mosaic_indexer.indexer_logits.trace(*args, rows=rows, compute_wgs=compute_wgs)
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()

  def test_register_split_fits_the_launch(self):
    # setmaxnreg.inc past the registers the launch gave the block waits forever (the interpreter
    # does not model registers): compute_wgs + 1 warpgroups.
    for wgs, (compute, memory) in mosaic_indexer._REGS.items():
      assert wgs * compute + memory <= register_pool(wgs + 1)
      assert compute % 8 == 0 and memory % 8 == 0 and memory >= 24
    assert {cfg.compute_wgs for _, cfg in mosaic_indexer.SWEEP} == set(mosaic_indexer._REGS)
    with pytest.raises(ValueError, match="compute_wgs"):
      mosaic_indexer.MosaicIndexerConfig(64, 2048, 4, compute_wgs=3)

  def test_backend_falls_back_where_the_kernel_does_not_fit(self):
    f8 = jnp.float8_e4m3fn
    assert mosaic_indexer.fits(jnp.zeros((1, 64, 128), f8), jnp.zeros((1, 64, 128), f8))
    assert not mosaic_indexer.fits(jnp.zeros((1, 64, 128), jnp.bfloat16),
                                   jnp.zeros((1, 64, 128), jnp.bfloat16))
    assert not mosaic_indexer.fits(jnp.zeros((1, 64, 128), f8), jnp.zeros((1, 16, 128), f8))

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "weights": a["weights"][:, :2]}, "want q"),
      (lambda a: {**a, "q": a["q"].astype(jnp.bfloat16)}, "float8_e4m3fn"),
      (lambda a: {**a, "q": jnp.zeros((2, 128, 128), jnp.float8_e4m3fn),
                  "weights": jnp.zeros((2, 128), jnp.float32)}, "at most 64 heads"),
      (lambda a: {**a, "q": a["q"][..., :64], "k_values": a["k_values"][..., :64]}, "128 dims"),
      (lambda a: {**a, "k_values": a["k_values"][:, :32], "k_scales": a["k_scales"][:, :32]},
       "multiple of 64"),
      (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "rows": 2}, "rows"),
      (lambda a: {**a, "chunk": 100}, "chunk"),
      (lambda a: {**a, "compute_wgs": 3}, "compute_wgs must be"),
      (lambda a: {**a, "rows": 1, "compute_wgs": 4}, "needs rows=4"),
      (lambda a: {**a, "compute_wgs": 4}, "needs rows=4"),  # rows=None may pick rows=1
  ])
  def test_bad_input_raises(self, change, message):
    args = dict(q=jnp.zeros((2, 64, 128), jnp.float8_e4m3fn),
                weights=jnp.zeros((2, 64), jnp.float32),
                k_values=jnp.zeros((3, 64, 128), jnp.float8_e4m3fn),
                k_scales=jnp.ones((3, 64), jnp.float32), block_tables=jnp.zeros((2, 3), jnp.int32),
                seq_lens=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match=message):
      mosaic_indexer.indexer_logits(**change(args), interpret=True)


def poisoned_case(seed, n, kind, lora=L, t=4, k=80, nb=6, edit=None):
  """bf16 q, a cache whose rows no slot selects hold NaN, and slots with -1, past-the-cache entries
  and a row (1) that selects nothing; edit(slots) changes them in place before the cache is
  poisoned. Returns (q, cache, slots, dequantized rows [S, L+R])."""
  rng = np.random.default_rng(seed)
  bs = 16
  num_slots = nb * bs
  slots = random_slots(rng, t, k, num_slots)
  slots[1] = -1
  if edit is not None:
    edit(slots)
  unused = np.ones(num_slots, bool)
  unused[slots[(slots >= 0) & (slots < num_slots)]] = False
  # Per-row and per-tile magnitudes 20x apart, so a scale applied to the wrong tile or row shows.
  kv = (rng.standard_normal((num_slots, lora)) * rng.uniform(0.1, 2, (num_slots, 1))
        * np.repeat(rng.uniform(0.1, 2, (1, lora // 128)), 128, 1)).astype(np.float32)
  pe = rng.standard_normal((num_slots, R)).astype(np.float32)
  cache, rows = poisoned_cache(kind, kv, pe, unused, nb, bs)
  q = jnp.asarray(rng.standard_normal((t, n, lora + R)), jnp.bfloat16)
  return q, cache, slots, rows


def poisoned_cache(kind, kv, pe, unused, nb, bs):
  """A bf16 LatentCache or a DSMLACache [nb, bs] of the rows [kv | pe] (float32 [S, lora] and
  [S, R]), NaN in the rows `unused` marks; returns it and the rows [S, lora + R] as it holds them
  (bf16-rounded, or dequantized)."""
  num_slots = kv.shape[0]
  if kind == "bf16":
    rows = np.asarray(jnp.asarray(np.concatenate([kv, pe], 1), jnp.bfloat16).astype(jnp.float32))
    cache = LatentCache(jnp.asarray(np.where(unused[:, None], np.nan, rows).reshape(nb, bs, -1),
                                    jnp.bfloat16), jnp.float32(1.0))
    return cache, rows
  c = DSMLACache.allocate(nb, bs, kv.shape[1], pe.shape[1]).write(
      jnp.asarray(kv), jnp.asarray(pe), jnp.arange(num_slots, dtype=jnp.int32))
  rows = np.asarray(c.dequantize_rows(jnp.arange(num_slots, dtype=jnp.int32)), np.float32)
  poison = jnp.asarray(unused.reshape(nb, bs))[..., None]
  cache = DSMLACache(
      jnp.where(poison, jnp.nan, c.nope.astype(jnp.float32)).astype(c.nope.dtype),
      jnp.where(poison, jnp.nan, c.tile_scales),
      jnp.where(poison, jnp.nan, c.rope.astype(jnp.float32)).astype(jnp.bfloat16))
  return cache, rows


def assert_matches_oracle(o, lse, q, rows, slots, num_slots, lora):
  """A poisoned case's (o, lse) at scale 0.05 against the float64 oracle on the rows' true values:
  row 1 selects nothing (0, -inf), the others within bf16 tolerances (cosine, then per element)."""
  qf = np.asarray(q.astype(jnp.float32))
  o_ref, lse_ref = sparse_np(qf, lambda s: rows[s].astype(np.float64), slots, num_slots, 0.05,
                             lora)
  o, lse = np.asarray(o.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
  assert np.isfinite(o).all()
  np.testing.assert_array_equal(lse[1], -np.inf)
  np.testing.assert_array_equal(o[1], 0.0)
  assert cosine_diff(o, o_ref) < 1e-5
  np.testing.assert_allclose(o, o_ref, rtol=2 / 128, atol=1e-2)
  seen = lse_ref > -np.inf
  np.testing.assert_allclose(lse[seen], lse_ref[seen], rtol=1e-4, atol=1e-4)


def test_mosaic_sparse_register_split_fits_the_launch():
  # setmaxnreg.inc past the registers the block holds waits forever (the fp8_ds_mla path's H200
  # hang with (224, 64)), and the interpreter does not model registers.
  for consumer, memory in mosaic_sparse._REGS.values():
    assert 2 * consumer + memory <= register_pool(3) == 504
    assert consumer % 8 == 0 and memory % 8 == 0


def test_mosaic_sparse_wide_widening_bits_are_todays():
  # wide_widening's lane code (`wide_widening_model`) against today's widening (e4m3 -> f32,
  # times the tile scale, rounded to bf16), bit for bit, for all 256 bytes: power-of-two scales
  # up to 2^7 and other bf16 scales take the bit placement (e4m3 subnormals included), larger or
  # non-bf16 scales (vLLM's amax / 448) today's conversion; only the e4m3 NaN bytes differ.
  e4m3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).reshape(64, 4)
  words = e4m3.view(np.uint32)[:, 0]  # bytes 4w to 4w + 3, the first in the low byte
  nan = np.isnan(e4m3.astype(np.float32))
  fast = [2.0 ** e for e in range(-40, 8)] + [-1.0, 0.0, 1.5, 0.75, 96.0, -2.0 ** -3]
  slow = [2.0 ** 8, 2.0 ** 20, 2.0 ** 100, 0.3, 57344.0 / 448 / 3, 1e-3, 200.0]
  for scale, want_fast in [(s, True) for s in fast] + [(s, False) for s in slow]:
    scales = np.full(words.shape, scale, np.float32)
    assert bool(mosaic_lanes.wide_fast_scale(scales[0])) == want_fast, scale
    got = mosaic_lanes.wide_widening_model(words, scales).astype(np.float32)
    want = (e4m3.astype(np.float32) * np.float32(scale)).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32),
                                  err_msg=f"scale {scale}")
    if want_fast:  # the NaN bytes: 480 x scale (exponent and mantissa all ones)
      np.testing.assert_array_equal(np.abs(got[nan]), np.float32(jnp.bfloat16(480 * abs(scale))))


@pytest.mark.parametrize("t,tiles,want_fill,want_one_wave", [
    (128, 1, 4, 1), (128, 2, 2, 1), (64, 1, 4, 2), (4096, 2, 1, 1), (1, 1, 4, 132)])
def test_mosaic_sparse_split_rules(t, tiles, want_fill, want_one_wave):
  # "one_wave": one resident program a SM, so splits only fill SMs that tokens x tiles leave idle.
  # (_sparse_call caps either at one step a split: 32 for 2048 slots.)
  assert mosaic_sparse.split_count("fill", t, tiles, 2048, 132) == want_fill
  assert mosaic_sparse.split_count("one_wave", t, tiles, 2048, 132) == want_one_wave


@pytest.mark.parametrize("t,n,num_splits,split_rule,gather,want", [
    # Timed on the H200 (RESULTS v11): 4096 tokens (4096-8192 programs, 1 split) "in_place";
    # 128 tokens (128-256 programs, 1 split under "one_wave") "half_rows".
    (4096, 128, None, "one_wave", "cp_async", "in_place"),
    (4096, 32, None, "one_wave", "cp_async", "in_place"),
    (128, 128, None, "one_wave", "cp_async", "in_place"),
    (128, 16, None, "one_wave", "cp_async", "in_place"),
    # Few tokens: the split rules split the slot lists ("one_wave" at 1 token, "fill" below 132
    # x 2 programs), which keeps "half_rows".
    (1, 16, None, "one_wave", "cp_async", "half_rows"),
    (263, 64, None, "fill", "cp_async", "half_rows"),
    (264, 64, None, "fill", "cp_async", "in_place"),
    # An explicit split count is the one the rule sees: several keep "half_rows", one gives
    # "in_place"; the bulk gather has no "in_place".
    (4096, 128, 2, "one_wave", "cp_async", "half_rows"),
    (4096, 128, 1, "one_wave", "cp_async", "in_place"),
    (128, 128, 1, "one_wave", "cp_async", "in_place"),
    (4096, 128, None, "one_wave", "bulk", "half_rows"),
])
def test_mosaic_sparse_default_fp8_pipeline(t, n, num_splits, split_rule, gather, want):
  assert mosaic_sparse.default_fp8_pipeline(t, n, 2048, num_splits=num_splits,
                                            split_rule=split_rule, gather=gather) == want


@pytest.mark.parametrize("t,want,splits", [(4096, "in_place", 1), (128, "in_place", 1),
                                           (32, "half2", 2)])
def test_mosaic_sparse_default_fp8_pipeline_reaches_the_kernel(t, want, splits):
  # fp8_pipeline=None resolves in the jit entry, so the default call traces the same program as
  # the explicit pipeline, and pallas_mosaic's backend (which names no pipeline) runs it too. The
  # kernel's name in the jaxpr says which it is (the interpreter, on this CPU, gathers in bulk).
  q = jax.ShapeDtypeStruct((t, 128, L + R), jnp.bfloat16)
  cache = DSMLACache(jax.ShapeDtypeStruct((512, 64, L), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((512, 64, L // 128), jnp.float32),
                     jax.ShapeDtypeStruct((512, 64, R), jnp.bfloat16))
  slots = jax.ShapeDtypeStruct((t, 2048), jnp.int32)
  entry = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, scale=0.1)
  pipeline = "in_place" if want == "in_place" else "half_rows"
  args = (q, cache.nope, cache.tile_scales, cache.rope, slots)
  default = str(jax.make_jaxpr(entry)(*args))
  prep = "_prep" if t <= mosaic_sparse.FP8_PREP_MAX_ROWS else ""  # (XLA's prep past it)
  assert f"mosaic_sparse_ds_mla_{want}{prep}_wide_cp_async_s{splits}" in default
  assert default == str(jax.make_jaxpr(functools.partial(entry, fp8_pipeline=pipeline))(*args))
  backend = functools.partial(backends.get_backend("pallas_mosaic").sparse_attention, scale=0.1,
                              kv_lora_rank=L)
  through_backend = str(jax.make_jaxpr(backend)(q, cache, slots))
  assert f"mosaic_sparse_ds_mla_{want}{prep}_wide_bulk_s{splits}" in through_backend


@pytest.mark.parametrize("t,n,fp8,num_splits,want", [
    # Timed on the H200 (RESULTS v12 timed, session 11), T=128: bf16 "n" 1.01x "m" at 16 heads,
    # 1.07x at 32; fp8_ds_mla mixed (in_place "n" 1.05x at 16, 0.95x at 32): "m". Several splits
    # (T=64 splits in 2 by the one-wave rule, or named): "m", the only one that stores them.
    (128, 16, False, None, "n"), (128, 32, False, None, "n"), (128, 4, False, None, "n"),
    (128, 27, False, None, "n"), (4096, 32, False, None, "n"), (64, 16, False, 1, "n"),
    (64, 16, False, None, "m"), (64, 32, False, None, "m"), (128, 16, False, 2, "m"),
    (128, 33, False, None, "m"), (128, 64, False, None, "m"), (128, 128, False, None, "m"),
    (128, 16, True, None, "m"), (128, 32, True, None, "m"), (128, 128, True, None, "m")])
def test_mosaic_sparse_default_heads_in(t, n, fp8, num_splits, want):
  assert mosaic_sparse.default_heads_in(t, n, 2048, fp8=fp8, num_splits=num_splits,
                                        split_rule=mosaic_sparse.CONFIG.split_rule) == want


@pytest.mark.parametrize("t,prep", [
    (128, True), (mosaic_sparse.FP8_PREP_MAX_ROWS, True),
    (mosaic_sparse.FP8_PREP_MAX_ROWS + 1, False), (4096, False)])
def test_mosaic_sparse_fp8_ds_mla_default_prep_by_rows(t, prep):
  # prep_in_kernel=None with fp8_ds_mla: in the kernel for decode rows, XLA's slot prep and scale
  # gather past FP8_PREP_MAX_ROWS (session 14: 1.04-1.07x at T=1024 and 4096 over 32K).
  nb = (1 << 14) // 64
  args = (jax.ShapeDtypeStruct((t, 128, L + R), jnp.bfloat16),
          jax.ShapeDtypeStruct((nb, 64, L), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((nb, 64, L // 128), jnp.float32),
          jax.ShapeDtypeStruct((nb, 64, R), jnp.bfloat16),
          jax.ShapeDtypeStruct((t, 2048), jnp.int32))
  jaxpr = lambda **knobs: str(jax.make_jaxpr(functools.partial(
      mosaic_sparse.sparse_attention_fp8_ds_mla, scale=0.1, **knobs))(*args))
  assert jaxpr() == jaxpr(prep_in_kernel=prep)
  assert ("_prep_wide_cp_async" in jaxpr()) == prep


def test_mosaic_sparse_heads_in_n_runs_one_split(monkeypatch):
  # Session 12 found the default failing to lower at T=64 (2 splits: "n" with float32 partials).
  # Now the default there is "m", and "n" named runs one split whatever the rule gives (T=3: the
  # rule would split); a named split count above one is refused before any launch.
  q = jax.ShapeDtypeStruct((64, 16, L + R), jnp.bfloat16)
  slots = jax.ShapeDtypeStruct((64, 2048), jnp.int32)
  kv = jax.ShapeDtypeStruct(((1 << 20) // 64, 64, L + R), jnp.bfloat16)
  traced = mosaic_sparse.sparse_attention.trace(q, kv, slots, scale=0.1, kv_lora_rank=L)
  assert "mosaic_sparse_bf16_prep_hand_over_first_cp_async_s2" in str(traced.jaxpr)
  assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
  named = mosaic_sparse.sparse_attention.trace(q, kv, slots, scale=0.1, kv_lora_rank=L,
                                               heads_in="n")
  assert "mosaic_sparse_bf16_heads_n16_prep_hand_over_first_cp_async_s1" in str(named.jaxpr)
  with pytest.raises(ValueError, match="runs one split"):
    mosaic_sparse.sparse_attention.trace(q, kv, slots, scale=0.1, kv_lora_rank=L, heads_in="n",
                                         num_splits=2)


@pytest.mark.parametrize("n,want", [(16, "n"), (27, "n"), (32, "n"), (64, "m"), (128, "m")])
def test_mosaic_sparse_default_heads_in_reaches_the_kernel(n, want):
  # heads_in=None resolves in the jit entries, so the default call traces the same program as the
  # explicit heads_in (bf16: "n" up to 32 heads; fp8_ds_mla: "m" at any N), and pallas_mosaic's
  # backend (which names none) runs it too. The kernel's name says which.
  t, tokens = 128, 1 << 14
  q = jax.ShapeDtypeStruct((t, n, L + R), jnp.bfloat16)
  slots = jax.ShapeDtypeStruct((t, 2048), jnp.int32)
  kv = jax.ShapeDtypeStruct((tokens // 64, 64, L + R), jnp.bfloat16)
  entry = functools.partial(mosaic_sparse.sparse_attention, scale=0.1, kv_lora_rank=L)
  default = str(jax.make_jaxpr(entry)(q, kv, slots))
  tile = f"_heads_n{16 if n <= 16 else 32}" if want == "n" else ""
  assert f"mosaic_sparse_bf16{tile}_prep_hand_over_first_cp_async_s1" in default
  assert default == str(jax.make_jaxpr(functools.partial(entry, heads_in=want))(q, kv, slots))
  backend = functools.partial(backends.get_backend("pallas_mosaic").sparse_attention, scale=0.1,
                              kv_lora_rank=L)
  # (The interpreter, on this CPU, gathers in bulk.)
  cache = LatentCache(kv, jax.ShapeDtypeStruct((), jnp.float32))
  assert f"mosaic_sparse_bf16{tile}_prep_bulk_s1" in str(jax.make_jaxpr(backend)(q, cache, slots))
  cache = DSMLACache(jax.ShapeDtypeStruct((tokens // 64, 64, L), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((tokens // 64, 64, L // 128), jnp.float32),
                     jax.ShapeDtypeStruct((tokens // 64, 64, R), jnp.bfloat16))
  fp8 = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, q, cache.nope,
                          cache.tile_scales, cache.rope, slots, scale=0.1)
  assert str(jax.make_jaxpr(fp8)()) == str(jax.make_jaxpr(functools.partial(fp8, heads_in="m"))())


@pytest.mark.parametrize("prep_in_kernel", [False, True])
def test_hand_over_first_lowers_for_hopper(prep_in_kernel, monkeypatch):
  # bf16's memory warpgroup handing a step over before it waits for the next slot: the cp.async
  # loop's other order (the interpreter's bulk gather has no hand-over; GPU: test_dsa_gpu.py).
  check_lowers_for_hopper(monkeypatch, 128, False, "cp_async", None, 2,
                          prep_in_kernel=prep_in_kernel, hand_over_first=True)


@pytest.mark.parametrize("fp8,fp8_pipeline,prep_in_kernel", [
    (False, None, True), (False, None, False), (True, "in_place", True),
    (True, "half_rows", False)])
def test_rescale_slack_lowers_for_hopper(fp8, fp8_pipeline, prep_in_kernel, monkeypatch):
  # The consumers' lane-level skip of the rescale (`mosaic_lanes.rows_rescaled`, GPU only) at 128
  # heads: bf16 with and without the slot prep in the kernel, fp8_ds_mla's two heads-in-M
  # pipelines (GPU: test_dsa_gpu.py).
  check_lowers_for_hopper(monkeypatch, 128, fp8, "cp_async", fp8_pipeline, 2,
                          prep_in_kernel=prep_in_kernel, rescale_slack=RESCALE_SLACK)


def ramp_case(seed, kind, n=64, t=3, k=200, nb=20, rise=400.0):
  """Slots whose rows' scores rise along each token's (sorted) slot list: every row plus
  s / S * rise / (0.05 log2 e) along a unit direction u, so head h's scores rise by ~rise (q_h . u)
  log2 units over a list (~120 a 64-slot step at |q_h . u| = 1, past float32's range within the
  list; some heads fall). Row 1 selects
  nothing, unused rows hold NaN. Returns (q, cache, slots, rows [S, L+R] as the cache holds
  them)."""
  rng = np.random.default_rng(seed)
  bs = 16
  num_slots = nb * bs
  slots = np.sort(random_slots(rng, t, k, num_slots), axis=1)
  slots[1] = -1
  unused = np.ones(num_slots, bool)
  unused[slots[(slots >= 0) & (slots < num_slots)]] = False
  u = rng.standard_normal(L + R).astype(np.float32)
  u /= np.linalg.norm(u)
  ramp = np.arange(num_slots, dtype=np.float32)[:, None] / num_slots * rise / (
      0.05 * np.log2(np.e)) * u
  rows = rng.standard_normal((num_slots, L + R)).astype(np.float32) + ramp
  cache, rows = poisoned_cache(kind, rows[:, :L], rows[:, L:], unused, nb, bs)
  q = jnp.asarray(rng.standard_normal((t, n, L + R)), jnp.bfloat16)
  return q, cache, slots, rows


@pytest.mark.parametrize("kind,fp8_pipeline", [("bf16", None), ("fp8_ds_mla", "in_place"),
                                               ("fp8_ds_mla", "half_rows")])
def test_mosaic_sparse_rescale_slack_matches_oracle(kind, fp8_pipeline):
  # rescale_slack's softmax in both consumers' steps (interpreter; the GPU's lane-level skip:
  # lowering above, test_dsa_gpu.py), heads in M, over scores that rise far past the slack
  # along the slot lists (a max left behind overflows P) and fall for other heads; one split, so
  # a program runs every step of its list; slack 0 bit for bit the default.
  q, cache, slots, rows = ramp_case(41, kind)
  num_slots = rows.shape[0]
  if kind == "bf16":
    run = lambda slack: mosaic_sparse.sparse_attention(
        q, cache.data, jnp.asarray(slots), scale=0.05, kv_lora_rank=L, num_splits=1,
        rescale_slack=slack, interpret=True)
  else:
    run = lambda slack: mosaic_sparse.sparse_attention_fp8_ds_mla(
        q, cache.nope, cache.tile_scales, cache.rope, jnp.asarray(slots), scale=0.05,
        num_splits=1, fp8_pipeline=fp8_pipeline, heads_in="m", rescale_slack=slack,
        interpret=True)
  assert_matches_oracle(*run(RESCALE_SLACK), q, rows, slots, num_slots, L)
  if kind == "bf16":
    for a, b in zip(run(0.0), run(None)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_lowers_for_hopper(monkeypatch, n, fp8, gather, fp8_pipeline, halves, heads_in="m",
                            prep_in_kernel=False, k=2048,
                            wide_widening=mosaic_sparse.CONFIG.wide_widening,
                            hand_over_first=False, rescale_slack=None,
                            landing_groups=mosaic_sparse.CONFIG.landing_groups,
                            gather_by=mosaic_sparse.CONFIG.gather_by):
  """The Mosaic sparse kernel at T=128, k (2048) slots over 1M tokens, lowered for CUDA (it runs on
  this CPU), which checks what the interpreter does not: wgmma operand layouts and swizzles,
  bulk-copy boxes, the untiled aliases, the cp.async code, the register layouts of the widening
  (and with heads_in="n" of the transposed stores and the cross-warp reductions), and that shared
  memory fits 227 KB; with the limit at 0, Mosaic GPU's error names the bytes it counts, which
  must be smem_bytes' (what _sparse_call checks before any launch). wide_widening (the default):
  its lane-level code too (which the interpreter does not run)."""
  t, tokens = 128, 1 << 20
  counted = []  # what _sparse_call counts while tracing
  monkeypatch.setattr(mosaic_sparse, "smem_bytes",
                      lambda *args, count=mosaic_sparse.smem_bytes: counted.append(
                          count(*args)) or counted[-1])
  q = jax.ShapeDtypeStruct((t, n, 576), jnp.bfloat16)
  slots = jax.ShapeDtypeStruct((t, k), jnp.int32)
  if fp8:
    traced = mosaic_sparse.sparse_attention_fp8_ds_mla.trace(
        q, jax.ShapeDtypeStruct((tokens // 64, 64, 512), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((tokens // 64, 64, 4), jnp.float32),
        jax.ShapeDtypeStruct((tokens // 64, 64, 64), jnp.bfloat16), slots, scale=0.1,
        gather=gather, fp8_pipeline=fp8_pipeline, fp8_stage_halves=halves, heads_in=heads_in,
        prep_in_kernel=prep_in_kernel, wide_widening=wide_widening, rescale_slack=rescale_slack,
        landing_groups=landing_groups, gather_by=gather_by)
  else:
    traced = mosaic_sparse.sparse_attention.trace(
        q, jax.ShapeDtypeStruct((tokens // 64, 64, 576), jnp.bfloat16), slots, scale=0.1,
        gather=gather, heads_in=heads_in, prep_in_kernel=prep_in_kernel,
        hand_over_first=hand_over_first, rescale_slack=rescale_slack)
  assert_lowers_with_counted_smem(traced, counted[-1], monkeypatch)


def assert_lowers_with_counted_smem(traced, counted, monkeypatch):
  """traced lowers for CUDA (on this CPU) within a block's 227 KB, and with Mosaic GPU's limit at
  0 its error names the bytes it counts, which must be `counted` (the entry's count)."""
  assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
  assert counted <= 227 * 1024
  jax.clear_caches()
  monkeypatch.setattr(mosaic_gpu_core, "_SMEM_SIZE_BOUND", 0)
  with pytest.raises(ValueError, match=f"smem_bytes={counted} "):
    traced.lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("landing_groups,prep", [(1, True), (2, True), (4, True), (2, False)])
def test_mosaic_sparse_landing_groups_lower_for_hopper(landing_groups, prep, monkeypatch):
  # "in_place"'s step landing in 1, 2 or 4 cp.async groups, widened group by group (GPU only:
  # the interpreter gathers in bulk and widens at the Pallas level; GPU: test_dsa_gpu.py), with
  # the tile scales in the first group (prep in the kernel) or XLA's (a bulk copy).
  check_lowers_for_hopper(monkeypatch, 128, True, "cp_async", "in_place", 2, prep_in_kernel=prep,
                          landing_groups=landing_groups, gather_by="memory")


@pytest.mark.parametrize("prep,wide", [(True, True), (False, True), (True, False)])
def test_mosaic_sparse_values_gather_lowers_for_hopper(prep, wide, monkeypatch):
  # gather_by="values": warpgroup 1 issues "in_place"'s gathers, each lane's copies tracked by a
  # lane barrier in row_smem's slack (cp.async.mbarrier.arrive), which the memory warpgroup waits
  # on; the scales in the rows' copies (prep) or XLA's block (a bulk copy from warpgroup 1), both
  # widenings (GPU only: the interpreter gathers in bulk from the memory warpgroup).
  check_lowers_for_hopper(monkeypatch, 128, True, "cp_async", "in_place", 2, prep_in_kernel=prep,
                          wide_widening=wide, gather_by="values")


# The Pallas-level widening (wide_widening=False, the GPU bit-for-bit test's oracle) over 32-row
# slots and a 64-row one, with the in-kernel scales and XLA's; "in_place"'s over the staged rows.
@pytest.mark.parametrize("fp8_pipeline,gather,prep", [
    ("half_rows", "cp_async", True), ("serial", "bulk", False), ("in_place", "cp_async", False)])
def test_mosaic_sparse_pallas_widening_lowers_for_hopper(fp8_pipeline, gather, prep, monkeypatch):
  check_lowers_for_hopper(monkeypatch, 128, True, gather, fp8_pipeline, 2, prep_in_kernel=prep,
                          wide_widening=False)


class TestPallasMosaicSparseAttention(SparseAttentionContract):
  """The Mosaic GPU kernel in Mosaic GPU's interpreter on CPUs. It takes bf16 q over bf16 or
  fp8_ds_mla caches: the contract cases with float32 q or a per-tensor fp8 cache skip, naming
  why; the bf16-q cases below cover what they test (NaN in unselected rows, -1 and past-the-cache
  slots, a row with nothing selected, 16 and 128 heads, both caches). Defaults throughout: bf16
  caches up to 32 heads run heads_in "n" (`default_heads_in`), "m" is named below."""
  backend = "pallas_mosaic"
  # What the fp8_ds_mla cases run: the default, "half_rows" at these few tokens.
  fp8_pipeline = mosaic_sparse.CONFIG.fp8_pipeline
  fp8_stage_halves = mosaic_sparse.CONFIG.fp8_stage_halves
  # What the cases run: the default (None), "n" for bf16 caches up to 32 heads, else "m".
  heads_in = mosaic_sparse.CONFIG.heads_in
  # None: the kernel reads the raw slots (fp8_ds_mla with the bulk gather: XLA's idx and steps).
  prep_in_kernel = mosaic_sparse.CONFIG.prep_in_kernel
  wide_widening = mosaic_sparse.CONFIG.wide_widening

  def fn(self):
    run = super().fn()

    def checked(q, cache, slots, *, scale, kv_lora_rank):
      if q.dtype != jnp.bfloat16:
        pytest.skip(f"pallas_mosaic's sparse kernel takes bfloat16 q only, got {q.dtype}")
      if isinstance(cache, LatentCache) and cache.scale_or_none is not None:
        pytest.skip("pallas_mosaic's sparse kernel reads no per-tensor float8 latent cache")
      if self.heads_in is not None or self.prep_in_kernel:
        if self.heads_in is not None and q.shape[1] > mosaic_sparse.HEADS_N_TILES[-1]:
          pytest.skip(f"heads_in=\"n\" takes at most {mosaic_sparse.HEADS_N_TILES[-1]} heads, and "
                      f"above them \"m\" is the default (the parent's case)")
        if isinstance(cache, DSMLACache) and self.heads_in == "m":
          pytest.skip("heads_in=\"m\" is the fp8_ds_mla default (the parent's case)")
        if isinstance(cache, DSMLACache):
          return mosaic_sparse.sparse_attention_fp8_ds_mla(
              q, cache.nope, cache.tile_scales, cache.rope, slots, scale=scale,
              fp8_pipeline=self.fp8_pipeline, heads_in=self.heads_in,
              prep_in_kernel=self.prep_in_kernel, interpret=True)
        return mosaic_sparse.sparse_attention(q, cache.data, slots, scale=scale,
                                              kv_lora_rank=kv_lora_rank, heads_in=self.heads_in,
                                              prep_in_kernel=self.prep_in_kernel, interpret=True)
      if (self.fp8_pipeline, self.fp8_stage_halves) == (mosaic_sparse.CONFIG.fp8_pipeline,
                                                        mosaic_sparse.CONFIG.fp8_stage_halves):
        return run(q, cache, slots, scale=scale, kv_lora_rank=kv_lora_rank)
      if not isinstance(cache, DSMLACache):
        pytest.skip("fp8_pipeline changes only the fp8_ds_mla path")
      return mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, cache.nope, cache.tile_scales, cache.rope, slots, scale=scale,
          fp8_pipeline=self.fp8_pipeline, fp8_stage_halves=self.fp8_stage_halves,
          wide_widening=self.wide_widening, interpret=True)
    return checked

  @pytest.mark.parametrize("kind,n,lora", [("bf16", 16, L), ("bf16", 128, L),
                                           ("fp8_ds_mla", 16, 256), ("fp8_ds_mla", 128, L)])
  def test_bf16_q_poisoned_cache_matches_oracle(self, kind, n, lora):
    q, cache, slots, rows = poisoned_case(20 + n + lora, n, kind, lora)
    num_slots = rows.shape[0]
    o, lse = self.fn()(q, cache, jnp.asarray(slots), scale=0.05, kv_lora_rank=lora)
    assert o.dtype == jnp.bfloat16 and o.shape == (4, n, lora) and lse.shape == (4, n)
    assert_matches_oracle(o, lse, q, rows, slots, num_slots, lora)

  # Several steps in one split (num_splits=1): 300 slots, 5 steps of 64, the last partly -1
  # padding and a row (1) with none valid, so the index ring wraps, and with "half_rows" both row
  # slots alternate 5 times and the staging ring (2 or 3 buffers) wraps; row 2's last half step
  # holds no valid slot.
  @pytest.mark.parametrize("n,lora", [(16, 256), (128, L)])
  def test_fp8_ds_mla_steps_of_one_split_match_oracle(self, n, lora):
    q, cache, slots, rows = poisoned_case(40 + n, n, "fp8_ds_mla", lora, t=3, k=300, nb=22)
    slots[2, 288:] = -1
    o, lse = mosaic_sparse.sparse_attention_fp8_ds_mla(
        q, cache.nope, cache.tile_scales, cache.rope, jnp.asarray(slots), scale=0.05, num_splits=1,
        fp8_pipeline=self.fp8_pipeline, fp8_stage_halves=self.fp8_stage_halves,
        heads_in=self.heads_in, prep_in_kernel=self.prep_in_kernel,
        wide_widening=self.wide_widening, interpret=True)
    assert_matches_oracle(o, lse, q, rows, slots, rows.shape[0], lora)

  @pytest.mark.parametrize("fp8_pipeline", ["serial", "half_rows"])
  def test_no_races_in_the_interpreter(self, fp8_pipeline):
    # The interpreter's race detector sees plain loads and stores and bulk copies (the P and
    # rescale hand-off, the staging ring and its widening into the row slots, the output staged
    # over the slots), not the operand reads of wgmma. 3 steps in one split: every staging buffer
    # and slot is reused. jax 0.11.2 reports races only through a private module. Not "in_place":
    # the detector refuses any read of a `RefUnion` through another member than the last write's
    # (its staging views alias the row slots within one step, by design).
    report = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    q, cache, slots, rows = poisoned_case(70, 16, "fp8_ds_mla", 256, t=2, k=160, nb=12)
    o, lse = mosaic_sparse.sparse_attention_fp8_ds_mla(
        q, cache.nope, cache.tile_scales, cache.rope, jnp.asarray(slots), scale=0.05, num_splits=1,
        fp8_pipeline=fp8_pipeline, prep_in_kernel=self.prep_in_kernel,
        interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(o)
    assert not report.get_races().races_found
    o_ref, _ = sparse_np(np.asarray(q.astype(jnp.float32)), lambda s: rows[s].astype(np.float64),
                         slots, rows.shape[0], 0.05, 256)
    assert cosine_diff(np.asarray(o.astype(jnp.float32), np.float64), o_ref) < 1e-5

  # 300 slots in one split (5 steps: both row slots alternate, the index ring wraps), NaN in every
  # unselected row, -1 and past-the-cache slots, row 1 with none valid, row 2's last step without
  # one, bf16 caches; 4 heads (heads_in "n": padded to 16; "m": to 64) and 27 (to 32; 64); the
  # contract's own bf16 cases take float32 q, which skip. The race detector watches the P (or P^T)
  # and rescale hand-off and the output staged over the slots.
  @pytest.mark.parametrize("n", [4, 27])
  def test_bf16_steps_of_one_split_match_oracle(self, n):
    report = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    q, cache, slots, rows = poisoned_case(50 + n, n, "bf16", L, t=3, k=300, nb=22)
    slots[2, 256:] = -1
    o, lse = mosaic_sparse.sparse_attention(
        q, cache.data, jnp.asarray(slots), scale=0.05, kv_lora_rank=L, num_splits=1,
        heads_in=self.heads_in, prep_in_kernel=self.prep_in_kernel,
        interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(o)
    assert not report.get_races().races_found
    assert o.shape == (3, n, L) and lse.shape == (3, n)
    assert_matches_oracle(o, lse, q, rows, slots, rows.shape[0], L)

  def test_splits_match_one_split(self):
    q, cache, slots, _ = poisoned_case(31, 16, "bf16", k=90)  # 2 steps of 64 slots
    run = lambda s: mosaic_sparse.sparse_attention(q, cache.data, jnp.asarray(slots), scale=0.05,
                                                   kv_lora_rank=L, num_splits=s,
                                                   heads_in=self.heads_in,
                                                   prep_in_kernel=self.prep_in_kernel,
                                                   interpret=True)
    (o1, l1), (o3, l3) = run(1), run(3)
    np.testing.assert_allclose(np.asarray(o3, np.float32), np.asarray(o1, np.float32), rtol=2 / 128,
                               atol=1e-2)  # bf16 outputs: a split merge may round 1 ulp apart
    np.testing.assert_allclose(np.asarray(l3), np.asarray(l1), rtol=1e-5, atol=1e-5)

  @pytest.mark.parametrize("n,fp8,gather,fp8_pipeline,halves", [
      (128, False, "cp_async", "serial", 2), (16, False, "cp_async", "serial", 2),
      (128, False, "bulk", "serial", 2), (128, True, "cp_async", "serial", 2),
      (32, True, "cp_async", "serial", 2), (128, True, "bulk", "serial", 2),
      (128, True, "cp_async", "half_rows", 2), (32, True, "cp_async", "half_rows", 2),
      (128, True, "bulk", "half_rows", 2), (128, True, "cp_async", "half_rows", 3),
      (128, True, "bulk", "half_rows", 3), (128, True, "cp_async", "in_place", 2),
      (32, True, "cp_async", "in_place", 2)])
  def test_lowers_for_hopper(self, n, fp8, gather, fp8_pipeline, halves, monkeypatch):
    check_lowers_for_hopper(monkeypatch, n, fp8, gather, fp8_pipeline, halves)

  def test_shared_memory_past_the_limit_raises(self, monkeypatch):
    # fp8_ds_mla at L=512 with the cp.async gather: 199,760 bytes "serial", 195,688 "half_rows"
    # (P is 64 x 32; 3 more barriers), 217,200 with 3 staging buffers (RESULTS v6), 231,528
    # "in_place" (bf16's 231,512 and 2 barriers; RESULTS v9), counted with XLA's slot prep
    # (prep_in_kernel=False: the default's in-kernel scales take no staging-fill barrier). Past
    # the limit: a ValueError.
    monkeypatch.setattr(mosaic_sparse, "_SMEM_LIMIT", 199_759)
    trace = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla.trace, prep_in_kernel=False)
    q = jax.ShapeDtypeStruct((4, 64, 576), jnp.bfloat16)
    args = (q, jax.ShapeDtypeStruct((16, 64, 512), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((16, 64, 4), jnp.float32),
            jax.ShapeDtypeStruct((16, 64, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 64), jnp.int32))
    trace(*args, scale=0.1, fp8_pipeline="half_rows")
    with pytest.raises(ValueError, match="199760 bytes.*exceeds"):
      trace(*args, scale=0.1, fp8_pipeline="serial")
    monkeypatch.setattr(mosaic_sparse, "_SMEM_LIMIT", 217_199)
    with pytest.raises(ValueError, match="217200 bytes.*exceeds"):
      trace(*args, scale=0.1, fp8_pipeline="half_rows", fp8_stage_halves=3)
    with pytest.raises(ValueError, match="231528 bytes.*exceeds"):
      trace(*args, scale=0.1, fp8_pipeline="in_place")

  @pytest.mark.parametrize("change,message", [
      (lambda a: {**a, "q": a["q"][0]}, "want q"),
      (lambda a: {**a, "slots": a["slots"][:1]}, "want q"),
      (lambda a: {**a, "kv_lora_rank": 96}, "multiple of 128"),
      (lambda a: {**a, "q": a["q"].astype(jnp.float32)}, "bfloat16"),
      (lambda a: {**a, "slots": a["slots"].astype(jnp.int16)}, "int32"),
      (lambda a: {**a, "kv_cache": a["kv_cache"][..., :-64]}, "kv_cache"),
      (lambda a: {**a, "kv_cache": a["kv_cache"].astype(jnp.float8_e4m3fn)}, "bfloat16 kv_cache"),
      (lambda a: {**a, "num_splits": 0}, "num_splits"),
      (lambda a: {**a, "gather": "tma"}, "gather must be one of"),
      (lambda a: {**a, "split_rule": "many"}, "split_rule must be one of"),
  ])
  def test_bad_input_raises(self, change, message):
    args = dict(q=jnp.zeros((2, 16, L + R), jnp.bfloat16),
                kv_cache=jnp.zeros((4, 16, L + R), jnp.bfloat16),
                slots=jnp.zeros((2, 8), jnp.int32), kv_lora_rank=L)
    with pytest.raises(ValueError, match=message):
      mosaic_sparse.sparse_attention(**change(args), scale=0.1, interpret=True)

  @pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf")])
  def test_non_positive_scale_raises(self, scale):
    # The kernels take a row's maximum score before scaling it (`common.softmax_step`).
    q, slots = jnp.zeros((2, 16, L + R), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="scale must be a finite positive float"):
      mosaic_sparse.sparse_attention(q, jnp.zeros((4, 16, L + R), jnp.bfloat16), slots,
                                     scale=scale, kv_lora_rank=L, interpret=True)
    # The fp8_ds_mla entry's default pick at 16 heads, register_a, named and called directly (at
    # the 512 NoPE columns it takes).
    wide = 512
    ds_mla = (jnp.zeros((2, 16, wide + R), jnp.bfloat16),
              jnp.zeros((4, 16, wide), jnp.float8_e4m3fn),
              jnp.ones((4, 16, wide // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16))
    for entry in (mosaic_sparse.sparse_attention_fp8_ds_mla,
                  functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla,
                                    fp8_pipeline="register_a"),
                  mosaic_sparse_register_a.sparse_attention_fp8_ds_mla):
      with pytest.raises(ValueError, match="scale must be a finite positive float"):
        entry(*ds_mla, slots, scale=scale, interpret=True)

  def test_bad_ds_mla_layout_raises(self):
    q, slots = jnp.zeros((2, 16, L + R), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    nope = jnp.zeros((4, 16, L), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="tile_scales"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(q, nope, jnp.zeros((4, 16, 2), jnp.float32),
                                                jnp.zeros((4, 16, R), jnp.bfloat16), slots,
                                                scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="fp8_pipeline must be None or one of"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(q, nope, jnp.zeros((4, 16, L // 128), jnp.float32),
                                                jnp.zeros((4, 16, R), jnp.bfloat16), slots,
                                                scale=0.1, fp8_pipeline="half_pages",
                                                interpret=True)
    with pytest.raises(ValueError, match="takes the cp_async gather"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, nope, jnp.zeros((4, 16, L // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16),
          slots, scale=0.1, fp8_pipeline="in_place", gather="bulk", interpret=True)
    # The default (None) takes 2 whatever it picks: 3 would be refused at the shapes that pick
    # "in_place" only.
    # wide_widening: a bool (every pipeline takes it).
    with pytest.raises(ValueError, match="wide_widening must be True or False"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, nope, jnp.zeros((4, 16, L // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16),
          slots, scale=0.1, fp8_pipeline="half_rows", wide_widening=1, interpret=True)
    with pytest.raises(ValueError, match="landing_groups must be one of"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, nope, jnp.zeros((4, 16, L // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16),
          slots, scale=0.1, fp8_pipeline="in_place", landing_groups=3, interpret=True)
    with pytest.raises(ValueError, match="gather_by must be None or one of"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, nope, jnp.zeros((4, 16, L // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16),
          slots, scale=0.1, gather_by="consumers", interpret=True)
    for pipeline, gather in (("half_rows", "cp_async"), (None, "bulk")):
      with pytest.raises(ValueError, match="takes fp8_pipeline \"in_place\""):
        mosaic_sparse.sparse_attention_fp8_ds_mla(
            q, nope, jnp.zeros((4, 16, L // 128), jnp.float32),
            jnp.zeros((4, 16, R), jnp.bfloat16), slots, scale=0.1, fp8_pipeline=pipeline,
            gather=gather, gather_by="values", interpret=True)
    with pytest.raises(ValueError, match="hand_over_first must be True or False"):
      mosaic_sparse.sparse_attention(q, jnp.zeros((4, 16, L + R), jnp.bfloat16), slots,
                                     scale=0.1, kv_lora_rank=L, hand_over_first="yes",
                                     interpret=True)
    for pipeline, halves in (("serial", 3), ("half_rows", 4), (None, 3)):
      with pytest.raises(ValueError, match="fp8_stage_halves must be 2"):
        mosaic_sparse.sparse_attention_fp8_ds_mla(
            q, nope, jnp.zeros((4, 16, L // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16),
            slots, scale=0.1, fp8_pipeline=pipeline, fp8_stage_halves=halves, interpret=True)

  def test_default_gather_by_takes_values_up_to_256_rows(self):
    # gather_by=None: warpgroup 1 gathers decode rows (up to VALUES_GATHER_MAX_ROWS), the memory
    # warpgroup past them (session 37's timings).
    assert mosaic_sparse.VALUES_GATHER_MAX_ROWS == 256
    assert [mosaic_sparse.default_gather_by(t) for t in (1, 128, 256, 257, 4096)] == [
        "values", "values", "values", "memory", "memory"]

  def test_config_default_and_sweep(self):
    # The timed rules (`default_fp8_pipeline`, `default_heads_in`); both heads_in named beside.
    assert (mosaic_sparse.CONFIG.fp8_pipeline, mosaic_sparse.CONFIG.fp8_stage_halves,
            mosaic_sparse.CONFIG.heads_in, mosaic_sparse.CONFIG.prep_in_kernel,
            mosaic_sparse.CONFIG.wide_widening, mosaic_sparse.CONFIG.hand_over_first,
            mosaic_sparse.CONFIG.rescale_slack, mosaic_sparse.CONFIG.landing_groups,
            mosaic_sparse.CONFIG.gather_by) == (None, 2, None, None, True, True, None, 2, None)
    for other in (dict(fp8_pipeline="serial"), dict(fp8_pipeline="half_rows"),
                  dict(fp8_pipeline="half_rows", fp8_stage_halves=3),
                  dict(fp8_pipeline="in_place"), dict(heads_in="m"), dict(heads_in="n"),
                  dict(fp8_pipeline="in_place", heads_in="n"), dict(prep_in_kernel=False),
                  dict(fp8_pipeline="half_rows", wide_widening=False),
                  dict(fp8_pipeline="in_place", wide_widening=False),
                  dict(hand_over_first=False), dict(rescale_slack=8.0),
                  dict(fp8_pipeline="in_place", landing_groups=1),
                  dict(fp8_pipeline="in_place", landing_groups=4),
                  dict(fp8_pipeline="in_place", gather_by="memory"),
                  dict(fp8_pipeline="in_place", gather_by="values")):
      assert mosaic_sparse.MosaicSparseConfig(**other) in mosaic_sparse.SWEEP


class TestPallasMosaicSparseAttentionSerial(TestPallasMosaicSparseAttention):
  """The fp8_ds_mla multi-step case again with fp8_pipeline="serial" (one 64-row bf16 slot,
  widened only once both consumers are done with the step before), a non-default pipeline: 64
  heads, NaN in unselected rows, -1 and past-the-cache slots, a row with none valid, per-row and
  per-tile magnitudes 20x apart; bf16 caches skip, naming why."""
  fp8_pipeline = "serial"
  # The multi-step case is poisoned too, with the same 20x per-tile magnitudes as the contract's
  # fp8_ds_mla cases (at a 1e-5 cosine against their 1e-3): the other sizes are the default's
  # (the parent's), the pipeline is the same at every size.
  test_fp8_ds_mla_cache_matches_dequantized_oracle = None
  test_bf16_q_poisoned_cache_matches_oracle = None
  # Cases that read no fp8_ds_mla cache through fn, or check every variant already: the parent's.
  test_splits_match_one_split = None
  test_bf16_steps_of_one_split_match_oracle = None
  test_no_races_in_the_interpreter = None
  test_lowers_for_hopper = None
  test_shared_memory_past_the_limit_raises = None
  test_bad_input_raises = None
  test_bad_ds_mla_layout_raises = None
  test_config_default_and_sweep = None

  # One whole 64-head tile: a pipeline's steps run the same in each tile (the parent's 128-head
  # case walks two, at twice the interpreter's time).
  @pytest.mark.parametrize("n,lora", [(64, L)])
  def test_fp8_ds_mla_steps_of_one_split_match_oracle(self, n, lora):
    super().test_fp8_ds_mla_steps_of_one_split_match_oracle(n, lora)


class TestPallasMosaicSparseAttentionHalfRows3(TestPallasMosaicSparseAttentionSerial):
  """The default "half_rows" with a ring of 3 staging buffers (each gather issued 3 half steps
  ahead): the multi-step case (the staging ring wraps) as for "serial"."""
  fp8_pipeline = "half_rows"
  fp8_stage_halves = 3


class TestPallasMosaicSparseAttentionInPlace(TestPallasMosaicSparseAttentionSerial):
  """fp8_pipeline="in_place" (the default where many one-split programs run, RESULTS v11): bf16's
  two 64-row slots, each step staged in and widened inside its own slot. The contract's fp8_ds_mla
  cases (L=128: one e4m3 tile widened over itself; L=512: four, tiles 2 and 3 over the staged
  ones) and one multi-step case (64 heads, NaN in unselected rows, -1 and past-the-cache slots, a
  row with none valid, both slots alternating). The interpreter does not alias the union's views
  (and its race detector refuses them), so the in-place overwrites are the GPU cases' to check
  (bit for bit against "serial", whose consumers run the same 64-slot products on the same widened
  values)."""
  fp8_pipeline = "in_place"
  # A default pipeline (at many tokens; the parent's few-token cases run "half_rows"): the
  # contract's fp8_ds_mla cases run here too.
  test_fp8_ds_mla_cache_matches_dequantized_oracle = (
      TestPallasMosaicSparseAttention.test_fp8_ds_mla_cache_matches_dequantized_oracle)


class TestPallasMosaicSparseAttentionHeadsM(TestPallasMosaicSparseAttention):
  """heads_in="m" named where the default runs "n" (`default_heads_in`: bf16 caches up to 32
  heads): 64-head tiles, copying in and storing only the N query rows at 16 and 32 heads
  (multiples of 8, `padded_heads`), padded to 64 at 4 and 27. A non-default variant at these
  heads: the poisoned case at 16 heads (only the N rows copied and stored; 2 splits of its 80
  slots, merged) and several steps at 27 (padded to 64) under the race detector; fp8_ds_mla and
  more than 32 heads run "m" by default (the parent's cases) and skip."""
  heads_in = "m"
  # The other sizes: 32 heads stores N rows as 16 does, 4 pads as 27 does; the split merge is the
  # poisoned case's (80 slots: 2 splits at its 4 tokens, `split_count`).
  test_splits_match_one_split = None
  # Cases that call the default only, or fp8_ds_mla's default again: the parent's.
  test_bad_backend_input_raises = None
  test_bad_input_raises = None
  test_fp8_ds_mla_steps_of_one_split_match_oracle = None
  test_no_races_in_the_interpreter = None
  test_lowers_for_hopper = None  # its cases name heads_in="m" already
  test_shared_memory_past_the_limit_raises = None
  test_bad_ds_mla_layout_raises = None
  test_config_default_and_sweep = None

  @pytest.mark.parametrize("kind,n,lora", [("bf16", 16, L)])
  def test_bf16_q_poisoned_cache_matches_oracle(self, kind, n, lora):
    super().test_bf16_q_poisoned_cache_matches_oracle(kind, n, lora)

  @pytest.mark.parametrize("n", [27])
  def test_bf16_steps_of_one_split_match_oracle(self, n):
    super().test_bf16_steps_of_one_split_match_oracle(n)


class TestPallasMosaicSparseAttentionHeadsN(TestPallasMosaicSparseAttention):
  """heads_in="n" named (RESULTS, sparse v12; the bf16 default up to 32 heads, which the parent
  runs): N <= 32 heads in wgmma's N (padded to 16 or 32), S^T = K Q^T, the softmax over the slot
  rows, P^T stored transposed, O^T = V^T P^T stored transposed into the output's [heads,
  columns]. fp8_ds_mla (a selectable non-default) with fp8_pipeline="serial" here ("in_place"
  below): the multi-step case at 16 heads over two e4m3 tiles (poisoned, 5 steps; "in_place"
  below takes 27 heads, padded to 32, over four); the others skip, naming why. The interpreter
  neither swizzles nor runs the transposed stores as the GPU does: the lowering cases check
  those layouts, the GPU cases the numbers."""
  heads_in = "n"
  fp8_pipeline = "serial"
  # The multi-step case is poisoned too, with the contract's 20x per-tile magnitudes: the other
  # sizes are the default's ("m") and the class below's.
  test_fp8_ds_mla_cache_matches_dequantized_oracle = None
  test_bf16_q_poisoned_cache_matches_oracle = None
  # Cases that call the default only, or bf16's default ("n") again: the parent's.
  test_splits_match_one_split = None
  test_bf16_steps_of_one_split_match_oracle = None
  test_bad_backend_input_raises = None
  test_bad_input_raises = None
  test_no_races_in_the_interpreter = None
  test_lowers_for_hopper = None
  test_shared_memory_past_the_limit_raises = None
  test_bad_ds_mla_layout_raises = None
  test_config_default_and_sweep = None

  # fp8_ds_mla: 16 heads over two e4m3 tiles, 5 steps.
  @pytest.mark.parametrize("n,lora", [(16, 256)])
  def test_fp8_ds_mla_steps_of_one_split_match_oracle(self, n, lora):
    super().test_fp8_ds_mla_steps_of_one_split_match_oracle(n, lora)

  @pytest.mark.parametrize("n,fp8,gather,fp8_pipeline", [
      (16, False, "cp_async", None), (32, False, "cp_async", None), (32, False, "bulk", None),
      (32, True, "cp_async", "serial"), (32, True, "cp_async", "in_place"),
      (16, True, "cp_async", "in_place")])
  def test_heads_in_n_lowers_for_hopper(self, n, fp8, gather, fp8_pipeline, monkeypatch):
    check_lowers_for_hopper(monkeypatch, n, fp8, gather, fp8_pipeline, 2, heads_in="n")

  def test_heads_in_n_bad_input_raises(self):
    q, slots = jnp.zeros((2, 33, L + R), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    kv = jnp.zeros((4, 16, L + R), jnp.bfloat16)
    with pytest.raises(ValueError, match="at most 32 heads"):
      mosaic_sparse.sparse_attention(q, kv, slots, scale=0.1, kv_lora_rank=L, heads_in="n",
                                     interpret=True)
    with pytest.raises(ValueError, match="heads_in must be None or one of"):
      mosaic_sparse.sparse_attention(q[:, :16], kv, slots, scale=0.1, kv_lora_rank=L,
                                     heads_in="k", interpret=True)
    for pipeline in ("half_rows", None):  # None picks "half_rows" at these few tokens
      with pytest.raises(ValueError, match="takes fp8_pipeline serial or in_place"):
        mosaic_sparse.sparse_attention_fp8_ds_mla(
            q[:, :16], jnp.zeros((4, 16, L), jnp.float8_e4m3fn),
            jnp.zeros((4, 16, L // 128), jnp.float32), jnp.zeros((4, 16, R), jnp.bfloat16), slots,
            scale=0.1, fp8_pipeline=pipeline, heads_in="n", interpret=True)


class TestPallasMosaicSparseAttentionHeadsNInPlace(TestPallasMosaicSparseAttentionHeadsN):
  """heads_in="n" with fp8_pipeline="in_place": the multi-step case at 27 heads (padded to 32)
  over V3.2's four e4m3 tiles (tiles 2 and 3 widened over the staged ones), poisoned; the bf16
  cases are the default's (`TestPallasMosaicSparseAttention`)."""
  fp8_pipeline = "in_place"
  test_heads_in_n_lowers_for_hopper = None
  test_heads_in_n_bad_input_raises = None
  test_empty_batch_gives_empty_results = None

  @pytest.mark.parametrize("n,lora", [(27, 512)])
  def test_fp8_ds_mla_steps_of_one_split_match_oracle(self, n, lora):
    super().test_fp8_ds_mla_steps_of_one_split_match_oracle(n, lora)


class TestPallasMosaicSparseAttentionPrepInKernel(TestPallasMosaicSparseAttention):
  """prep_in_kernel=True (RESULTS, sparse v13, v14): the kernel takes the raw slots (-1 padded to
  whole steps), masks -1 and past-the-cache slots itself (the gathers read nothing there, the
  scores are -inf) and each warpgroup counts the steps up to the row's last valid slot. The
  default with the cp_async gather (prep_in_kernel=None), which the parent's direct kernel calls
  take: its splits, step walks (bf16 at 27 heads "n" under the race detector, fp8_ds_mla at 16
  and 128) and race cases run these programs. The parent's poisoned cases go through the backend,
  whose interpreter form gathers in bulk (fp8_ds_mla: XLA's prep); here they call the kernel:
  bf16 at 128 heads ("m") and fp8_ds_mla at 16 over two tiles ("half_rows" at these few tokens),
  NaN in unselected rows and scales, -1 and past-the-cache slots, row 1 with none valid. Also rows
  of few valid slots not packed first (the count) and the lowering with the smem count."""
  prep_in_kernel = True
  # The same checks at other sizes (the parent's): the poisoned cases carry the contract's 20x
  # per-tile magnitudes.
  test_fp8_ds_mla_cache_matches_dequantized_oracle = None
  # The parent's direct calls, which name prep_in_kernel=None: the same programs on the same
  # inputs.
  test_splits_match_one_split = None
  test_fp8_ds_mla_steps_of_one_split_match_oracle = None
  test_bf16_steps_of_one_split_match_oracle = None
  test_no_races_in_the_interpreter = None
  # Cases that call the default only: the parent's.
  test_bad_backend_input_raises = None
  test_bad_input_raises = None
  test_shared_memory_past_the_limit_raises = None
  test_bad_ds_mla_layout_raises = None
  test_config_default_and_sweep = None

  @pytest.mark.parametrize("kind,n,lora", [("bf16", 128, L), ("fp8_ds_mla", 16, 256)])
  def test_bf16_q_poisoned_cache_matches_oracle(self, kind, n, lora):
    super().test_bf16_q_poisoned_cache_matches_oracle(kind, n, lora)

  # The in-kernel step count (v14: each warpgroup counts the steps up to its row's last valid
  # slot): 300 slots (5 steps), valid slots not packed first. Row 0: one valid slot, at 250, after
  # three whole steps of -1; row 1: none (0, -inf); row 2: 10 valid (one step, the others never
  # walked); row 3: steps 1 to 3 all -1 between valid slots in steps 0 and 4 (a count of the
  # leading valid run would stop at 1); row 4: as drawn (-1 and past-the-cache slots anywhere,
  # slot 299 valid). NaN in every unselected row; 1 split, and 3 (a row of 1 or 2 steps leaves a
  # split with none: its partial is (0, -inf)); bf16 and fp8_ds_mla ("half_rows").
  @pytest.mark.parametrize("kind,splits", [("bf16", 1), ("bf16", 3), ("fp8_ds_mla", 1)])
  def test_rows_of_few_valid_slots_match_oracle(self, kind, splits):
    def edit(slots):
      num_slots = 22 * 16
      keep = slots[0, 250] if 0 <= slots[0, 250] < num_slots else 7
      slots[0] = -1
      slots[0, 250] = keep
      slots[2, 10:] = -1
      slots[3, 64:256] = -1
      slots[4, 299] = slots[4, 299] % num_slots

    lora = L if kind == "bf16" else 256
    q, cache, slots, rows = poisoned_case(90 + splits, 16, kind, lora, t=5, k=300, nb=22,
                                          edit=edit)
    if kind == "bf16":
      o, lse = mosaic_sparse.sparse_attention(
          q, cache.data, jnp.asarray(slots), scale=0.05, kv_lora_rank=L, num_splits=splits,
          prep_in_kernel=True, interpret=True)
    else:
      o, lse = mosaic_sparse.sparse_attention_fp8_ds_mla(
          q, cache.nope, cache.tile_scales, cache.rope, jnp.asarray(slots), scale=0.05,
          num_splits=splits, prep_in_kernel=True, interpret=True)
    assert_matches_oracle(o, lse, q, rows, slots, rows.shape[0], lora)

  @pytest.mark.parametrize("n,fp8,gather,fp8_pipeline", [
      (128, False, "cp_async", None), (16, False, "cp_async", None), (128, False, "bulk", None),
      (128, True, "cp_async", "half_rows"), (128, True, "cp_async", "serial"),
      (128, True, "cp_async", "in_place"), (32, True, "cp_async", "half_rows")])
  def test_lowers_for_hopper(self, n, fp8, gather, fp8_pipeline, monkeypatch):
    check_lowers_for_hopper(monkeypatch, n, fp8, gather, fp8_pipeline, 2, heads_in=None,
                            prep_in_kernel=True)

  @pytest.mark.parametrize("fp8", [False, True])
  def test_odd_step_count_lowers_for_hopper(self, fp8, monkeypatch):
    # 960 slots, 15 steps: the count's last 128-slot load group is half the row's lanes' (the
    # others reread its last 4 slots).
    check_lowers_for_hopper(monkeypatch, 128, fp8, "cp_async", None, 2, heads_in=None,
                            prep_in_kernel=True, k=960)

  @pytest.mark.parametrize("fp8", [False, True])
  def test_slot_prep_leaves_the_call(self, fp8):
    # Outside the kernel, prep_in_kernel=False computes idx (a select), the per-row steps (a max
    # over the row) and for fp8_ds_mla the rows' tile scales (a gather, a select, a transpose);
    # prep_in_kernel (the default with the cp_async gather) passes the slots (padded with -1 where
    # K is not whole steps) as they are.
    t, n, k, nb = 128, 128, 2048, 1 << 14
    q = jax.ShapeDtypeStruct((t, n, L + R), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((t, k), jnp.int32)
    if fp8:
      cache = (jax.ShapeDtypeStruct((nb, 64, L), jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((nb, 64, L // 128), jnp.float32),
               jax.ShapeDtypeStruct((nb, 64, R), jnp.bfloat16))
      entry = lambda **kw: jax.make_jaxpr(functools.partial(
          mosaic_sparse.sparse_attention_fp8_ds_mla, scale=0.1, **kw))(q, *cache, slots)
    else:
      kv = jax.ShapeDtypeStruct((nb, 64, L + R), jnp.bfloat16)
      entry = lambda **kw: jax.make_jaxpr(functools.partial(
          mosaic_sparse.sparse_attention, scale=0.1, kv_lora_rank=L, **kw))(q, kv, slots)

    def outside(jaxpr):  # primitives outside the kernel, through the jit entry
      names = []
      for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr")
        if eqn.primitive.name != "pallas_call" and inner is not None:
          names += outside(getattr(inner, "jaxpr", inner))
        else:
          names.append(eqn.primitive.name)
      return names

    xla, prep = outside(entry(prep_in_kernel=False).jaxpr), outside(entry().jaxpr)
    assert {"reduce_max", "select_n"} <= set(xla) and ("gather" in xla) == fp8
    assert not {"reduce_max", "select_n", "gather", "transpose", "ge", "lt"} & set(prep), prep
    assert "_prep_" in str(entry()) and "_prep_" not in str(entry(prep_in_kernel=False))
    assert str(entry()) == str(entry(prep_in_kernel=True))


  def test_prep_in_kernel_bad_input_raises(self):
    q, slots = jnp.zeros((2, 16, L + R), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    cache = (jnp.zeros((4, 16, L), jnp.float8_e4m3fn), jnp.zeros((4, 16, L // 128), jnp.float32),
             jnp.zeros((4, 16, R), jnp.bfloat16))
    with pytest.raises(ValueError, match="prep_in_kernel with fp8_ds_mla takes the cp_async"):
      mosaic_sparse.sparse_attention_fp8_ds_mla(q, *cache, slots, scale=0.1, gather="bulk",
                                                prep_in_kernel=True, interpret=True)
    with pytest.raises(ValueError, match="prep_in_kernel must be None or a bool"):
      mosaic_sparse.sparse_attention(q, jnp.zeros((4, 16, L + R), jnp.bfloat16), slots, scale=0.1,
                                     kv_lora_rank=L, prep_in_kernel=1, interpret=True)


class TestPallasMosaicSparseRegisterA:
  """fp8_pipeline="register_a" (`mosaic_sparse_register_a`, the fp8_ds_mla default at 16 and 32
  heads where one split runs): S^T by fp8 wgmma from the gathered e4m3 rows scaled per row and
  tile, the RoPE part in bf16, V^T scaled per token. In the interpreter (its gather a bulk copy a
  row and part, its V^T tiles through shared memory) at V3.2's 512 + 64 columns: NaN in every
  unselected row, -1 and past-the-cache slots, a row with none valid, per-row and per-tile
  magnitudes 20x apart. Lowering for CUDA checks the lane-level code (the cp.async gather, the q
  split, the scaled V^T fragments, the output staging), which the interpreter does not run; the
  GPU cases (tests/test_dsa_gpu.py) the numbers."""

  @staticmethod
  def run(q, cache, slots, **knobs):
    return mosaic_sparse.sparse_attention_fp8_ds_mla(
        q, cache.nope, cache.tile_scales, cache.rope, jnp.asarray(slots), scale=0.05,
        **{"fp8_pipeline": "register_a", "interpret": True, **knobs})

  # 16 heads over 300 slots: 5 steps, the 4-slot ring and the index ring wrapping, the last step
  # partly -1 padding; 32 heads over 80 (2 steps).
  @pytest.mark.parametrize("n,k", [(16, 300), (32, 80)])
  def test_poisoned_steps_match_oracle(self, n, k):
    q, cache, slots, rows = poisoned_case(40 + n, n, "fp8_ds_mla", 512, t=3, k=k, nb=40)
    o, lse = self.run(q, cache, slots)
    assert o.dtype == jnp.bfloat16 and o.shape == (3, n, 512) and lse.shape == (3, n)
    assert_matches_oracle(o, lse, q, rows, slots, rows.shape[0], 512)

  @pytest.mark.parametrize("t,n,want", [(128, 16, True), (128, 32, True), (4096, 16, True),
                                        (4096, 32, True), (128, 64, False), (128, 27, False),
                                        (64, 16, False)])
  def test_default_where_one_split_runs(self, t, n, want):
    # fp8_pipeline=None takes it wherever one split runs at 16 and 32 heads (timed at T=128 and
    # 4096; T=64 splits in 2: "half_rows"); so does pallas_mosaic's backend.
    nb = (1 << 14) // 64
    q = jax.ShapeDtypeStruct((t, n, 512 + R), jnp.bfloat16)
    cache = DSMLACache(jax.ShapeDtypeStruct((nb, 64, 512), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct((nb, 64, 4), jnp.float32),
                       jax.ShapeDtypeStruct((nb, 64, R), jnp.bfloat16))
    slots = jax.ShapeDtypeStruct((t, 2048), jnp.int32)
    entry = functools.partial(mosaic_sparse.sparse_attention_fp8_ds_mla, scale=0.1)
    args = (q, cache.nope, cache.tile_scales, cache.rope, slots)
    default = str(jax.make_jaxpr(entry)(*args))
    assert ("_register_a_" in default) == want
    if want:
      assert default == str(jax.make_jaxpr(functools.partial(entry, fp8_pipeline="register_a"))(
          *args))
      backend = functools.partial(backends.get_backend("pallas_mosaic").sparse_attention,
                                  scale=0.1, kv_lora_rank=512)
      assert "_register_a_" in str(jax.make_jaxpr(backend)(q, cache, slots))
      # Knobs it does not take keep the other pipelines.
      assert "_register_a_" not in str(jax.make_jaxpr(functools.partial(
          entry, heads_in="m"))(*args))
      assert "_register_a_" not in str(jax.make_jaxpr(functools.partial(
          entry, prep_in_kernel=False))(*args))

  @pytest.mark.parametrize("n", [16, 32])
  def test_lowers_for_hopper(self, n, monkeypatch):
    # T=128, 2048 slots over 1M tokens; with Mosaic GPU's limit at 0 its error names the bytes it
    # counts, which must be smem_bytes' (what the entry checks before any launch).
    from pallas_kernels import mosaic_sparse_register_a
    counted = []
    monkeypatch.setattr(mosaic_sparse_register_a, "smem_bytes",
                        lambda *a, count=mosaic_sparse_register_a.smem_bytes: counted.append(
                            count(*a)) or counted[-1])
    tokens = 1 << 20
    s = jax.ShapeDtypeStruct
    traced = mosaic_sparse.sparse_attention_fp8_ds_mla.trace(
        s((128, n, 576), jnp.bfloat16), s((tokens // 64, 64, 512), jnp.float8_e4m3fn),
        s((tokens // 64, 64, 4), jnp.float32), s((tokens // 64, 64, 64), jnp.bfloat16),
        s((128, 2048), jnp.int32), scale=0.1, fp8_pipeline="register_a")
    assert_lowers_with_counted_smem(traced, counted[-1], monkeypatch)

  @pytest.mark.parametrize("change,message", [
      (dict(n=64), "takes 16 or 32 heads"),
      (dict(lora=256), "takes bf16 q"),
      (dict(q_dtype=jnp.float32), "takes bf16 q"),
      (dict(knobs=dict(heads_in="m")), "runs heads in N"),
      (dict(knobs=dict(gather="bulk")), "runs heads in N"),
      (dict(knobs=dict(prep_in_kernel=False)), "runs heads in N"),
      (dict(knobs=dict(num_splits=2)), "runs one split"),
  ])
  def test_bad_input_raises(self, change, message):
    n, lora = change.get("n", 16), change.get("lora", 512)
    q = jnp.zeros((2, n, lora + R), change.get("q_dtype", jnp.bfloat16))
    cache = DSMLACache(jnp.zeros((4, 16, lora), jnp.float8_e4m3fn),
                       jnp.zeros((4, 16, lora // 128), jnp.float32), jnp.zeros((4, 16, R),
                                                                                jnp.bfloat16))
    with pytest.raises(ValueError, match=message):
      self.run(q, cache, np.zeros((2, 8), np.int32), **change.get("knobs", {}))
