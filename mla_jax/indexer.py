"""DeepSeek V3.2's lightning indexer (Flax NNX), shaped like vLLM's `Indexer`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from mla_jax.backends import Backend
from mla_jax.config import MLAConfig
from mla_jax.cache import IndexerKCache
from mla_jax.quant import quantize_indexer_q
from mla_jax.metadata import AttentionMetadata
from mla_jax.nn import linear
from mla_jax.rope import RotaryEmbedding

# Largest [rows, heads, positions] float32 score block one indexer chunk may build.
SCORE_BYTES_BOUND = 512 * 2**20


def causal_positions(seq_lens: jax.Array, topk: int) -> jax.Array:
  """What top-k returns when a row's whole window fits: positions 0..len-1, then -1."""
  pos = jnp.arange(topk, dtype=jnp.int32)[None, :]
  return jnp.where(pos < seq_lens[:, None], pos, -1)


class Indexer(nnx.Module):
  """Scores every visible cache position per token and keeps the top `index_topk`.

  q = wq_b(q_c) per head, k = k_norm(wk(x)) shared by heads, NeoX RoPE on the first R dims of
  each (`[rope | nope]`), head weights `weights_proj(x) / sqrt(H * D)`. With `fp8`, q is quantized
  per (token, head) and the K cache per token to e4m3 with power-of-two scales, as vLLM does.
  """

  def __init__(self, config: MLAConfig, *, fp8: bool = True, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
    if not config.has_indexer:
      raise ValueError("the config has no indexer (index_n_heads / index_head_dim / index_topk)")
    c = config
    self.config = config
    self.fp8 = fp8
    h, d = c.index_n_heads, c.index_head_dim
    self.wq_b = linear(c.q_lora_rank, h * d, dtype, param_dtype, rngs)
    self.wk = linear(c.hidden_size, d, dtype, param_dtype, rngs)
    self.k_norm = nnx.LayerNorm(d, epsilon=1e-6, use_bias=True, dtype=dtype,
                                param_dtype=param_dtype, rngs=rngs)
    self.weights_proj = linear(c.hidden_size, h, dtype, param_dtype, rngs)
    self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, neox=True)

  @property
  def cache_dtype(self) -> str:
    """The K cache dtype this indexer reads: e4m3 (per-token scales) with fp8, else bfloat16."""
    return "float8_e4m3fn" if self.fp8 else "bfloat16"

  def project(self, x: jax.Array, q_c: jax.Array,
              positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, hidden], q_c [T, Lq] (after q_a_layernorm) -> q [T, H, D] (e4m3 with fp8),
    head weights [T, H] float32 (times the q scales with fp8), k [T, D]."""
    c = self.config
    h, d, r = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
    q = self.wq_b(q_c).reshape(x.shape[0], h, d)
    q = jnp.concatenate([self.rotary_emb(positions, q[..., :r]), q[..., r:]], axis=-1)
    k = self.k_norm(self.wk(x))
    k = jnp.concatenate([self.rotary_emb(positions, k[:, :r]), k[:, r:]], axis=-1)
    weights = self.weights_proj(x).astype(jnp.float32) * (h ** -0.5 * d ** -0.5)
    if self.fp8:
      q, q_scale = quantize_indexer_q(q)
      weights = weights * q_scale
    return q, weights, k

  def __call__(self, x: jax.Array, q_c: jax.Array, k_cache: IndexerKCache, md: AttentionMetadata,
               backend: Backend) -> tuple[jax.Array, IndexerKCache]:
    """Writes this step's keys, then returns (top-k request-local positions [T, topk], -1 padded;
    the new K cache). Rows are scored a chunk at a time to bound the score buffer."""
    positions, _, k_cache = self.select(x, q_c, k_cache, md, backend)
    return positions, k_cache

  def select(self, x: jax.Array, q_c: jax.Array, k_cache: IndexerKCache, md: AttentionMetadata,
             backend: Backend, slots_of: tuple[int, int] | None = None
             ) -> tuple[jax.Array, jax.Array | None, IndexerKCache]:
    """As `__call__`, returning (positions, slots, new K cache): with slots_of = (block_size,
    num_blocks) of a cache sharing the block tables (the latent cache), slots [T, topk] are the
    positions' slots in it (`cache.positions_to_slots`), written by the top-k itself
    (`Backend.topk_slots`); else, and where every window fits in top-k (no selection runs),
    None."""
    c = self.config
    md.check_cache("indexer cache", k_cache.block_size, k_cache.num_blocks)
    q, weights, k = self.project(x, q_c, md.positions)
    k_cache = backend.write_indexer_cache(k_cache, k, md.slot_mapping)
    if md.within_topk:  # every window fits: the selection is the whole window, no scoring needed
      return causal_positions(md.seq_lens, c.index_topk), None, k_cache

    t = md.num_rows
    span = md.block_tables.shape[1] * k_cache.block_size
    rows = max(1, SCORE_BYTES_BOUND // (c.index_n_heads * span * 4))
    rows = min(t, 1 << (rows.bit_length() - 1))  # a power of two, so it divides the bucketed T
    tables = md.row_block_tables()
    # Decode rows only: one token a request (decode_threshold's default), so rows seldom share a
    # table and a kernel that groups rows sharing one (pallas_mosaic's) need not look for groups
    # on the device. A hint: the logits are the same either way, up to float32 rounding.
    distinct = md.num_decode_rows >= md.num_rows

    def one_chunk(args):
      q_i, w_i, tab_i, len_i = args
      logits = backend.indexer_logits(q_i, w_i, k_cache, tab_i, len_i, distinct_tables=distinct)
      if slots_of is None:
        return backend.topk(logits, len_i, c.index_topk), None
      block_size, num_blocks = slots_of
      return backend.topk_slots(logits, len_i, c.index_topk, tab_i, block_size=block_size,
                                num_blocks=num_blocks)

    split = lambda a: a.reshape(t // rows, rows, *a.shape[1:])
    positions, slots = lax.map(one_chunk, (split(q), split(weights), split(tables),
                                           split(md.seq_lens)))
    whole = lambda a: None if a is None else a.reshape(t, c.index_topk)
    return whole(positions), whole(slots), k_cache
