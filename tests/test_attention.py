"""The MLA layer end to end on the reference backend: cache, absorbed decode, chunked prefill."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import reference
from mla_jax.attention import MLAAttention
from mla_jax.cache import LatentCache
from mla_jax.config import Llama4Scaling, MLAConfig
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step
from pallas_kernels.common import BATCH_INVARIANT_SPLIT_TOKENS

SMALL = MLAConfig.preset("DeepSeek-V3").replace(
    hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32)
BS, NB, MB = 8, 40, 6


def make_layer(config=SMALL, dtype=jnp.float32, seed=0):
  return DeepseekV2MLAAttention(config, backend="reference", dtype=dtype, param_dtype=dtype,
                                rngs=nnx.Rngs(seed))


_steps = {}


def run_schedule(layer, inputs, schedule, tables, cache, *, workspace=8192, decode_threshold=1,
                 dcp=1):
  """Feeds `schedule` (per step, tokens per request; 0 = idle) and returns each request's outputs.
  `dcp`: the metadata is built for a cache split over that many devices."""
  if id(layer) not in _steps:  # one jitted step per layer, so repeated shapes reuse compilations
    _steps[id(layer)] = (layer, jitted_step(layer, donate_cache=False))
  step = _steps[id(layer)][1]
  done = [0] * len(inputs)
  outs = [[] for _ in inputs]
  for q_lens in schedule:
    live = [i for i, q in enumerate(q_lens) if q]
    md, layout = build_metadata([RequestState(done[i], q_lens[i], tables[i]) for i in live],
                                block_size=cache.block_size, num_blocks=cache.num_blocks,
                                max_blocks_per_seq=MB, context_workspace=workspace,
                                decode_threshold=decode_threshold, dcp=dcp)
    x = layout.pack([inputs[i][done[i]:done[i] + q_lens[i]] for i in live])
    out, cache = step(jnp.asarray(x, layer.mla_attn.dtype), cache, md)
    for i, o in zip(live, layout.unpack(np.asarray(out, np.float32))):
      outs[i].append(o)
      done[i] += q_lens[i]
  return [np.concatenate(o) for o in outs], cache


def full_forward(layer, x):
  return np.asarray(layer.unabsorbed_forward(jnp.asarray(x, layer.mla_attn.dtype),
                                             jnp.arange(x.shape[0])), np.float32)


def random_inputs(lengths, seed, hidden=SMALL.hidden_size):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((n, hidden)).astype(np.float32) for n in lengths]


def inputs_for(schedule, seed):
  """Random token inputs, as many per request as the schedule feeds it."""
  return random_inputs(np.sum(schedule, axis=0), seed)


def tables_for(n_requests, seed, shuffle=True):
  order = np.random.default_rng(seed).permutation(NB) if shuffle else np.arange(NB)
  return [order[i * MB:(i + 1) * MB] for i in range(n_requests)]


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_prefill_then_decode_equals_full_forward_fp32(q_lora_rank):
  layer = make_layer(SMALL.replace(q_lora_rank=q_lora_rank))
  # Prefill (one request in two chunks of prompt), then single-token decode steps.
  schedule = [[10, 5, 25], [7, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 1]]
  inputs = inputs_for(schedule, seed=1)
  outs, _ = run_schedule(layer, inputs, schedule, tables_for(3, 0),
                         LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32))
  for x, got in zip(inputs, outs):
    np.testing.assert_allclose(got, full_forward(layer, x), rtol=1e-5, atol=1e-5)


def test_absorbed_decode_rows_equal_unabsorbed_math():
  """Only decode rows after the prompt: every output comes from the absorbed latent MQA."""
  layer = make_layer()
  x = random_inputs([24], seed=2)[0]
  schedule = [[1]] * 24  # a one-token prompt is a decode row too (query_len <= threshold)
  outs, _ = run_schedule(layer, [x], schedule, tables_for(1, 3),
                         LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32))
  np.testing.assert_allclose(outs[0], full_forward(layer, x), rtol=1e-5, atol=1e-5)


def test_multi_token_decode_rows():
  layer = make_layer()
  x = random_inputs([23], seed=4)[0]
  outs, _ = run_schedule(layer, [x], [[11], [4], [4], [4]], tables_for(1, 5),
                         LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32),
                         decode_threshold=4)
  np.testing.assert_allclose(outs[0], full_forward(layer, x), rtol=1e-5, atol=1e-5)


def test_bf16_layer_within_tolerance_of_fp32_math():
  layer = make_layer(dtype=jnp.bfloat16)
  schedule = [[14, 12], [6, 1], [0, 1], [0, 1]]
  inputs = inputs_for(schedule, seed=6)
  outs, _ = run_schedule(layer, inputs, schedule, tables_for(2, 7),
                         LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.bfloat16))
  f32 = make_layer(dtype=jnp.float32)
  nnx.update(f32, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer, nnx.Param)))
  f32.process_weights_after_loading()
  for x, got in zip(inputs, outs):
    ref = full_forward(f32, x[:got.shape[0]])
    cos_diff = 1 - 2 * np.sum(got * ref) / np.sum(got ** 2 + ref ** 2)
    assert cos_diff < 1e-4
    np.testing.assert_allclose(got, ref, atol=4 / 128 * np.abs(ref).max())


def test_fp8_cache_close_to_bf16_cache():
  layer = make_layer()
  schedule = [[12, 7], [6, 1], [0, 1], [0, 1]]
  inputs = inputs_for(schedule, seed=8)
  ref, _ = run_schedule(layer, inputs, schedule, tables_for(2, 9),
                        LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32))
  got, cache = run_schedule(layer, inputs, schedule, tables_for(2, 9),
                            LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float8_e4m3fn,
                                                 k_scale=0.05))
  assert cache.data.dtype == jnp.float8_e4m3fn
  for g, r in zip(got, ref):  # e4m3 keeps 3 mantissa bits: about 6% per cached value
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 0.03
    np.testing.assert_allclose(g, r, atol=0.1)


def test_shuffled_tables_and_nan_pages_equal_contiguous():
  layer = make_layer()
  schedule = [[8, 11], [11, 1], [0, 1]]
  inputs = inputs_for(schedule, seed=10)
  plain, _ = run_schedule(layer, inputs, schedule, tables_for(2, 0, shuffle=False),
                          LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32), workspace=8)
  poisoned = LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32)
  poisoned = LatentCache(jnp.full_like(poisoned.data, jnp.nan), poisoned.k_scale)
  shuffled, cache = run_schedule(layer, inputs, schedule, tables_for(2, 11), poisoned, workspace=8)
  assert np.isnan(np.asarray(cache.data)).any()  # unused pages really held NaN
  for a, b in zip(plain, shuffled):
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


def test_mixed_batch_equals_each_request_alone():
  layer = make_layer()
  schedule = [[9, 6, 16], [5, 1, 5], [0, 1, 1]]  # step 2 mixes decodes and prefills
  inputs, tables = inputs_for(schedule, seed=12), tables_for(3, 13)
  together, _ = run_schedule(layer, inputs, schedule, tables,
                             LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32),
                             workspace=16)
  for i in range(3):
    alone, _ = run_schedule(layer, [inputs[i]], [[s[i]] for s in schedule if s[i]], [tables[i]],
                            LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32),
                            workspace=16)
    np.testing.assert_allclose(together[i], alone[0], rtol=1e-5, atol=1e-5)


def test_a_poisoned_request_leaves_the_others_exact():
  # Request 1's hidden states hold NaN and inf in both prefill steps; the second step reads every
  # request's context back from the cache in chunks of 8 tokens, chunks and query blocks mixing
  # requests.
  layer = make_layer()
  schedule = [[9, 6, 16], [5, 7, 5]]
  inputs, tables = inputs_for(schedule, seed=16), tables_for(3, 17)
  clean, _ = run_schedule(layer, inputs, schedule, tables,
                          LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32), workspace=8)
  inputs[1][::2], inputs[1][1::4] = np.nan, np.inf
  poisoned, _ = run_schedule(layer, inputs, schedule, tables,
                             LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32),
                             workspace=8)
  assert np.isnan(poisoned[1]).any()  # the poison got in
  for i in (0, 2):
    assert np.isfinite(poisoned[i]).all()
    np.testing.assert_allclose(poisoned[i], clean[i], rtol=1e-5, atol=1e-5)


def test_chunked_context_equals_unchunked():
  layer = make_layer()
  schedule = [[20, 13], [10, 13]]  # the second step reads 33 context tokens back from the cache
  inputs = inputs_for(schedule, seed=14)
  outs = {}
  for workspace in (8, 8192):
    outs[workspace], _ = run_schedule(layer, inputs, schedule, tables_for(2, 15),
                                      LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32),
                                      workspace=workspace)
  reqs = [RequestState(20, 10, tables_for(2, 15)[0]), RequestState(13, 13, tables_for(2, 15)[1])]
  md, _ = build_metadata(reqs, block_size=BS, num_blocks=NB, max_blocks_per_seq=MB,
                         context_workspace=8)
  assert md.context_slots.shape[0] >= 4  # really chunked
  for a, b in zip(outs[8], outs[8192]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# (context tokens, new tokens) per request, read back in chunks of 8 context tokens, and the
# query rows of a chunk's attention (of 32 prefill rows).
CONTEXT_CASES = {
    # Chunks spanning requests (0 and 1, 1 and 2), a request without context, a last chunk of 4.
    "spanning": ([6, 6, 16, 0], [4, 4, 12, 12], 16),
    # The last request's window moved back to end at the prefill rows, over a request without
    # context; one request's context in whole chunks.
    "moved_back": ([16, 0, 12], [10, 9, 12], 16),
    # 6 chunks padded to 8 (two empty), a last chunk of 1 token, 8-row windows.
    "empty_chunks": ([24, 0, 17], [4, 12, 6], 8),
}


def context_step(layer, case, seed):
  """Caches each request's context (one step; every row no step writes holds NaN), then returns
  (inputs, metadata, x, cache) of the step that feeds the new tokens over it."""
  context, new, _ = CONTEXT_CASES[case]
  schedule = [context, new]
  inputs, tables = inputs_for(schedule, seed), tables_for(len(new), seed + 1)
  cached = [i for i, c in enumerate(context) if c]
  poisoned = LatentCache(jnp.full((NB, BS, SMALL.latent_dim), jnp.nan), jnp.float32(1.0))
  _, cache = run_schedule(layer, [inputs[i] for i in cached], [[context[i] for i in cached]],
                          [tables[i] for i in cached], poisoned, workspace=8)
  md, layout = build_metadata([RequestState(c, n, t) for c, n, t in zip(context, new, tables)],
                              block_size=BS, num_blocks=NB, max_blocks_per_seq=MB,
                              context_workspace=8, context_min_query_rows=8)
  x = layout.pack([x[c:] for x, c in zip(inputs, context)])
  return inputs, md, layout, jnp.asarray(x), cache


@pytest.mark.parametrize("case", sorted(CONTEXT_CASES))
def test_context_chunks_attend_only_their_requests_rows(case):
  layer = make_layer()
  inputs, md, layout, x, cache = context_step(layer, case, seed=21)
  # The windows are really narrower than the prefill rows.
  assert (md.context_query_rows, md.num_prefill_rows) == (CONTEXT_CASES[case][2], 32)
  step = _steps[id(layer)][1]
  out, _ = step(x, cache, md)
  for x_full, got in zip(inputs, layout.unpack(np.asarray(out))):
    np.testing.assert_allclose(got, full_forward(layer, x_full)[-got.shape[0]:], rtol=1e-5,
                               atol=1e-5)
  # The outputs of every chunk attending with all prefill rows (the rows outside a window would
  # see no key, and a merge with nothing leaves a row as it was), to float32 rounding: XLA may
  # block the narrower products differently (jax 0.12.1 with numpy 2.5 / flax 0.12.12: up to 6e-7
  # apart on ~30% of the outputs, of order 1), where a row attending the wrong keys is off by ~0.1.
  every_row, _ = step(x, cache, dataclasses.replace(md, context_query_rows=None))
  np.testing.assert_allclose(np.asarray(out), np.asarray(every_row), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("case", sorted(CONTEXT_CASES))
def test_split_k_pe_gives_the_joined_bits(case):
  # The keys' rope columns passed to the prefill apart (split_k_pe, the default; the reference
  # backend joins them inside), for the new tokens and every context chunk: the joined keys'
  # output bit for bit.
  layer = make_layer()
  assert layer.mla_attn.split_k_pe
  _, md, _, x, cache = context_step(layer, case, seed=22)
  joined = nnx.clone(layer)
  joined.mla_attn.split_k_pe = False
  split_out, _ = _steps[id(layer)][1](x, cache, md)
  out, _ = jitted_step(joined, donate_cache=False)(x, cache, md)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(split_out), np.asarray(out))


def test_same_padded_shapes_trace_once(monkeypatch):
  traces = []
  original = DeepseekV2MLAAttention.__call__

  def counting_call(self, *args):
    traces.append(1)
    return original(self, *args)

  monkeypatch.setattr(DeepseekV2MLAAttention, "__call__", counting_call)
  layer = make_layer()
  # Decode steps with 3 and then 1 live requests pad to the same 8-row bucket.
  schedule = [[4, 5, 7], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]]
  run_schedule(layer, inputs_for(schedule, seed=16), schedule, tables_for(3, 17),
               LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32))
  assert len(traces) == 2  # one prefill shape, one decode shape


def test_llama_4_scaling_scales_queries():
  base = make_layer()
  scaled = make_layer(SMALL.replace(
      llama_4_scaling=Llama4Scaling(beta=0.1, original_max_position_embeddings=8)))
  nnx.update(scaled, nnx.state(base, nnx.Param))
  x = jnp.asarray(random_inputs([5], seed=18)[0])
  pos = jnp.array([0, 7, 8, 20, 100])
  q0, kv0, _, _ = base.project(x, pos)
  q1, kv1, _, _ = scaled.project(x, pos)
  factor = 1 + 0.1 * np.log(1 + np.floor(np.array([0, 7, 8, 20, 100]) / 8))
  np.testing.assert_allclose(np.asarray(q1), np.asarray(q0) * factor[:, None, None], rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(kv1), np.asarray(kv0))


@pytest.mark.parametrize("built, match", [
    (dict(block_size=4), "metadata built for block_size=4, but the latent cache has block_size=8"),
    (dict(num_blocks=64),
     "metadata built for num_blocks=64, but the latent cache has num_blocks=40"),
    (dict(index_topk=8), "metadata built for index_topk=8 is used by a V2/V3 layer"),
    (dict(cache_kind="fp8_ds_mla"),
     "metadata built for cache kind=fp8_ds_mla, but the latent cache has cache kind=float32"),
])
def test_metadata_built_for_another_cache_or_layer_is_refused(built, match):
  layer = make_layer()
  md, _ = build_metadata([RequestState(0, 5, [0, 1])], **{
      "block_size": BS, "num_blocks": NB, "max_blocks_per_seq": MB, **built})
  with pytest.raises(ValueError, match=match):
    layer(jnp.zeros((md.num_rows, 64)), LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32),
          md)


def test_bad_input_raises():
  layer = make_layer()
  cache = LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32)
  md, _ = build_metadata([RequestState(0, 5, [0])], block_size=BS, num_blocks=NB,
                         max_blocks_per_seq=MB)
  with pytest.raises(ValueError, match="x must be"):
    layer(jnp.zeros((md.num_rows, 65)), cache, md)
  with pytest.raises(ValueError, match="x has 9 rows but the step's metadata has 8 .*layout.pack"):
    layer(jnp.zeros((md.num_rows + 1, 64)), cache, md)
  with pytest.raises(ValueError, match="positions must be"):
    layer.project(jnp.zeros((md.num_rows + 1, 64)), md.positions)
  with pytest.raises(ValueError, match="cache rows"):
    layer(jnp.zeros((md.num_rows, 64)), LatentCache.allocate(NB, BS, 100, jnp.float32), md)
  context, _ = build_metadata([RequestState(3, 5, [0])], block_size=BS, num_blocks=NB,
                              max_blocks_per_seq=MB)
  with pytest.raises(ValueError, match="context_query_rows 9 must be in"):
    layer(jnp.zeros((context.num_rows, 64)), cache,
          dataclasses.replace(context, context_query_rows=9))
  with pytest.raises(ValueError, match="kv_b_proj kernel"):
    layer.mla_attn.absorb(jnp.zeros((3, 3)))
  with pytest.raises(ValueError, match="unknown MLA backend"):
    DeepseekV2MLAAttention(SMALL, backend="nope", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="split_k_pe must be a bool"):
    MLAAttention(SMALL, backend="reference", split_k_pe="yes")


@pytest.mark.parametrize("batch_invariant,split_tokens", [(False, None),
                                                          (True, BATCH_INVARIANT_SPLIT_TOKENS)])
def test_batch_invariant_reaches_the_decode(monkeypatch, batch_invariant, split_tokens):
  # The layer's flag becomes the backend's fixed-split decode (its bit-exactness is tested per
  # backend in tests/decode_contract.py).
  seen = []
  original = reference.latent_decode
  monkeypatch.setattr(reference, "latent_decode",
                      lambda *a, **k: seen.append(k["split_tokens"]) or original(*a, **k))
  layer = DeepseekV2MLAAttention(SMALL, backend="reference", dtype=jnp.float32,
                                 param_dtype=jnp.float32, batch_invariant=batch_invariant,
                                 rngs=nnx.Rngs(0))
  schedule = [[5, 3], [1, 1]]
  run_schedule(layer, inputs_for(schedule, seed=19), schedule, tables_for(2, 20),
               LatentCache.allocate(NB, BS, SMALL.latent_dim, jnp.float32))
  assert seen == [split_tokens]  # traced once: the decode step
