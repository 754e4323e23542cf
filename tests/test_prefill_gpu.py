"""Prefill backends at real shapes on the GPU, against the XLA reference run there (f32, HIGHEST).

Request starts off a multiple of 8 rows, and padded arrays, exercise the Mosaic kernel's aligned
bulk-copy boxes and its output tiles (the poisoned allocator shows a row it never writes); the
short cases its persistent queue with many items a program.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.bench_prefill import context_setup
from gpu_utils import poison_allocator
from mla_jax import reference
from mla_jax.backends import get_backend
from pallas_kernels import mosaic_prefill
from prefill_contract import DK, DV, ROPE, SCALE, assert_close, cumulative

pytestmark = pytest.mark.gpu

# (heads, causal, query lengths, key lengths): 16384 new tokens in several requests, and a
# context chunk (non-causal, keys from another array, len_k != len_q).
CASES = {
    "n128_causal": (128, True, [8192, 4096, 3001, 1095], [8192, 4096, 3001, 1095]),
    "n16_causal": (16, True, [9000, 5000, 2000, 384], [9000, 5000, 2000, 384]),
    "n16_causal_one_request": (16, True, [4096], [4096]),
    "n16_context": (16, False, [3000, 1000, 0, 200], [2048, 4096, 100, 0]),
    # Short: several items a program in the Mosaic kernel's queue (one request: rows in place).
    "n128_causal_short": (128, True, [1000, 1, 300, 0, 7], [1000, 1, 300, 50, 7]),
    "n128_causal_short_one_request": (128, True, [1021], [1021]),
}


@pytest.mark.parametrize("backend", ["pallas", "pallas_triton", "pallas_mosaic"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_matches_reference(case, backend):
  check_case(case, get_backend(backend).prefill)


# The Mosaic kernel's other orders beside its default (the grid at 16384 tokens, the queue in
# 32 MiB L2 sections when short): the queue at 16384 tokens (2 heads a section), the short batch
# in the queue without sections and in the grid (each writing its tiles in place:
# the poisoned allocator shows a row neither written whole nor row by row); the ping-pong
# schedule (the default before intra_overlap) on the 16384-token batch's grid and the short
# batch's queue; the per-item knobs (prefetch_q, first_step_unmasked, diagonal_half: the default
# from 64 heads since session 14, on in the 128-head cases above) off on the short batch's queue
# and the 16384-token batch's grid, on in the 16-head context chunk (ragged ends halved).
_KNOBS_OFF = dict(prefetch_q=False, first_step_unmasked=False, diagonal_half=False)


@pytest.mark.parametrize("case, knobs", [
    ("n128_causal", dict(persistent=True)),
    ("n128_causal_short", dict(persistent=True, l2_section_bytes=None)),
    ("n128_causal_short", dict(persistent=False)),
    ("n128_causal", dict(ping_pong=True, intra_overlap=False)),
    ("n128_causal_short", dict(ping_pong=True, intra_overlap=False)),
    ("n128_causal_short", _KNOBS_OFF),
    ("n128_causal", _KNOBS_OFF),
    ("n16_context", dict(prefetch_q=True, first_step_unmasked=True, diagonal_half=True)),
], ids=["queue", "short-unsectioned", "short-grid", "ping-pong", "short-ping-pong",
        "short-knobs_off", "knobs_off", "context-knobs_on"])
def test_mosaic_variants_match_reference(case, knobs):
  check_case(case, functools.partial(mosaic_prefill.mla_prefill, **knobs))


# The prefill contract's split form (k_pe apart, the layer's `split_k_pe`): the same bits as the
# keys joined, and the reference's outputs within bf16 tolerance.
@pytest.mark.parametrize("backend", ["pallas", "pallas_mosaic"])
@pytest.mark.parametrize("case", ["n128_causal", "n16_context", "n128_causal_short"])
def test_split_keys_match_reference_and_joined_keys(case, backend):
  check_case(case, get_backend(backend).prefill, split=True)


def check_case(case, prefill, split=False):
  """prefill on CASES[case] (poisoned allocator) against the XLA reference. split: the keys' last
  ROPE columns are the same for every head, given to prefill apart (k_pe) and the output must be
  the joined keys' bit for bit."""
  n, causal, len_q, len_k = CASES[case]
  cu_q, cu_k = cumulative(len_q), cumulative(len_k)
  tq, tk = int(cu_q[-1]) + 37, int(cu_k[-1]) + 5  # padded rows and stray keys past the last request
  keys = jax.random.split(jax.random.key(sum(len_q) + n), 3)
  q = jax.random.normal(keys[0], (tq, n, DK), jnp.bfloat16)
  k = jax.random.normal(keys[1], (tk, n, DK), jnp.bfloat16)
  v = jax.random.normal(keys[2], (tk, n, DV), jnp.bfloat16)
  cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
  run = functools.partial(prefill, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, scale=SCALE,
                          causal=causal, max_seqlen_q=max(len_q))
  if split:
    k_pe = jax.random.normal(jax.random.fold_in(keys[1], 1), (tk, ROPE), jnp.bfloat16)
    k = k.at[..., DK - ROPE:].set(jnp.broadcast_to(k_pe[:, None], (tk, n, ROPE)))
    poison_allocator()
    o, lse = run(q, k[..., :DK - ROPE], v, k_pe=k_pe)
    joined_o, joined_lse = run(q, k, v)
    np.testing.assert_array_equal(np.asarray(o.astype(jnp.float32)),
                                  np.asarray(joined_o.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(joined_lse))
  else:
    poison_allocator()
    o, lse = run(q, k, v)
  ref = jax.jit(reference.mha_prefill, static_argnames=("scale", "causal"))
  ref_o, ref_lse = ref(q, k, v, cu_q, cu_k, scale=SCALE, causal=causal)
  magnitude, _ = ref(q, k, jnp.abs(v), cu_q, cu_k, scale=SCALE, causal=causal)
  o, lse = np.asarray(o.astype(jnp.float32)), np.asarray(lse)
  assert_close(o, np.asarray(ref_o.astype(jnp.float32)), jnp.bfloat16,
               np.asarray(magnitude.astype(jnp.float32)))
  assert_close(lse, np.asarray(ref_lse), jnp.bfloat16)
  tail = int(cu_q[-1])
  assert (o[tail:] == 0).all() and (lse[tail:] == -np.inf).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_other_dtypes_compile_and_match(dtype):
  """f32 (IEEE dots, its own block table entry) and f16 at a small shape; CPU interpret mode
  does not enforce Triton's rules, so only a GPU run proves they compile."""
  cu = cumulative([300, 0, 129])
  keys = jax.random.split(jax.random.key(3), 3)
  q, k = (jax.random.normal(key, (440, 4, DK), dtype) for key in keys[:2])
  v = jax.random.normal(keys[2], (440, 4, DV), dtype)
  o, lse = get_backend("pallas_triton").prefill(q, k, v, jnp.asarray(cu), jnp.asarray(cu),
                                                scale=SCALE, causal=True, max_seqlen_q=300)
  ref_o, ref_lse = reference.mha_prefill(q, k, v, jnp.asarray(cu), jnp.asarray(cu), scale=SCALE,
                                         causal=True)
  magnitude, _ = reference.mha_prefill(q, k, jnp.abs(v), jnp.asarray(cu), jnp.asarray(cu),
                                       scale=SCALE, causal=True)
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  assert_close(f32(o), f32(ref_o), dtype, f32(magnitude))
  assert_close(lse, np.asarray(ref_lse), dtype)


@pytest.mark.parametrize("backend", ["reference", "pallas_triton", "pallas_mosaic"])
def test_a_poisoned_request_leaves_the_others_exact(backend):
  # Request 1's queries, keys and values are NaN, inf and -inf in turn: the other requests' rows
  # must come out as they do when request 1 is clean.
  len_q, len_k = [3001, 1000, 2500], [3001, 1500, 2500]
  cu_q, cu_k = jnp.asarray(cumulative(len_q)), jnp.asarray(cumulative(len_k))
  keys = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(keys[0], (int(cu_q[-1]), 16, DK), jnp.bfloat16)
  k = jax.random.normal(keys[1], (int(cu_k[-1]), 16, DK), jnp.bfloat16)
  v = jax.random.normal(keys[2], (int(cu_k[-1]), 16, DV), jnp.bfloat16)
  poison = lambda x, lo, hi: x.at[lo:hi:3].set(jnp.nan).at[lo + 1:hi:3].set(jnp.inf).at[
      lo + 2:hi:3].set(-jnp.inf)
  bad = (poison(q, int(cu_q[1]), int(cu_q[2])), poison(k, int(cu_k[1]), int(cu_k[2])),
         poison(v, int(cu_k[1]), int(cu_k[2])))
  prefill = get_backend(backend).prefill
  run = lambda q, k, v: prefill(q, k, v, cu_q, cu_k, scale=SCALE, causal=True,
                                max_seqlen_q=max(len_q))
  (o, lse), (want_o, want_lse) = run(*bad), run(q, k, v)
  others = np.r_[0:int(cu_q[1]), int(cu_q[2]):int(cu_q[3])]
  f32 = lambda x: np.asarray(x.astype(jnp.float32))[others]
  assert_close(f32(o), f32(want_o), jnp.bfloat16)
  assert_close(f32(lse), f32(want_lse), jnp.bfloat16)


def test_layer_context_split_k_pe_gives_the_joined_bits():
  # The layer's chunked-context prefill at N=128 (the cases of the test below) with the keys'
  # rope columns apart (`split_k_pe`, the default: the Mosaic kernel copies the shared k_pe
  # boxes itself, no [T, N, 192] keys built) against the joined keys: the same keys, the same
  # kernel steps, so the same bits (a tolerance first, so that a failure says how far off it is).
  contexts, news = [3000, 2000, 0, 5000], [700, 1500, 900, 1000]
  joined, q, kv_c, k_pe, cache, md = context_setup(contexts, news, 128, 4096, "pallas_mosaic")
  joined.split_k_pe = False
  split = nnx.clone(joined)
  split.split_k_pe = True
  prefill = jax.jit(lambda layer: layer._prefill(q, kv_c, k_pe, cache, md))
  poison_allocator()
  got, want = (np.asarray(prefill(layer).astype(jnp.float32)) for layer in (split, joined))
  rows = int(md.prefill_query_start_loc[-1])
  scale = np.broadcast_to(np.abs(want[:rows]).max(axis=-1, keepdims=True), want[:rows].shape)
  assert_close(got[:rows], want[:rows], jnp.bfloat16, scale)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", ["pallas_triton", "pallas_mosaic"])
def test_layer_context_chunks_take_their_rows_exactly(backend):
  # The layer's chunked-context prefill at N=128 (4096-key chunks: one holds requests 0 and 1,
  # one requests 1 and 3, one request 3 alone, one is empty; request 2 has no context): each
  # chunk attends with the 4096 rows from its first request's (not 8-aligned in two chunks; the
  # Mosaic kernel's queue), against all 8192 prefill rows (its grid) as before the windows: the
  # same bits, and the reference backend's outputs within bf16 tolerance.
  contexts, news = [3000, 2000, 0, 5000], [700, 1500, 900, 1000]
  layer, q, kv_c, k_pe, cache, md = context_setup(contexts, news, 128, 4096, backend)
  assert (md.context_query_rows, md.num_prefill_rows, md.context_slots.shape[0]) == (4096, 8192, 4)
  prefill = jax.jit(lambda layer, md: layer._prefill(q, kv_c, k_pe, cache, md))
  poison_allocator()
  got = prefill(layer, md)
  every_row = prefill(layer, dataclasses.replace(md, context_query_rows=None))
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(every_row.astype(jnp.float32)))
  ref_layer = context_setup(contexts, news, 128, 4096, "reference")[0]
  want = prefill(ref_layer, md)
  rows = int(md.prefill_query_start_loc[-1])
  f32 = lambda x: np.asarray(x[:rows].astype(jnp.float32))
  got, want = f32(got), f32(want)
  # The relative part of the tolerance is taken of each (row, head)'s largest output: its value
  # is an LSE merge of bf16-rounded chunk outputs (larger than their cancelled sum), so |want|
  # alone is too tight (H200: 4293 of 133M elements off, worst 0.0156, one bf16 step of a value
  # in [2, 4), where |want| < 1; the same bits as the all-rows path before the windows).
  scale = np.broadcast_to(np.abs(want).max(axis=-1, keepdims=True), want.shape)
  assert_close(got, want, jnp.bfloat16, scale)
