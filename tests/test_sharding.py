"""Tensor parallelism (heads over "tp") and decode context parallelism (cache blocks over "dcp")
against the single-device layer, on 8 host CPU devices.

Those devices exist only when XLA_FLAGS asks for them before jax starts, and the other tests expect
one device, so sharding_worker.py runs every sharded case in one subprocess and reports what it
measured; the tests here judge the report.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from mla_jax import backends, reference
from mla_jax.cache import IndexerKCache
from mla_jax.metadata import dcp_seq_lens, dcp_tables
from mla_jax.sharded_backend import merge_topk, shard_backend
from sharding_worker import (CFG, DENSE_CASES, DSA_CASES, WORKSPACE, case_name,
                             run_with_host_devices)
from test_attention import make_layer


@pytest.fixture(scope="module")
def report():
  return run_with_host_devices("sharding_worker.py")


def test_single_device_layer_calls_the_kernels_directly():
  attn = make_layer(CFG).mla_attn
  assert attn.mesh is None and attn.backend is backends.BACKENDS["reference"]


def test_dcp_tables_pack_each_devices_blocks():
  # One request (table 5 2 7 1, pages of 8), rows seeing 30 and 20 tokens. Device 0 owns blocks
  # 0-3, device 1 blocks 4-7; a row's window counts only the blocks it reaches.
  tables = np.array([[5, 2, 7, 1]])
  assert dcp_tables(tables, 8, 2).tolist() == [[[2, 1, -1, -1]], [[1, 3, -1, -1]]]
  lens = dcp_seq_lens(np.repeat(tables, 2, 0), np.array([30, 20]), dcp=2, num_blocks=8,
                      block_size=8)
  assert lens.tolist() == [[8 + 6, 8], [8 + 8, 8 + 4]]


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_views_hold_each_window_exactly_once(dcp):
  # The first dcp_seq_lens tokens of each device's packed table are the row's window, split.
  rng = np.random.default_rng(dcp)
  nb, bs, mb = 32, 4, 7
  tables = np.stack([rng.permutation(nb)[:mb] for _ in range(5)])
  tables[1, 5:] = -1
  lens = np.array([28, 17, 1, 9, 0])
  local, held = dcp_tables(tables, nb, dcp), dcp_seq_lens(tables, lens, dcp=dcp, num_blocks=nb,
                                                          block_size=bs)
  np.testing.assert_array_equal(np.asarray(held), dcp_seq_lens(  # traced form, same numbers
      jnp.asarray(tables), jnp.asarray(lens), dcp=dcp, num_blocks=nb, block_size=bs))
  for r in range(len(tables)):
    pos = np.arange(lens[r])
    window = tables[r][pos // bs] * bs + pos % bs
    seen = [(d * nb // dcp + local[d, r][p // bs]) * bs + p % bs
            for d in range(dcp) for p in range(held[d, r])]
    assert sorted(seen) == sorted(window.tolist())


def test_merged_top_k_is_the_whole_rows_top_k_with_its_ties():
  # Scores from a few levels, so many ties, some -inf; two or four devices own stripes of blocks.
  rng = np.random.default_rng(0)
  k, s, bs = 8, 64, 4
  logits = rng.integers(0, 5, (6, s)).astype(np.float32)
  logits[rng.random((6, s)) < 0.2] = -np.inf
  lens = np.array([64, 40, 9, 3, 0, 33], np.int32)
  want = reference.topk_positions(jnp.asarray(logits), jnp.asarray(lens), k)
  for dcp in (2, 4):
    owner = (np.arange(s) // bs) % dcp
    cands = []
    for d in range(dcp):
      own = jnp.asarray(np.where(owner == d, logits, -np.inf))
      pos = reference.topk_positions(own, jnp.asarray(lens), k)
      cands.append((jnp.where(pos >= 0, jnp.take_along_axis(own, jnp.maximum(pos, 0), 1),
                              -jnp.inf), pos))
    got = merge_topk(jnp.concatenate([c[0] for c in cands], 1),
                     jnp.concatenate([c[1] for c in cands], 1), k)
    assert np.array_equal(np.sort(np.asarray(got), 1), np.sort(np.asarray(want), 1)), dcp


def test_sharded_indexer_passes_the_distinct_tables_hint_on():
  # The per-shard backend gets the caller's hint (a one-device mesh here; the dcp path passes the
  # same partial, and the worker's decode steps run it).
  hints = []

  def recorded(*args, **kwargs):
    hints.append(kwargs["distinct_tables"])
    return backends.REFERENCE.indexer_logits(*args, **kwargs)
  be = shard_backend(dataclasses.replace(backends.REFERENCE, indexer_logits=recorded),
                     Mesh(np.array(jax.devices()[:1]), ("tp",)))
  args = (jnp.zeros((2, 4, 32), jnp.float8_e4m3fn), jnp.zeros((2, 4), jnp.float32),
          IndexerKCache.allocate(3, 8, 32), jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32))
  for hint in (True, False):
    jax.eval_shape(functools.partial(be.indexer_logits, distinct_tables=hint), *args)
  assert hints == [True, False]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: case_name(*c))
def test_prefill_and_decode_equal_single_device(report, case):
  r = report["dense"][case_name(*case)]
  # fp32: only o_proj's summation order (partial sums per head group) and the LSE merge differ.
  assert r["max_abs_diff"] <= 1e-6 * r["max_abs_ref"] + 1e-6, r
  # Every write landed where the single device put it and nothing else changed (NaN pages stay).
  assert r["cache_equal"]
  assert r["cache_spec"] == ("P('dcp',)" if case[1] > 1 else "P()")  # the step keeps the split


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: case_name(*c))
def test_compiled_step_moves_activations_not_the_cache(report, case):
  tp, dcp, merge = case
  r = report["dense"][case_name(*case)]
  colls = r["collectives"]
  gathered = merge == "all_gather" and dcp > 1
  # No permute or all-to-all; all-gathers only of the partial attentions (all_gather merge).
  assert all(c["op"] == "all-reduce" or (gathered and c["op"] == "all-gather")
             for c in colls), colls
  sizes = [math.prod(dims) for c in colls for _, dims in c["shapes"]]
  assert all(n < r["cache_shard_elements"] for n in sizes), (sizes, r["cache_shard_elements"])
  shapes = {tuple(dims) for c in colls for _, dims in c["shapes"]}
  deferred = merge == "o_proj" and dcp > 1
  # o_proj's head-split contraction (and the "o_proj" merge's dcp parts), reduced by the
  # all-reduce XLA inserts.
  assert ((r["rows"], CFG.hidden_size) in shapes) == (tp > 1 or deferred), shapes
  # dcp: the decode rows' partial (o, lse) of this device's heads merged across the cache shards
  # (only the lse for the "o_proj" merge), and the prefill context rows gathered from their owners.
  local = (r["decode_rows"], CFG.num_heads // tp)
  o_part = local + (CFG.kv_lora_rank,)
  parts = ({(dcp,) + o_part, (dcp,) + local} if gathered else {local} if deferred
           else {o_part, local})
  expected = parts | {(WORKSPACE, CFG.latent_dim)}
  assert expected <= shapes if dcp > 1 else not expected & shapes, shapes
  if deferred:  # no attention output of any width crosses devices before o_proj
    assert not any(len(s) == 3 and s[:2] == local for s in shapes), shapes
  if tp == dcp == 1:
    assert not colls


@pytest.mark.parametrize("case", DSA_CASES, ids=lambda c: case_name(*c))
def test_v32_sparse_layer_equals_single_device(report, case):
  tp, dcp, *_ = case
  r = report["dsa"][case_name(*case)]
  # The replicated indexer (tp), or each device's own candidates merged (dcp), picks exactly what
  # the single device picks, at every row of a mixed prefill/decode schedule.
  assert r["same_selection"]
  assert r["max_abs_diff"] <= 1e-5, r
  assert r["cache_equal"]  # latent (dense or fp8_ds_mla) and indexer caches, bit for bit
  assert r["cache_specs"] == (["P('dcp',)"] if dcp > 1 else ["P()"]), r
  # No collective carries a cache (whole or one device's shard): only rows' selections and
  # partial attentions cross devices.
  colls = r["collectives"]
  sizes = {math.prod(dims) for c in colls for _, dims in c["shapes"]}
  assert not sizes & set(r["cache_sizes"]), (sizes, r["cache_sizes"])
  assert all(c["op"] in ("all-reduce", "all-gather") for c in colls), colls
  assert any(c["op"] == "all-gather" for c in colls) == (dcp > 1)  # the top-k candidates


@pytest.mark.parametrize("misuse,message", [
    ("heads_over_tp3", "not divisible by tp_size"),
    ("blocks_over_dcp4", "do not divide over dcp"),
    ("metadata_without_dcp", "build_metadata(..., dcp=2)"),
    ("place_metadata_for_another_dcp", "build_metadata(..., dcp=4)"),
    ("dcp_merge_unknown", "unknown dcp_merge"),
    ("explicit_mesh", "Auto axes"),
])
def test_misuse_raises_value_error(report, misuse, message):
  assert message in (report["errors"][misuse] or "accepted"), report["errors"][misuse]
