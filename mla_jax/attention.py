"""The MLA attention layer: cache write, then decode rows (absorbed MQA) and prefill rows (MHA).

Mirrors vLLM's MLA common implementation: decode rows attend in the 576-d latent space with the
absorbed weights; prefill rows up-project the latents to per-head keys and values, attend causally
over the new tokens and non-causally over the earlier context read back from the cache chunk by
chunk, and merge the parts by their log-sum-exps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from mla_jax import backends
from mla_jax import cache as caches
from mla_jax.cache import LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import AttentionMetadata
from mla_jax.sharded_backend import dcp_size, shard_backend
from pallas_kernels.common import join_k_pe


def merge_attn_states(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array,
                      lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Combines two partial attentions over disjoint keys by their log-sum-exps (+inf counts as -inf).

  o_* [T, N, V], lse_* [T, N]. Returns (o [T, N, V] in o_a.dtype, lse [T, N] float32).
  """
  lse_a = jnp.where(lse_a == jnp.inf, -jnp.inf, lse_a.astype(jnp.float32))
  lse_b = jnp.where(lse_b == jnp.inf, -jnp.inf, lse_b.astype(jnp.float32))
  m = jnp.maximum(lse_a, lse_b)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  total = w_a + w_b
  safe = jnp.where(total > 0, total, 1.0)
  # Selected, not multiplied by a zero weight: an empty part's o may hold anything.
  part = lambda w, o: jnp.where(w[..., None] > 0, w[..., None] * o.astype(jnp.float32), 0.0)
  o = (part(w_a, o_a) + part(w_b, o_b)) / safe[..., None]
  lse = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
  return o.astype(o_a.dtype), lse


def merge_rows(o: jax.Array, lse: jax.Array, start: jax.Array, o_part: jax.Array,
               lse_part: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`merge_attn_states` of rows [start, start + R) of o [T, N, V] and lse [T, N] with a part over
  those rows (o_part [R, N, V], lse_part [R, N]); the other rows as they were (a part that saw no
  key, 0 and -inf, leaves a row as it was too)."""
  rows = o_part.shape[0]
  o_w, lse_w = merge_attn_states(lax.dynamic_slice_in_dim(o, start, rows),
                                 lax.dynamic_slice_in_dim(lse, start, rows), o_part, lse_part)
  return (lax.dynamic_update_slice_in_dim(o, o_w, start, 0),
          lax.dynamic_update_slice_in_dim(lse, lse_w, start, 0))


def context_window(cu_q: jax.Array, cu_k: jax.Array, rows: int,
                   total: int) -> tuple[jax.Array, jax.Array]:
  """The query rows a context chunk's attention needs, as `rows` rows from `start`: (start, the
  cu_seqlens_q of those rows). cu_q [R+1]: the prefill requests' query rows (of total >= rows);
  cu_k [R+1]: their keys in the chunk, a run of consecutive requests. The window begins at the
  first of them (moved back to end at `total`) and ends with the last; requests before it that it
  overlaps see no key, requests after it get no rows, and an empty chunk gets none."""
  has_keys = jnp.diff(cu_k) > 0
  first = jnp.argmax(has_keys)
  last = has_keys.shape[0] - 1 - jnp.argmax(has_keys[::-1])
  start = jnp.minimum(cu_q[first], total - rows)
  end = jnp.where(has_keys.any(), cu_q[last + 1] - start, 0)
  return start, jnp.clip(cu_q - start, 0, end)


def concat_rows(blocks: list[jax.Array]) -> jax.Array:
  """Row blocks [T_i, N, V] -> [sum T_i, N, V]. Blocks given as dcp parts [dcp, T_i, N, V] (the
  "o_proj" dcp merge: parts summed later, by o_proj's all-reduce) make the result parts too, a
  block without parts going whole into part 0 (zeros elsewhere, so the sum is exact)."""
  dcp = next((b.shape[0] for b in blocks if b.ndim == 4), None)
  if dcp is not None:
    first = (jnp.arange(dcp) == 0)[:, None, None, None]
    blocks = [b if b.ndim == 4 else jnp.where(first, b[None], jnp.zeros((), b.dtype))
              for b in blocks]
  return jnp.concatenate(blocks, axis=-3) if len(blocks) > 1 else blocks[0]


class AbsorbedWeight(nnx.Variable):
  """A weight derived from the checkpoint's (kv_b_proj) at load time, not trained itself."""


class MLAAttention(nnx.Module):
  """Holds W_UK_T [N, P, L] and W_UV [N, L, V] and the backend; runs one step over a paged cache.

  batch_invariant: decode rows give bit-identical outputs whatever else is in the batch (the
  backend's fixed-split decode; off by default, as it can cost speed on small batches).
  split_k_pe: prefill rows (new tokens and context chunks) pass the backend's prefill the split
  keys, k_nope [T, N, P] and the rope keys k_pe [T, R] apart, instead of building [T, N, P+R] keys
  with k_pe copied to every head (the prefill contract's split form; the same results: reference
  and pallas_triton join them inside, pallas_mosaic's kernel copies both boxes itself). On by
  default (H200: 1.06x the joined keys over the chunked context, the same bits; benchmarks/
  RESULTS.md, "k_pe apart"); False builds the joined keys, the split path's oracle.
  """

  def __init__(self, config: MLAConfig, *, backend: str | None = None, dtype=jnp.bfloat16,
               batch_invariant: bool = False, split_k_pe: bool = True):
    if not isinstance(split_k_pe, bool):
      raise ValueError(f"split_k_pe must be a bool, got {split_k_pe!r}")
    c = config
    self.config = config
    self.dtype = dtype
    self.batch_invariant = batch_invariant
    self.split_k_pe = split_k_pe
    self.backend_name = backends.get_backend(backend).name
    self.W_UK_T = AbsorbedWeight(
        jnp.zeros((c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank), dtype))
    self.W_UV = AbsorbedWeight(jnp.zeros((c.num_heads, c.kv_lora_rank, c.v_head_dim), dtype))
    # A jax.sharding.Mesh once `mla_jax.sharding.shard_layer` has run: the kernels then run per
    # shard (dcp's partial attentions merged by `dcp_merge`).
    self.mesh = None
    self.dcp_merge = "all_reduce"

  @property
  def backend(self) -> backends.Backend:
    be = backends.BACKENDS[self.backend_name]
    return be if self.mesh is None else shard_backend(be, self.mesh, self.dcp_merge)

  def check_dcp(self, md: AttentionMetadata) -> None:
    """Trace time: the metadata must carry the dcp tables of the layer's mesh (none without)."""
    md.check_dcp(dcp_size(self.mesh), "the layer's mesh")

  def absorb(self, kv_b_kernel: jax.Array) -> None:
    """Splits kv_b_proj's kernel [L, N*(P+V)] (per head `[k_nope P | v V]`) into W_UK_T and W_UV."""
    c = self.config
    expected = (c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim))
    if kv_b_kernel.shape != expected:
      raise ValueError(f"kv_b_proj kernel has shape {kv_b_kernel.shape}, expected {expected}")
    w = kv_b_kernel.reshape(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
    self.W_UK_T[...] = jnp.einsum("LNP->NPL", w[..., :c.qk_nope_head_dim]).astype(self.dtype)
    self.W_UV[...] = jnp.einsum("LNV->NLV", w[..., c.qk_nope_head_dim:]).astype(self.dtype)

  def __call__(self, q: jax.Array, kv_c_normed: jax.Array, k_pe: jax.Array, cache: LatentCache,
               md: AttentionMetadata) -> tuple[jax.Array, LatentCache]:
    """q [T, N, P+R] and k_pe [T, R] after RoPE, kv_c_normed [T, L] -> (out [T, N*V], new cache);
    out is dcp parts [dcp, T, N*V] on a mesh with the "o_proj" dcp merge (`concat_rows`)."""
    c = self.config
    t = md.num_rows
    if q.shape != (t, c.num_heads, c.qk_head_dim):
      raise ValueError(f"q has shape {q.shape}, expected {(t, c.num_heads, c.qk_head_dim)} "
                       f"(rows from the metadata, heads, nope + rope dims)")
    if kv_c_normed.shape != (t, c.kv_lora_rank) or k_pe.shape != (t, c.qk_rope_head_dim):
      raise ValueError(f"kv_c_normed {kv_c_normed.shape} and k_pe {k_pe.shape} must be "
                       f"{(t, c.kv_lora_rank)} and {(t, c.qk_rope_head_dim)}")
    if cache.data.shape[-1] != c.latent_dim:
      raise ValueError(f"cache rows are {cache.data.shape[-1]} wide, the config needs "
                       f"{c.latent_dim}")
    md.check_cache("latent cache", cache.block_size, cache.num_blocks, cache.dtype_name)
    self.check_dcp(md)
    be = self.backend
    be.check(cache_dtype=cache.dtype_name, block_size=cache.block_size, num_heads=c.num_heads)

    cache = be.write_cache(cache, kv_c_normed, k_pe, md.slot_mapping)
    td = md.num_decode_rows
    blocks = []
    if td:
      blocks.append(self._decode(q[:td], cache, md))
    if t > td:
      blocks.append(self._prefill(q[td:], kv_c_normed[td:], k_pe[td:], cache, md))
    out = concat_rows(blocks)
    return out.reshape(out.shape[:-3] + (t, c.num_heads * c.v_head_dim)), cache

  def _absorb_query(self, q):
    """q [T, N, P+R] -> the latent-space query [T, N, L+R] = [q_nope @ W_UK_T | q_pe]."""
    c = self.config
    q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    return jnp.concatenate([jnp.einsum("TNP,NPL->TNL", q_nope, self.W_UK_T[...]), q_pe], axis=-1)

  def _decode(self, q, cache, md):
    c = self.config
    td = md.num_decode_rows
    # Under dcp each device reads its own blocks, through the tables built for it on the host.
    tables, lens = (md.dcp_row_views(0, td) if md.dcp_size > 1
                    else (md.row_block_tables(0, td), md.seq_lens[:td]))
    o, _ = self.backend.decode(self._absorb_query(q), cache, tables, lens, scale=c.softmax_scale,
                               kv_lora_rank=c.kv_lora_rank, batch_invariant=self.batch_invariant)
    return jnp.einsum("...NL,NLV->...NV", o.astype(self.dtype), self.W_UV[...])

  def sparse(self, q: jax.Array, kv_c_normed: jax.Array, k_pe: jax.Array,
             cache: caches.LatentCacheKind, md: AttentionMetadata, positions: jax.Array,
             slots: jax.Array | None = None) -> tuple[jax.Array, caches.LatentCacheKind]:
    """DSA: every row attends (absorbed, in latent space) to its selected request-local
    `positions` [T, K] only (-1: none). cache is a LatentCache or a DSMLACache (fp8_ds_mla).
    slots [T, K]: the positions' cache slots where the selection wrote them
    (`Indexer.select`), else mapped here. Returns (out [T, N*V], or dcp parts as `__call__`
    says, new cache)."""
    c = self.config
    t = md.num_rows
    if q.shape != (t, c.num_heads, c.qk_head_dim) or positions.shape[0] != t or positions.ndim != 2:
      raise ValueError(f"sparse attention: q {q.shape} must be {(t, c.num_heads, c.qk_head_dim)} "
                       f"and positions {positions.shape} [{t}, topk]")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"top-k positions must be integers, got {positions.dtype}")
    md.check_cache("latent cache", cache.block_size, cache.num_blocks, cache.dtype_name)
    self.check_dcp(md)
    be = self.backend
    cache = be.write_cache(cache, kv_c_normed, k_pe, md.slot_mapping)
    if slots is None:
      slots = caches.positions_to_slots(positions, md.row_block_tables(), cache.block_size,
                                        cache.num_blocks)
    elif slots.shape != positions.shape or slots.dtype != jnp.int32:
      raise ValueError(f"slots {slots.shape} {slots.dtype} must be int32 of the positions' shape "
                       f"{positions.shape}")
    o, _ = be.sparse_attention(self._absorb_query(q), cache, slots, scale=c.softmax_scale,
                               kv_lora_rank=c.kv_lora_rank)
    out = jnp.einsum("...NL,NLV->...NV", o.astype(self.dtype), self.W_UV[...])
    return out.reshape(out.shape[:-3] + (t, c.num_heads * c.v_head_dim)), cache

  def _up_project(self, kv_c, k_pe):
    """Latents [T, L] and k_pe [T, R] -> the prefill's (keys, values [T, N, V], k_pe apart): keys
    [T, N, P+R] and None, or with split_k_pe k_nope [T, N, P] and k_pe [T, R] (the split form)."""
    kv_c = kv_c.astype(self.dtype)
    k_nope = jnp.einsum("TL,NPL->TNP", kv_c, self.W_UK_T[...])
    v = jnp.einsum("TL,NLV->TNV", kv_c, self.W_UV[...])
    k_pe = k_pe.astype(self.dtype)
    return (k_nope, v, k_pe) if self.split_k_pe else (join_k_pe(k_nope, k_pe), v, None)

  def _prefill(self, q, kv_c, k_pe, cache, md):
    c = self.config
    cu = md.prefill_query_start_loc
    k, v, k_pe = self._up_project(kv_c, k_pe)
    o, lse = self.backend.prefill(q, k, v, cu, cu, scale=c.softmax_scale, causal=True,
                                  max_seqlen_q=md.max_prefill_query_len, k_pe=k_pe)

    def context_chunk(carry, chunk):
      slots, cu_k = chunk
      rows = self.backend.gather_cache(cache, slots)
      k_ctx, v_ctx, k_pe_ctx = self._up_project(rows[:, :c.kv_lora_rank],
                                                rows[:, c.kv_lora_rank:])
      part = self._context_attention(q, k_ctx, v_ctx, cu_k, md, k_pe_ctx)
      return merge_rows(*carry, *part), None

    if md.context_slots.shape[0]:
      (o, lse), _ = lax.scan(context_chunk, (o, lse), (md.context_slots, md.context_cu_seqlens))
    return o

  def _context_attention(self, q, k, v, cu_k, md, k_pe=None):
    """One context chunk's non-causal attention for the query rows of the requests with keys in
    it (`context_window`; q [Tp, N, P+R], all prefill rows; k, v and k_pe as `_up_project` gives
    them): (first row, o [W, N, V], lse [W, N]).
    The other rows would see no key and leave the merge as it was: skipping them spares the
    kernel their items and the merge their rows."""
    tp = q.shape[0]
    rows = tp if md.context_query_rows is None else md.context_query_rows
    if not 0 < rows <= tp:
      raise ValueError(f"metadata's context_query_rows {rows} must be in [1, {tp}] (the prefill "
                       f"rows)")
    start, cu_q = context_window(md.prefill_query_start_loc, cu_k, rows, tp)
    o, lse = self.backend.prefill(
        lax.dynamic_slice_in_dim(q, start, rows), k, v, cu_q, cu_k,
        scale=self.config.softmax_scale, causal=False,
        max_seqlen_q=min(md.max_prefill_query_len, rows), k_pe=k_pe)
    return start, o, lse
