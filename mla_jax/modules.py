"""Flax NNX modules shaped like vLLM's DeepseekV2MLAAttention."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from mla_jax.attention import MLAAttention
from mla_jax.cache import (FP8_DS_MLA, DSACache, IndexerKCache, LatentCache, PagedCache,
                           allocate_latent_cache)
from mla_jax.config import MLAConfig
from mla_jax.indexer import Indexer
from mla_jax.metadata import AttentionMetadata
from mla_jax.nn import linear
from mla_jax.rope import RotaryEmbedding


class Projections(NamedTuple):
  q: jax.Array  # [T, N, P+R], RoPE applied
  kv_c_normed: jax.Array  # [T, L]
  k_pe: jax.Array  # [T, R], RoPE applied
  # [T, Lq] after q_a_layernorm (what the V3.2 indexer reads); None without Lq
  q_c: jax.Array | None


class DeepseekV2MLAAttention(nnx.Module):
  """DeepSeek V2/V3 attention: projections, norms, RoPE, and the MLA attention layer.

  The cache is passed in and returned (a value, not module state), so a jitted step can donate it.
  With `index_topk` in the config (V3.2) the layer owns an `Indexer`, takes a `DSACache`, and every
  row attends only to the positions the indexer selects.
  """

  def __init__(self, config: MLAConfig, *, backend: str | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, indexer_fp8: bool = True, batch_invariant: bool = False,
               rngs: nnx.Rngs):
    c = config
    self.config = config
    n, qk = c.num_heads, c.qk_head_dim
    norm = lambda dim: nnx.RMSNorm(dim, epsilon=c.rms_norm_eps, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
    if c.q_lora_rank is not None:
      self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, dtype, param_dtype, rngs)
      self.q_a_layernorm = norm(c.q_lora_rank)
      self.q_b_proj = linear(c.q_lora_rank, n * qk, dtype, param_dtype, rngs)
    else:
      self.q_proj = linear(c.hidden_size, n * qk, dtype, param_dtype, rngs)
    self.kv_a_proj_with_mqa = linear(c.hidden_size, c.latent_dim, dtype, param_dtype, rngs)
    self.kv_a_layernorm = norm(c.kv_lora_rank)
    self.kv_b_proj = linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), dtype,
                             param_dtype, rngs)
    self.o_proj = linear(n * c.v_head_dim, c.hidden_size, dtype, param_dtype, rngs)
    self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, neox=False)
    self.mla_attn = MLAAttention(c, backend=backend, dtype=dtype, batch_invariant=batch_invariant)
    if c.has_indexer:
      self.indexer = Indexer(c, fp8=indexer_fp8, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.process_weights_after_loading()

  def process_weights_after_loading(self) -> None:
    """Recomputes the absorbed weights from kv_b_proj; call after changing kv_b_proj's kernel."""
    self.mla_attn.absorb(self.kv_b_proj.kernel[...])

  def allocate_cache(self, num_blocks: int, block_size: int, dtype: DTypeLike | None = None, *,
                     k_scale: float = 1.0) -> LatentCache | DSACache:
    """A zeroed paged cache of the kind this layer takes, `num_blocks` pages of `block_size` tokens.

    `dtype`, the latent cache's: float32, bfloat16, float16 (default: the layer's compute dtype),
    float8_e4m3fn (or "fp8": per-tensor scale `k_scale`), or for V3.2 "fp8_ds_mla". A V3.2 layer
    gets a `DSACache` whose indexer K cache is in the dtype its indexer reads (e4m3 with per-token
    scales when built with `indexer_fp8=True`, else bfloat16).
    """
    c = self.config
    dtype = self.mla_attn.dtype if dtype is None else dtype
    if isinstance(dtype, str) and dtype == FP8_DS_MLA and not c.has_indexer:
      raise ValueError("fp8_ds_mla is the V3.2 (index_topk) latent layout, which only sparse "
                       "attention reads; for this config use fp8 (per-tensor scale) or a float "
                       "dtype")
    latent = allocate_latent_cache(num_blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim,
                                   dtype, k_scale)
    if not c.has_indexer:
      return latent
    return DSACache(latent, IndexerKCache.allocate(num_blocks, block_size, c.index_head_dim,
                                                   self.indexer.cache_dtype))

  def check_cache(self, cache: LatentCache | DSACache) -> None:
    """ValueError unless `cache` is what this layer reads and writes (as `allocate_cache` makes)."""
    c = self.config
    is_cache = isinstance(cache, PagedCache)  # the protocol: any kind that answers it
    if not c.has_indexer:
      if not is_cache or cache.indexer is not None or not cache.dense_attention:
        raise ValueError(f"this layer (no indexer) needs a LatentCache, got "
                         f"{type(cache).__name__}; layer.allocate_cache(num_blocks, block_size) "
                         "makes one")
      return
    if not is_cache or cache.indexer is None:
      raise ValueError(f"a V3.2 layer needs a DSACache (latent + indexer caches), got "
                       f"{type(cache).__name__}; layer.allocate_cache(num_blocks, block_size) "
                       "makes one")
    k = cache.indexer
    want = jnp.dtype(self.indexer.cache_dtype)
    if k.values.dtype != want or k.head_dim != c.index_head_dim:
      raise ValueError(
          f"the indexer cache holds {k.values.dtype} keys of {k.head_dim}, this layer's indexer "
          f"reads {want.name} keys of {c.index_head_dim} (indexer_fp8={self.indexer.fp8}); "
          "layer.allocate_cache(num_blocks, block_size) allocates the matching one")
    if (k.num_blocks, k.block_size) != (cache.latent.num_blocks, cache.latent.block_size):
      raise ValueError(f"the latent cache has {cache.latent.num_blocks} pages of "
                       f"{cache.latent.block_size} tokens, the indexer cache {k.num_blocks} of "
                       f"{k.block_size}: they share one block table")

  def project(self, x: jax.Array, positions: jax.Array) -> Projections:
    """Steps 1-3 and 5 of the forward (RoPE, the optional llama-4 query scaling)."""
    c = self.config
    if x.ndim != 2 or x.shape[-1] != c.hidden_size:
      raise ValueError(f"x must be [tokens, {c.hidden_size}], got shape {x.shape}")
    if positions.shape != x.shape[:1]:
      raise ValueError(f"positions must be [{x.shape[0]}], got shape {positions.shape}")
    q_c = None
    if c.q_lora_rank is not None:
      q_c = self.q_a_layernorm(self.q_a_proj(x))
      q = self.q_b_proj(q_c)
    else:
      q = self.q_proj(x)
    q = q.reshape(x.shape[0], c.num_heads, c.qk_head_dim)
    kv_lora = self.kv_a_proj_with_mqa(x)
    kv_c_normed = self.kv_a_layernorm(kv_lora[:, :c.kv_lora_rank])
    k_pe = self.rotary_emb(positions, kv_lora[:, c.kv_lora_rank:])
    q = jnp.concatenate([q[..., :c.qk_nope_head_dim],
                         self.rotary_emb(positions, q[..., c.qk_nope_head_dim:])], axis=-1)
    if c.llama_4_scaling is not None:
      s = c.llama_4_scaling
      factor = 1 + s.beta * jnp.log1p(jnp.floor(positions / s.original_max_position_embeddings))
      q = (q.astype(jnp.float32) * factor[:, None, None]).astype(q.dtype)
    return Projections(q, kv_c_normed, k_pe, q_c)

  def __call__(self, x: jax.Array, cache: LatentCache | DSACache, md: AttentionMetadata, *,
               topk_positions: jax.Array | None = None, return_topk: bool = False
               ) -> tuple[jax.Array, LatentCache | DSACache] | tuple[
                   jax.Array, LatentCache | DSACache, jax.Array]:
    """One step over the rows of `md`: x [T, hidden] -> (out [T, hidden], new cache).

    V3.2 only: `topk_positions` [T, index_topk] (request-local, -1 padded) replaces this layer's
    indexer (IndexCache-style reuse of an earlier layer's selection; this layer's indexer cache
    is then left as it is), and `return_topk=True` appends the selection used to the result.
    """
    if x.ndim == 2 and x.shape[0] != md.num_rows:
      raise ValueError(f"x has {x.shape[0]} rows but the step's metadata has {md.num_rows} (tokens "
                       "padded to a power-of-two bucket, decode rows first): lay the requests' "
                       "inputs out with layout.pack([...]), layout from build_metadata")
    if not self.config.has_indexer and (topk_positions is not None or return_topk):
      raise ValueError("top-k positions exist only for V3.2 configs (index_topk set)")
    self.check_cache(cache)
    md.check_topk(self.config.index_topk)
    p = self.project(x, md.positions)
    if not self.config.has_indexer:
      attn, cache = self.mla_attn(p.q, p.kv_c_normed, p.k_pe, cache, md)
      return self.project_out(attn), cache
    indexer_cache, slots = cache.indexer, None
    if topk_positions is None:
      # The top-k writes the selection's latent-cache slots too (no mapping pass after it).
      topk_positions, slots, indexer_cache = self.indexer.select(
          x, p.q_c, cache.indexer, md, self.mla_attn.backend,
          slots_of=(cache.latent.block_size, cache.latent.num_blocks))
    if md.within_topk and cache.latent.dense_attention:
      # Every window fits in top-k, so the selection is everything: dense MLA is the same math.
      attn, latent = self.mla_attn(p.q, p.kv_c_normed, p.k_pe, cache.latent, md)
    else:
      attn, latent = self.mla_attn.sparse(p.q, p.kv_c_normed, p.k_pe, cache.latent, md,
                                          topk_positions, slots)
    out, cache = self.project_out(attn), DSACache(latent, indexer_cache)
    return (out, cache, topk_positions) if return_topk else (out, cache)

  def project_out(self, attn: jax.Array) -> jax.Array:
    """o_proj of attn [T, N*V], or of dcp parts [dcp, T, N*V] (the "o_proj" dcp merge), summed
    after the projection: on a mesh that sum is the all-reduce of o_proj's partial products."""
    out = self.o_proj(attn)
    return out if out.ndim == 2 else out.sum(0)

  def unabsorbed_forward(self, x: jax.Array, positions: jax.Array,
                         segment_ids: jax.Array | None = None,
                         key_mask: jax.Array | None = None) -> jax.Array:
    """The textbook math, no cache and no absorption: causal MHA with k = [k_nope | k_pe] and
    v from kv_b_proj, within each segment (all one sequence when segment_ids is None), further
    restricted by `key_mask` [T, T] when given (e.g. a DSA selection). O(T^2) memory: an oracle
    for tests and the demo, not a serving path."""
    c = self.config
    q, kv_c_normed, k_pe, _ = self.project(x, positions)
    kv = self.kv_b_proj(kv_c_normed).reshape(x.shape[0], c.num_heads, -1)
    k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
    k_pe = jnp.broadcast_to(k_pe[:, None], k_nope.shape[:2] + k_pe.shape[-1:])
    k = jnp.concatenate([k_nope, k_pe], -1)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("qnd,knd->nqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi)
    seg = jnp.zeros_like(positions) if segment_ids is None else segment_ids
    mask = (positions[None, :] <= positions[:, None]) & (seg[None, :] == seg[:, None])
    if key_mask is not None:
      mask &= key_mask
    p = jax.nn.softmax(jnp.where(mask[None], s * c.softmax_scale, -jnp.inf), axis=-1)
    o = jnp.einsum("nqk,knv->qnv", p, v.astype(jnp.float32), precision=hi)
    return self.o_proj(o.reshape(x.shape[0], -1).astype(x.dtype))


def jitted_step(module: nnx.Module, *, donate_cache: bool = True) -> Callable[..., tuple]:
  """`step(x, cache, md, **options) -> module(x, cache, md, **options)` under `jax.jit`.

  The module's state is taken now (make a new step after loading weights) and passed as an
  argument rather than folded into the program as constants; the cache is donated so XLA writes it
  in place, and steps whose metadata has the same padded shapes reuse one compiled program.
  Keyword options reach the module's call: arrays as traced arguments (V3.2 `topk_positions`,
  the model's `logit_rows`), anything else as a static one, one program per value (V3.2
  `return_topk=True`). `step.lower(x, cache, md, **options)` lowers that program without running
  it (e.g. to read the compiled HLO).
  """
  graphdef, state = nnx.split(module)

  @functools.partial(jax.jit, static_argnums=(5,), donate_argnums=(2,) if donate_cache else ())
  def step(state, x, cache, md, traced, static):
    return nnx.merge(graphdef, state)(x, cache, md, **traced, **dict(static))

  def arguments(x, cache, md, options):
    traced = {k: v for k, v in options.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = tuple(sorted((k, v) for k, v in options.items() if k not in traced))
    for name, value in static:
      try:
        hash(value)
      except TypeError:
        raise ValueError(f"step option {name}={value!r}: pass an array (traced) or a hashable "
                         f"value (static), not a {type(value).__name__}") from None
    return state, x, cache, md, traced, static

  run = lambda x, cache, md, **options: step(*arguments(x, cache, md, options))
  run.lower = lambda x, cache, md, **options: step.lower(*arguments(x, cache, md, options))
  return run
