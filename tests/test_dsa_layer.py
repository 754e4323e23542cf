"""The V3.2 layer: indexer selection, sparse attention through the cache, shortcut, reuse."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax import backends, indexer
from mla_jax.cache import DSACache, DSMLACache, IndexerKCache, LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step
from mla_jax.weights import load_attention_weights
from sparse_contract import indexer_logits_np

TOPK = 8
CFG = MLAConfig.preset("DeepSeek-V3.2").replace(
    hidden_size=64, num_heads=4, q_lora_rank=32, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=TOPK)
BS, NB, MB = 8, 24, 6


def make_layer(seed=0, fp8=True):
  return DeepseekV2MLAAttention(CFG, backend="reference", dtype=jnp.float32,
                                param_dtype=jnp.float32, indexer_fp8=fp8, rngs=nnx.Rngs(seed))


def make_cache(kind):
  latent = (LatentCache.allocate(NB, BS, CFG.latent_dim, jnp.float32) if kind == "latent"
            else DSMLACache.allocate(NB, BS, CFG.kv_lora_rank, CFG.qk_rope_head_dim))
  return DSACache(latent, IndexerKCache.allocate(NB, BS, CFG.index_head_dim))


def run(layer, inputs, schedule, tables, cache, *, decode_threshold=1, index_topk=TOPK, given=None,
        dcp=1):
  """Feeds the schedule; returns per-request outputs, per-request selections, the cache.
  `dcp`: the metadata is built for a cache split over that many devices."""
  done = [0] * len(inputs)
  outs, sels = [[] for _ in inputs], [[] for _ in inputs]
  for step, q_lens in enumerate(schedule):
    live = [i for i, q in enumerate(q_lens) if q]
    md, layout = build_metadata([RequestState(done[i], q_lens[i], tables[i]) for i in live],
                                block_size=BS, num_blocks=NB, max_blocks_per_seq=MB,
                                decode_threshold=decode_threshold, index_topk=index_topk,
                                dcp=dcp)
    x = layout.pack([inputs[i][done[i]:done[i] + q_lens[i]] for i in live])
    kw = {} if given is None else {"topk_positions": jnp.asarray(layout.pack(given[step], fill=-1))}
    out, cache, sel = layer(jnp.asarray(x), cache, md, return_topk=True, **kw)
    for i, o, s in zip(live, layout.unpack(out), layout.unpack(sel)):
      outs[i].append(o)
      sels[i].append(s)
      done[i] += q_lens[i]
  return [np.concatenate(o) for o in outs], sels, cache


def selection_mask(sels, n):
  """[n, n] mask: row t may see position p iff p is in row t's selection."""
  rows = np.concatenate(sels)
  mask = np.zeros((n, n), bool)
  for t, sel in enumerate(rows):
    mask[t, sel[sel >= 0]] = True
  return mask


def masked_forward(layer, x, mask):
  return np.asarray(layer.unabsorbed_forward(jnp.asarray(x), jnp.arange(x.shape[0]),
                                             key_mask=jnp.asarray(mask)))


SCHEDULE = [[14, 9], [5, 1], [0, 1], [0, 1]]  # prompts longer than top-k, then decodes


def inputs_for(schedule, seed):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((n, CFG.hidden_size)).astype(np.float32) for n in np.sum(schedule, 0)]


def tables(seed, n=2):
  return np.random.default_rng(seed).permutation(NB)[:n * MB].reshape(n, MB)


@pytest.mark.parametrize("fp8", [True, False])
def test_layer_equals_dense_attention_masked_by_its_selection(fp8):
  layer = make_layer(fp8=fp8)
  inputs = inputs_for(SCHEDULE, 1)
  outs, sels, _ = run(layer, inputs, SCHEDULE, tables(2), layer.allocate_cache(NB, BS))
  for x, got, sel in zip(inputs, outs, sels):
    n = x.shape[0]
    mask = selection_mask(sel, n)
    assert mask.sum(1).max() == TOPK and (mask.sum(1) == np.minimum(np.arange(n) + 1, TOPK)).all()
    assert (mask <= np.tril(np.ones((n, n), bool))).all()  # causal
    np.testing.assert_allclose(got, masked_forward(layer, x, mask), rtol=1e-5, atol=1e-5)


def test_indexer_row_chunks_give_the_same_selection(monkeypatch):
  layer = make_layer()
  inputs = inputs_for(SCHEDULE, 15)
  _, whole, _ = run(layer, inputs, SCHEDULE, tables(16), make_cache("latent"))
  # Room for one row's scores only: every row becomes its own chunk.
  monkeypatch.setattr(indexer, "SCORE_BYTES_BOUND", CFG.index_n_heads * MB * BS * 4)
  _, chunked, _ = run(layer, inputs, SCHEDULE, tables(16), make_cache("latent"))
  for a, b in zip(whole, chunked):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)


def test_indexer_hints_distinct_tables_for_decode_only_steps():
  # Windows past top-k, so the indexer scores them: decode rows only (one a request) tell the
  # backend its rows are distinct requests; a step with prefill rows does not. Traced only.
  hints = []

  def recorded(*args, **kwargs):
    hints.append(kwargs["distinct_tables"])
    return backends.REFERENCE.indexer_logits(*args, **kwargs)
  backend = dataclasses.replace(backends.REFERENCE, indexer_logits=recorded)
  layer = indexer.Indexer(CFG, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  k_cache = make_cache("latent").indexer
  for q_lens, distinct in [([1, 1], True), ([5, 1], False), ([14, 9], False)]:
    md, _ = build_metadata([RequestState(11, q, t) for q, t in zip(q_lens, tables(19))],
                           block_size=BS, num_blocks=NB, max_blocks_per_seq=MB, index_topk=TOPK)
    assert not md.within_topk
    rows = md.num_rows
    jax.eval_shape(lambda md=md, rows=rows: layer(
        jnp.zeros((rows, CFG.hidden_size)), jnp.zeros((rows, CFG.q_lora_rank)), k_cache, md,
        backend))
    assert hints.pop() == distinct and not hints, q_lens


def test_fp8_ds_mla_cache_close_to_bf16_cache_with_same_selection():
  layer = make_layer()
  inputs = inputs_for(SCHEDULE, 3)
  ref, sels, _ = run(layer, inputs, SCHEDULE, tables(4), make_cache("latent"))
  got, _, cache = run(layer, inputs, SCHEDULE, tables(4), make_cache("ds_mla"), given=None)
  assert isinstance(cache.latent, DSMLACache)
  for g, r in zip(got, ref):
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 0.05


def _indexer_oracle(layer, x, positions, cache, rows_tables, lens):
  """Top-k sets from float64 logits of the indexer's own (quantized) q, weights and cached k."""
  q, w, _ = layer.indexer.project(jnp.asarray(x), layer.project(jnp.asarray(x), positions).q_c,
                                  positions)
  k = np.asarray(cache.values.astype(jnp.float32)).reshape(NB * BS, -1)
  ks = np.asarray(cache.scales).reshape(-1)
  out = []
  for t in range(x.shape[0]):
    slots = np.array([rows_tables[t][p // BS] * BS + p % BS for p in range(MB * BS)])
    vis = (np.arange(MB * BS) < lens[t])[None]
    logits = indexer_logits_np(np.asarray(q[t:t + 1].astype(jnp.float32)), np.asarray(w[t:t + 1]),
                               k[slots], ks[slots], vis)[0]
    out.append(logits)
  return out


@pytest.mark.parametrize("decode_threshold,q_lens", [(1, [20, 1]), (1, [13, 13]), (4, [3, 2])])
def test_indexer_topk_sets_equal_brute_force(decode_threshold, q_lens):
  """Prefill rows, decode rows, multi-token decode rows: each sees only its causal window."""
  layer = make_layer(seed=5)
  ctx = [0, 11] if q_lens != [20, 1] else [0, 15]
  tab = tables(6)
  rng = np.random.default_rng(7)
  cache = make_cache("latent")
  xs = [rng.standard_normal((c + q, CFG.hidden_size)).astype(np.float32)
        for c, q in zip(ctx, q_lens)]
  if ctx[1]:  # put request 1's context in the caches first
    md0, lay0 = build_metadata([RequestState(0, ctx[1], tab[1])], block_size=BS, num_blocks=NB,
                               max_blocks_per_seq=MB, index_topk=TOPK)
    _, cache = layer(jnp.asarray(lay0.pack([xs[1][:ctx[1]]])), cache, md0)
  md, lay = build_metadata([RequestState(c, q, tab[i])
                            for i, (c, q) in enumerate(zip(ctx, q_lens))],
                           block_size=BS, num_blocks=NB, max_blocks_per_seq=MB,
                           decode_threshold=decode_threshold, index_topk=TOPK)
  x = lay.pack([xs[i][ctx[i]:] for i in range(2)])
  _, cache, sel = layer(jnp.asarray(x), cache, md, return_topk=True)
  rows_tables = np.asarray(md.row_block_tables())
  logits = _indexer_oracle(layer, x, md.positions, cache.indexer, rows_tables,
                           np.asarray(md.seq_lens))
  sel = np.asarray(sel)
  for t in np.flatnonzero(np.asarray(md.seq_lens)):
    n_vis = int(md.seq_lens[t])
    chosen = sel[t][sel[t] >= 0]
    assert len(chosen) == min(TOPK, n_vis) and (chosen < n_vis).all()
    rest = np.setdiff1d(np.arange(n_vis), chosen)
    if len(rest):
      assert logits[t][chosen].min() >= logits[t][rest].max() - 1e-5


def test_short_windows_take_the_dense_shortcut_with_the_same_result():
  layer = make_layer()
  schedule = [[5, 3], [1, 2], [1, 1]]  # every row sees <= TOPK tokens
  inputs = inputs_for(schedule, 8)
  dense, sel_d, _ = run(layer, inputs, schedule, tables(9), make_cache("latent"))
  sparse, sel_s, _ = run(layer, inputs, schedule, tables(9), make_cache("latent"), index_topk=None)
  for a, b in zip(dense, sparse):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  for a, b in zip(sel_d, sel_s):  # the shortcut's selection is the whole window, as top-k's is
    for x, y in zip(a, b):
      np.testing.assert_array_equal(np.sort(x, -1), np.sort(y, -1))


@pytest.mark.parametrize("kind", ["latent", "ds_mla"])
def test_selection_slots_written_by_the_topk_kernel(monkeypatch, kind):
  # The layer takes the selection's latent-cache slots from the top-k (`Backend.topk_slots`),
  # here pallas_triton's kernel (interpreted), the rest the reference. Given that selection back
  # as reused positions, the layer maps them itself (`cache.positions_to_slots`): the same
  # positions in the same order, so the outputs are the same bits only if the kernel's slots are
  # exactly the mapped ones (the tables are shuffled and span blocks of several requests).
  calls = []

  def topk_slots(*args, **kwargs):
    calls.append(kwargs)
    return backends.PALLAS_TRITON.topk_slots(*args, **kwargs)
  mixed = dataclasses.replace(backends.REFERENCE, name="mixed", topk_slots=topk_slots)
  monkeypatch.setattr(backends, "BACKENDS", {**backends.BACKENDS, "mixed": mixed})
  layer = DeepseekV2MLAAttention(CFG, backend="mixed", dtype=jnp.float32, param_dtype=jnp.float32,
                                 rngs=nnx.Rngs(20))
  inputs = inputs_for(SCHEDULE, 21)
  fused, sels, _ = run(layer, inputs, SCHEDULE, tables(22), make_cache(kind))
  assert calls and all(kw == {"block_size": BS, "num_blocks": NB} for kw in calls)
  calls.clear()
  given = [[sels[i][k] for i in range(2) if SCHEDULE[k][i]] for k in range(len(SCHEDULE))]
  mapped, _, _ = run(layer, inputs, SCHEDULE, tables(22), make_cache(kind), given=given)
  assert not calls
  for a, b in zip(fused, mapped):
    np.testing.assert_array_equal(a, b)


def test_given_selection_is_used_instead_of_the_indexer():
  layer_a, layer_b = make_layer(seed=10), make_layer(seed=11)
  inputs = inputs_for(SCHEDULE, 12)
  _, sels_a, _ = run(layer_a, inputs, SCHEDULE, tables(13), make_cache("latent"))
  given = [[sels_a[i][k] for i in range(2) if SCHEDULE[k][i]] for k in range(len(SCHEDULE))]
  outs_b, sels_b, cache_b = run(layer_b, inputs, SCHEDULE, tables(13), make_cache("latent"),
                                given=given)
  for x, got, sel_a, sel_b in zip(inputs, outs_b, sels_a, sels_b):
    for a, b in zip(sel_a, sel_b):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got, masked_forward(layer_b, x, selection_mask(sel_a, x.shape[0])),
                               rtol=1e-5, atol=1e-5)
  assert not np.asarray(cache_b.indexer.scales).any()  # layer B's indexer never ran


def test_bad_input():
  layer = make_layer()
  md, lay = build_metadata([RequestState(0, 4, [0])], block_size=BS, num_blocks=NB,
                           max_blocks_per_seq=MB)
  x = jnp.zeros((md.num_rows, CFG.hidden_size))
  with pytest.raises(ValueError, match="DSACache"):
    layer(x, LatentCache.allocate(NB, BS, CFG.latent_dim, jnp.float32), md)
  with pytest.raises(ValueError, match="integers"):
    layer(x, make_cache("latent"), md, topk_positions=jnp.zeros((md.num_rows, TOPK), jnp.float32))
  with pytest.raises(ValueError, match="positions"):
    layer(x, make_cache("latent"), md, topk_positions=jnp.zeros((md.num_rows + 1, TOPK), jnp.int32))
  dense = DeepseekV2MLAAttention(CFG.replace(index_n_heads=None, index_head_dim=None,
                                             index_topk=None),
                                 backend="reference", dtype=jnp.float32, param_dtype=jnp.float32,
                                 rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="V3.2"):
    dense(x, LatentCache.allocate(NB, BS, CFG.latent_dim, jnp.float32), md, return_topk=True)


@pytest.mark.parametrize("built, match", [
    (dict(index_topk=2 * TOPK),
     "metadata built for index_topk=16 is used by a layer with index_topk=8"),
    (dict(block_size=4), "metadata built for block_size=4, but the indexer cache has block_size=8"),
    (dict(num_blocks=2 * NB),
     "metadata built for num_blocks=48, but the indexer cache has num_blocks=24"),
    (dict(cache_kind="bfloat16"),
     "metadata built for cache kind=bfloat16, but the latent cache has cache kind=float32"),
])
def test_metadata_built_for_another_cache_or_top_k_is_refused(built, match):
  md, _ = build_metadata([RequestState(0, 4, [0])], **{
      "block_size": BS, "num_blocks": NB, "max_blocks_per_seq": MB, "index_topk": TOPK, **built})
  with pytest.raises(ValueError, match=match):
    make_layer()(jnp.zeros((md.num_rows, CFG.hidden_size)), make_cache("latent"), md)


def test_slots_past_the_cache_are_masked_not_read():
  """Selections pointing past the block table or the cache select nothing; NaN elsewhere stays
  out."""
  layer = make_layer()
  md, lay = build_metadata([RequestState(0, 4, [0])], block_size=BS, num_blocks=NB,
                           max_blocks_per_seq=MB)
  cache = make_cache("latent")
  cache = DSACache(LatentCache(jnp.full_like(cache.latent.data, jnp.nan), cache.latent.k_scale),
                   cache.indexer)
  given = np.full((md.num_rows, TOPK), -1, np.int32)
  given[:4, 0] = np.arange(4)  # the token itself
  given[:4, 1] = MB * BS + 3  # past the block table
  given[:4, 2] = BS * 2  # block 2 of the table: -1, unread
  out, _ = layer(jnp.asarray(lay.pack([np.ones((4, CFG.hidden_size), np.float32)])), cache, md,
                 topk_positions=jnp.asarray(given))
  assert np.isfinite(np.asarray(out)).all()


def test_weight_loader_takes_the_indexer_tensors():
  layer = make_layer()
  rng = np.random.default_rng(14)
  shapes = {"q_a_proj.weight": (32, 64), "q_a_layernorm.weight": (32,),
            "q_b_proj.weight": (4 * 48, 32),
            "kv_a_proj_with_mqa.weight": (144, 64), "kv_a_layernorm.weight": (128,),
            "kv_b_proj.weight": (4 * 64, 128), "o_proj.weight": (64, 4 * 32),
            "indexer.wq_b.weight": (4 * 32, 32), "indexer.wk.weight": (32, 64),
            "indexer.k_norm.weight": (32,), "indexer.k_norm.bias": (32,),
            "indexer.weights_proj.weight": (4, 64)}
  tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  load_attention_weights(layer, tensors)
  np.testing.assert_array_equal(np.asarray(layer.indexer.wq_b.kernel[...]),
                                tensors["indexer.wq_b.weight"].T)
  np.testing.assert_array_equal(np.asarray(layer.indexer.k_norm.bias[...]),
                                tensors["indexer.k_norm.bias"])
  del tensors["indexer.k_norm.bias"]
  with pytest.raises(ValueError, match="indexer.k_norm.bias"):
    load_attention_weights(layer, tensors)


def test_jitted_step_forwards_return_topk_and_traced_topk_positions():
  layer = make_layer()
  step = jitted_step(layer, donate_cache=False)
  md, lay = build_metadata([RequestState(0, 14, tables(3)[0]), RequestState(0, 9, tables(3)[1])],
                           block_size=BS, num_blocks=NB, max_blocks_per_seq=MB, index_topk=TOPK)
  x = jnp.asarray(lay.pack(inputs_for([[14, 9]], 4)))
  want = layer(x, make_cache("latent"), md, return_topk=True)
  got = step(x, make_cache("latent"), md, return_topk=True)
  assert len(got) == 3
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
  assert len(step(x, make_cache("latent"), md)) == 2  # the default stays (out, cache)
  # Selections are traced: two different ones through one step, each as the eager layer gives.
  first = np.asarray(want[2])
  for given in (first, np.where(np.arange(TOPK) < 2, first, -1).astype(np.int32)):
    eager, _ = layer(x, make_cache("latent"), md, topk_positions=jnp.asarray(given))
    jitted, _ = step(x, make_cache("latent"), md, topk_positions=jnp.asarray(given))
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(jitted), np.asarray(want[0]), atol=1e-3)
  with pytest.raises(ValueError, match="return_topk=\\[True\\].*hashable"):
    step(x, make_cache("latent"), md, return_topk=[True])


def test_forgetting_layout_pack_names_it():
  layer = make_layer()
  md, _ = build_metadata([RequestState(0, 5, [0])], block_size=BS, num_blocks=NB,
                         max_blocks_per_seq=MB)
  with pytest.raises(ValueError, match=r"x has 5 rows but the step's metadata has 8 .*layout.pack"):
    layer(jnp.zeros((5, CFG.hidden_size)), make_cache("latent"), md)
