"""Flax NNX modules shaped like vLLM's DeepseekV2MLAAttention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mla_jax.attention import MLAAttention
from mla_jax.cache import LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import AttentionMetadata
from mla_jax.rope import RotaryEmbedding


def _linear(n_in, n_out, dtype, param_dtype, rngs):
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                    kernel_init=nnx.initializers.normal(n_in ** -0.5))


class DeepseekV2MLAAttention(nnx.Module):
  """DeepSeek V2/V3 attention: projections, norms, RoPE, and the MLA attention layer.

  The cache is passed in and returned (a value, not module state), so a jitted step can donate it.
  """

  def __init__(self, config: MLAConfig, *, backend: str | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
    c = config
    self.config = config
    n, qk = c.num_heads, c.qk_head_dim
    norm = lambda dim: nnx.RMSNorm(dim, epsilon=c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                                   rngs=rngs)
    if c.q_lora_rank is not None:
      self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank, dtype, param_dtype, rngs)
      self.q_a_layernorm = norm(c.q_lora_rank)
      self.q_b_proj = _linear(c.q_lora_rank, n * qk, dtype, param_dtype, rngs)
    else:
      self.q_proj = _linear(c.hidden_size, n * qk, dtype, param_dtype, rngs)
    self.kv_a_proj_with_mqa = _linear(c.hidden_size, c.latent_dim, dtype, param_dtype, rngs)
    self.kv_a_layernorm = norm(c.kv_lora_rank)
    self.kv_b_proj = _linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), dtype,
                             param_dtype, rngs)
    self.o_proj = _linear(n * c.v_head_dim, c.hidden_size, dtype, param_dtype, rngs)
    self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, neox=False)
    self.mla_attn = MLAAttention(c, backend=backend, dtype=dtype)
    self.process_weights_after_loading()

  def process_weights_after_loading(self):
    """Recomputes the absorbed weights from kv_b_proj; call after changing kv_b_proj's kernel."""
    self.mla_attn.absorb(self.kv_b_proj.kernel[...])

  def project(self, x, positions):
    """Steps 1-3 and 5 of the forward: x [T, hidden] -> q [T, N, P+R], kv_c_normed [T, L],
    k_pe [T, R], with RoPE applied and the optional llama-4 query scaling."""
    c = self.config
    if x.ndim != 2 or x.shape[-1] != c.hidden_size:
      raise ValueError(f"x must be [tokens, {c.hidden_size}], got shape {x.shape}")
    if positions.shape != x.shape[:1]:
      raise ValueError(f"positions must be [{x.shape[0]}], got shape {positions.shape}")
    if c.q_lora_rank is not None:
      q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
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
    return q, kv_c_normed, k_pe

  def __call__(self, x, cache: LatentCache, md: AttentionMetadata):
    """One step over the rows of `md`: x [T, hidden] -> (out [T, hidden], new cache)."""
    q, kv_c_normed, k_pe = self.project(x, md.positions)
    attn, cache = self.mla_attn(q, kv_c_normed, k_pe, cache, md)
    return self.o_proj(attn), cache

  def unabsorbed_forward(self, x, positions, segment_ids=None):
    """The textbook math, no cache and no absorption: causal MHA with k = [k_nope | k_pe] and
    v from kv_b_proj, within each segment (all one sequence when segment_ids is None). O(T^2)
    memory: an oracle for tests and the demo, not a serving path."""
    c = self.config
    q, kv_c_normed, k_pe = self.project(x, positions)
    kv = self.kv_b_proj(kv_c_normed).reshape(x.shape[0], c.num_heads, -1)
    k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, None], k_nope.shape[:2] + k_pe.shape[-1:])], -1)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("qnd,knd->nqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi)
    seg = jnp.zeros_like(positions) if segment_ids is None else segment_ids
    mask = (positions[None, :] <= positions[:, None]) & (seg[None, :] == seg[:, None])
    p = jax.nn.softmax(jnp.where(mask[None], s * c.softmax_scale, -jnp.inf), axis=-1)
    o = jnp.einsum("nqk,knv->qnv", p, v.astype(jnp.float32), precision=hi)
    return self.o_proj(o.reshape(x.shape[0], -1).astype(x.dtype))


def jitted_step(module: nnx.Module, *, donate_cache: bool = True):
  """`step(x, cache, md) -> (out, cache)`: the module's forward under `jax.jit`.

  The module's state is taken now (make a new step after loading weights) and passed as an
  argument rather than folded into the program as constants; the cache is
  donated so XLA writes it in place, and steps whose metadata has the same padded shapes reuse
  one compiled program.
  """
  graphdef, state = nnx.split(module)

  @functools.partial(jax.jit, donate_argnums=(2,) if donate_cache else ())
  def step(state, x, cache, md):
    return nnx.merge(graphdef, state)(x, cache, md)

  return lambda x, cache, md: step(state, x, cache, md)
