"""Tensor parallelism (heads over "tp") and decode context parallelism (cache blocks over "dcp")
against the single-device layer, on 8 host CPU devices.

Those devices exist only when XLA_FLAGS asks for them before jax starts, and the other tests expect
one device, so sharding_worker.py runs every sharded case in one subprocess and reports what it
measured; the tests here judge the report.
"""

import math

import numpy as np
import pytest

from mla_jax import backends
from mla_jax.metadata import dcp_local_view
from sharding_worker import CFG, DENSE_CASES, DSA_CASES, WORKSPACE, run_with_host_devices
from test_attention import make_layer


@pytest.fixture(scope="module")
def report():
  return run_with_host_devices("sharding_worker.py")


def test_single_device_layer_calls_the_kernels_directly():
  attn = make_layer(CFG).mla_attn
  assert attn.mesh is None and attn.backend is backends.BACKENDS["reference"]


def test_dcp_local_view_packs_each_devices_visible_blocks():
  # Two rows of one request (table 5 2 7 1, pages of 8): 30 and 20 visible tokens. Device 0 owns
  # blocks 0-3, device 1 blocks 4-7; blocks past a row's window are not its to read.
  tables, lens = np.array([[5, 2, 7, 1], [5, 2, 7, 1]]), np.array([30, 20])
  view = lambda first: [np.asarray(a).tolist() for a in dcp_local_view(
      tables, lens, first_block=first, num_blocks=4, block_size=8)]
  assert view(0) == [[[2, 1, -1, -1], [2, -1, -1, -1]], [8 + 6, 8]]
  assert view(4) == [[[1, 3, -1, -1], [1, 3, -1, -1]], [8 + 8, 8 + 4]]


@pytest.mark.parametrize("tp,dcp", DENSE_CASES)
def test_prefill_and_decode_equal_single_device(report, tp, dcp):
  r = report["dense"][f"{tp}x{dcp}"]
  # fp32: only o_proj's summation order (partial sums per head group) and the LSE merge differ.
  assert r["max_abs_diff"] <= 1e-6 * r["max_abs_ref"] + 1e-6, r
  # Every write landed where the single device put it and nothing else changed (NaN pages stay).
  assert r["cache_equal"]
  assert r["cache_spec"] == ("P('dcp',)" if dcp > 1 else "P()")  # the step keeps the cache's split


@pytest.mark.parametrize("tp,dcp", DENSE_CASES)
def test_compiled_step_moves_activations_not_the_cache(report, tp, dcp):
  r = report["dense"][f"{tp}x{dcp}"]
  colls = r["collectives"]
  assert all(c["op"] == "all-reduce" for c in colls), colls  # no all-gather, permute, all-to-all
  sizes = [math.prod(dims) for c in colls for _, dims in c["shapes"]]
  assert all(n < r["cache_shard_elements"] for n in sizes), (sizes, r["cache_shard_elements"])
  shapes = {tuple(dims) for c in colls for _, dims in c["shapes"]}
  # o_proj's head-split contraction, reduced by the all-reduce XLA inserts.
  assert ((r["rows"], CFG.hidden_size) in shapes) == (tp > 1), shapes
  # dcp: the decode rows' partial (o, lse) of this device's heads merged across the cache shards,
  # and the prefill context rows gathered from their owners.
  local = (r["decode_rows"], CFG.num_heads // tp)
  expected = {local + (CFG.kv_lora_rank,), local, (WORKSPACE, CFG.latent_dim)}
  assert expected <= shapes if dcp > 1 else not expected & shapes, shapes
  if tp == dcp == 1:
    assert not colls


@pytest.mark.parametrize("tp,kind", DSA_CASES)
def test_v32_sparse_layer_under_tp_equals_single_device(report, tp, kind):
  r = report["dsa"][f"{tp}-{kind}"]
  assert r["same_selection"]  # the replicated indexer picks what the single device picks
  assert r["max_abs_diff"] <= 1e-5, r


@pytest.mark.parametrize("misuse,message", [
    ("heads_over_tp3", "not divisible by tp_size"),
    ("blocks_over_dcp4", "do not divide over dcp"),
    ("dsa_cache_over_dcp2", "LatentCache only"),
    ("explicit_mesh", "Auto axes"),
])
def test_misuse_raises_value_error(report, misuse, message):
  assert message in (report["errors"][misuse] or "accepted"), report["errors"][misuse]
