"""`layer.allocate_cache`: the right cache kind for every config and dtype, each feeding jitted
steps that match the unabsorbed attention math; hand-made caches are checked against the layer."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.cache import DSACache, DSMLACache, IndexerKCache, LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step

SMALL = dict(hidden_size=64, num_heads=4, kv_lora_rank=128, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32)
TOPK = 8
CONFIGS = {
    "v2-lite (no q_lora)": MLAConfig.preset("DeepSeek-V2-Lite").replace(**SMALL),
    "v3": MLAConfig.preset("DeepSeek-V3").replace(**SMALL, q_lora_rank=32),
    "v3.2": MLAConfig.preset("DeepSeek-V3.2").replace(**SMALL, q_lora_rank=32, index_n_heads=4,
                                                      index_head_dim=32, index_topk=TOPK),
}
BS, NB, MB = 8, 12, 4
PROMPT, DECODES = 13, 3
# Relative error (norm of the difference / norm of the reference) each latent cache dtype keeps.
TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2, "fp8": 8e-2, "fp8_ds_mla": 5e-2}
# Without q_lora (V2-Lite) only the query projection differs from V3, whatever the cache dtype:
# float32 alone, at the tightest tolerance.
CASES = [(name, dtype) for name, c in CONFIGS.items() for dtype in TOLERANCE
         if (dtype != "fp8_ds_mla" or c.has_indexer) and (c.q_lora_rank or dtype == "float32")]


def make_layer(config, indexer_fp8=True):
  return DeepseekV2MLAAttention(config, backend="reference", dtype=jnp.float32,
                                param_dtype=jnp.float32, indexer_fp8=indexer_fp8, rngs=nnx.Rngs(3))


def run_steps(layer, cache, x):
  """A prompt prefill, then decode steps, through one jitted step: outputs [tokens, hidden] and
  the selections (V3.2) per row, -1 padded."""
  step = jitted_step(layer)
  table = np.arange(MB)
  outs, sels, done = [], [], 0
  for q_len in [PROMPT] + [1] * DECODES:
    md, layout = build_metadata([RequestState(done, q_len, table)], block_size=BS, num_blocks=NB,
                                max_blocks_per_seq=MB, index_topk=layer.config.index_topk)
    packed = jnp.asarray(layout.pack([x[done:done + q_len]]))
    if layer.config.has_indexer:
      out, cache, sel = step(packed, cache, md, return_topk=True)
      sels.append(layout.unpack(sel)[0])
    else:
      out, cache = step(packed, cache, md)
    outs.append(layout.unpack(out)[0])
    done += q_len
  return np.concatenate(outs), (np.concatenate(sels) if sels else None), cache


def reference(layer, x, sels):
  """The unabsorbed attention math, restricted to each row's selection for V3.2."""
  n = x.shape[0]
  mask = None
  if sels is not None:
    mask = np.zeros((n, n), bool)
    for t, sel in enumerate(sels):
      mask[t, sel[sel >= 0]] = True
  return np.asarray(layer.unabsorbed_forward(jnp.asarray(x), jnp.arange(n),
                                             key_mask=None if mask is None else jnp.asarray(mask)))


@pytest.mark.parametrize("name,dtype", CASES)
def test_allocated_cache_feeds_steps_that_match_the_reference(name, dtype):
  config = CONFIGS[name]
  layer = make_layer(config)
  cache = layer.allocate_cache(NB, BS, dtype, k_scale=0.02)
  latent = cache.latent if config.has_indexer else cache
  if dtype == "fp8_ds_mla":
    assert isinstance(latent, DSMLACache)
  else:
    assert isinstance(latent, LatentCache)
    want = "float8_e4m3fn" if dtype == "fp8" else dtype
    assert latent.data.dtype == jnp.dtype(want) and latent.data.shape == (NB, BS, config.latent_dim)
    assert latent.k_scale == np.float32(0.02)
  if config.has_indexer:
    assert isinstance(cache, DSACache) and cache.indexer.values.dtype == jnp.float8_e4m3fn
  x = np.random.default_rng(4).standard_normal((PROMPT + DECODES, config.hidden_size)) / 2
  got, sels, _ = run_steps(layer, cache, x.astype(np.float32))
  if config.has_indexer:  # the sparse path ran: later rows select TOPK of more positions
    assert (sels >= 0).sum(1).max() == TOPK
  want = reference(layer, x.astype(np.float32), sels)
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err < TOLERANCE[dtype], f"{name} {dtype}: relative error {err:.2e}"


def test_default_dtype_is_the_layers_and_the_indexer_cache_follows_indexer_fp8():
  config = CONFIGS["v3.2"]
  bf16_layer = DeepseekV2MLAAttention(config, backend="reference", indexer_fp8=False,
                                      rngs=nnx.Rngs(0))
  cache = bf16_layer.allocate_cache(NB, BS)
  assert cache.latent.data.dtype == jnp.bfloat16 and cache.indexer.values.dtype == jnp.bfloat16
  # A bf16 indexer on a float32 layer: the selection still matches the reference's masked math.
  layer = make_layer(config, indexer_fp8=False)
  x = np.random.default_rng(5).standard_normal((PROMPT + DECODES, config.hidden_size)) / 2
  got, sels, _ = run_steps(layer, layer.allocate_cache(NB, BS), x.astype(np.float32))
  want = reference(layer, x.astype(np.float32), sels)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_bad_dtypes_name_what_is_supported():
  with pytest.raises(ValueError, match="fp8_ds_mla is the V3.2"):
    make_layer(CONFIGS["v3"]).allocate_cache(NB, BS, "fp8_ds_mla")
  with pytest.raises(ValueError, match="int8.*supported"):
    make_layer(CONFIGS["v3"]).allocate_cache(NB, BS, "int8")


def test_hand_made_caches_are_checked_against_the_layer():
  dense, sparse = make_layer(CONFIGS["v3"]), make_layer(CONFIGS["v3.2"], indexer_fp8=False)
  md, layout = build_metadata([RequestState(0, 3, [0])], block_size=BS, num_blocks=NB,
                              max_blocks_per_seq=MB)
  x = jnp.zeros((md.num_rows, 64))
  latent = LatentCache.allocate(NB, BS, dense.config.latent_dim, jnp.float32)
  with pytest.raises(ValueError, match="needs a LatentCache.*allocate_cache"):
    dense(x, sparse.allocate_cache(NB, BS), md)
  with pytest.raises(ValueError, match="needs a LatentCache"):  # fp8_ds_mla: sparse attention only
    dense(x, DSMLACache.allocate(NB, BS, 128, 16), md)
  with pytest.raises(ValueError, match="needs a DSACache.*allocate_cache"):
    sparse(x, latent, md)
  fp8_keys = DSACache(latent, IndexerKCache.allocate(NB, BS, 32))  # the layer's indexer is bf16
  with pytest.raises(ValueError, match="float8_e4m3fn keys of 32.*bfloat16.*indexer_fp8=False"):
    sparse(x, fp8_keys, md)
  fewer_pages = DSACache(latent, IndexerKCache.allocate(NB - 1, BS, 32, "bfloat16"))
  with pytest.raises(ValueError, match="share one block table"):
    sparse(x, fewer_pages, md)
  sparse(x, DSACache(latent, IndexerKCache.allocate(NB, BS, 32, "bfloat16")), md)  # the right one
