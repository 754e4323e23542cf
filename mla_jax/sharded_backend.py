"""A backend's kernels run per shard of a device mesh, through `jax.shard_map`.

Tensor parallelism (mesh axis "tp"): queries, keys, values and outputs are split by heads. Every
kernel is independent per head, so each device runs the unchanged kernel on its N/tp heads against
the whole latent cache, which is replicated over tp (it has no head axis). The V3.2 indexer is
replicated over tp too, as in vLLM: its kernels run on every device of a tp group with the same
inputs.

Decode context parallelism (mesh axis "dcp"): every cache's num_blocks axis (the latent cache, and
for V3.2 the fp8_ds_mla cache and the indexer's K cache) is split into dcp contiguous ranges, device
d owning global blocks [d*nb, (d+1)*nb) with nb = num_blocks / dcp (what a NamedSharding of that
axis gives). Block tables keep global block indices, so any allocator works; one that spreads each
request's blocks over the ranges balances the devices. The cache itself never moves:
- Writes land on the owning device only (other devices see the slot as -1 and skip it).
- Decode: each device runs the normal decode kernel over the tokens of its own blocks, through the
  tables `metadata.dcp_tables` built on the host, and the partial (o, lse) are merged across dcp by
  their log-sum-exps (`DCP_MERGES`).
- V3.2 selection: each device scores the tokens of its own blocks (its K cache shard; the others'
  blocks are -1 in its tables, so masked, not read) and keeps its own top-k; the candidates
  (score, position) of all devices are all-gathered and the top-k of their union is the row's
  selection, exactly one device's: a token among the global top-k has fewer than k tokens scoring
  above it on its own device too, so it is among its device's candidates; ties go to the lower
  position on both sides. Sparse attention then runs per device over the selected tokens it holds,
  merged by LSE as decode is.
- Prefill runs un-split (replicated over dcp): its earlier-context rows are gathered from their
  owners (an all-reduce of the workspace rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mla_jax.backends import Backend
from mla_jax.cache import positions_to_slots

TP_AXIS = "tp"
DCP_AXIS = "dcp"
# How dcp devices merge their partial attentions (o [T, N, L], lse [T, N]) over disjoint tokens:
# "all_reduce": a max of the lse, then one all-reduce of the float32 weights and weighted o.
# "all_gather": o in its own dtype (bf16: half the bytes) and the float32 lse all-gathered, each
#   device merging the dcp parts itself (vLLM's all-gather of (o, lse)).
# "o_proj": only the lse crosses devices here (its max and the weights' sum, [T, N] float32); each
#   device returns its part, its o weighted by its share, as parts [dcp, T, N, L] that the layer
#   carries through W_UV and o_proj unreduced, so that they are summed by the all-reduce of o_proj's
#   output ([T, hidden] in the activation dtype, which tensor parallelism runs anyway): the merge
#   moves hidden / (N * L) of o's bytes (1/9 for V3 at 128 heads).
DCP_MERGES = ("all_reduce", "all_gather", "o_proj")


def dcp_size(mesh: Mesh | None) -> int:
  """How many devices `mesh` splits the cache over (1: no mesh, or no dcp axis)."""
  return 1 if mesh is None else mesh.shape.get(DCP_AXIS, 1)


def mesh_axis(mesh: Mesh, name: str) -> str | None:
  """`name` when `mesh` splits over it; None for an absent or size-1 axis (nothing to split or
  reduce over, so no specs mention it and no collective over it is emitted)."""
  return name if mesh.shape.get(name, 1) > 1 else None


def merge_across(axis: str, o, lse, how: str = "all_reduce"):
  """Merges partial attentions over disjoint keys, one per device of `axis`, by their LSEs (the
  collective form of `attention.merge_attn_states`: max-shifted weights, +inf lse counts as -inf,
  an empty part's o never read). With how="o_proj" the o returned is this device's part of the
  merged o (the parts over `axis` sum to it); the lse is the merged one for every `how`."""
  lse = jnp.where(lse == jnp.inf, -jnp.inf, lse.astype(jnp.float32))
  weigh = lambda w, o: jnp.where(w[..., None] > 0, w[..., None] * o.astype(jnp.float32), 0.0)
  if how == "all_gather":
    lses, os = lax.all_gather(lse, axis), lax.all_gather(o, axis)  # [dcp, T, N], [dcp, T, N, L]
    m = jnp.max(lses, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m)
    total, acc = jnp.sum(w, axis=0), jnp.sum(weigh(w, os), axis=0)
  elif how in ("all_reduce", "o_proj"):
    m = lax.pmax(lse, axis)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m)
    if how == "all_reduce":
      total, acc = lax.psum((w, weigh(w, o)), axis)
    else:  # this device's part: the sum over devices is left to o_proj's all-reduce
      total, acc = lax.psum(w, axis), weigh(w, o)
  else:
    raise ValueError(f"unknown dcp merge {how!r}; supported: {DCP_MERGES}")
  safe = jnp.where(total > 0, total, 1.0)
  return (acc / safe[..., None]).astype(o.dtype), jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)


def merge_topk(scores, positions, k: int):
  """The top-`k` positions [T, k] (-1 padded) among candidates (scores, positions) [T, C] (-1 or a
  -inf score: none), ties to the lower position, as a top-k over the whole row breaks them."""
  order = jnp.argsort(jnp.where(positions < 0, jnp.iinfo(jnp.int32).max, positions), axis=1,
                      stable=True)
  scores = jnp.take_along_axis(jnp.where(positions < 0, -jnp.inf, scores), order, axis=1)
  positions = jnp.take_along_axis(positions, order, axis=1)
  best, idx = lax.top_k(scores, k)
  return jnp.where(best > -jnp.inf, jnp.take_along_axis(positions, idx, axis=1), -1)


@functools.cache
def shard_backend(backend: Backend, mesh: Mesh, dcp_merge: str = "all_reduce") -> Backend:
  """`backend` with every kernel run per shard of `mesh` (axes "tp" and/or "dcp"; others replicate).

  Takes and returns global arrays and caches with the layer's shardings: heads split over tp,
  cache blocks over dcp (each cache says how, `dcp_shardings`). Under dcp, decode takes each
  device's tables and lengths ([dcp, T, MB] and [dcp, T], `AttentionMetadata.dcp_row_views`), and
  the V3.2 indexer's logits are each device's own ([dcp, T, S], never gathered), which topk turns
  into the merged selection. Cached per (backend, mesh, dcp_merge), so tracing a layer twice
  reuses the same functions.
  """
  if dcp_merge not in DCP_MERGES:
    raise ValueError(f"unknown dcp merge {dcp_merge!r}; supported: {DCP_MERGES}")
  tp, dcp = mesh_axis(mesh, TP_AXIS), mesh_axis(mesh, DCP_AXIS)
  heads, blocks, rep = P(None, tp), P(dcp), P()
  # The kernels are written for plain arrays (e.g. loop carries started from constants), not for
  # shard_map's tracking of which values vary over which axes: leave that check off.
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
  merge = functools.partial(merge_across, dcp, how=dcp_merge)
  # A split attention's o: merged and split by heads, or (the "o_proj" merge) each device's part,
  # stacked [dcp, T, N, L] along a leading axis split over dcp.
  if dcp_merge == "o_proj" and dcp:
    split_o, as_part = P(dcp, None, tp), lambda o, lse: (o[None], lse)
  else:
    split_o, as_part = heads, lambda o, lse: (o, lse)

  def placement(cache):
    """(the cache's partition specs, whether its blocks are split over dcp): the cache says."""
    specs = cache.dcp_shardings(blocks, rep)
    return (rep, False) if specs is None else (specs, dcp is not None)

  def local_slots(slots, cache, split):
    """Global slots -> this device's slots in its cache shard; slots it does not own -> -1."""
    if not split:
      return slots
    owned = cache.num_blocks * cache.block_size
    local = slots - lax.axis_index(dcp) * owned
    return jnp.where((slots >= 0) & (local >= 0) & (local < owned), local, -1)

  def decode(q, cache, block_tables, seq_lens, **kw):
    specs, split = placement(cache)
    if not split:
      return smap(lambda q, cache, t, s: backend.decode(q, cache, t, s, **kw),
                  in_specs=(heads, specs, rep, rep), out_specs=(heads, heads))(
                      q, cache, block_tables, seq_lens)
    dcp_size = mesh.shape[dcp]
    if block_tables.ndim != 3 or block_tables.shape[0] != dcp_size:
      raise ValueError(f"decode under dcp={dcp_size} takes each device's block tables "
                       f"[{dcp_size}, T, MB], got {block_tables.shape}: build the metadata with "
                       f"build_metadata(..., dcp={dcp_size})")

    def per_shard(q, cache, block_tables, seq_lens):
      return as_part(*merge(*backend.decode(q, cache, block_tables[0], seq_lens[0], **kw)))
    return smap(per_shard, in_specs=(heads, specs, blocks, blocks), out_specs=(split_o, heads))(
        q, cache, block_tables, seq_lens)

  def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, k_pe=None, **kw):
    # k_pe (the split keys' shared columns, or None) has no head axis: whole on every device.
    def per_shard(q, k, v, cu_q, cu_k, k_pe):
      return backend.prefill(q, k, v, cu_q, cu_k, k_pe=k_pe, **kw)
    return smap(per_shard, in_specs=(heads, heads, heads, rep, rep, rep),
                out_specs=(heads, heads))(q, k, v, cu_seqlens_q, cu_seqlens_k, k_pe)

  def write_cache(cache, kv_c_normed, k_pe, slot_mapping):
    specs, split = placement(cache)

    def per_shard(cache, kv_c_normed, k_pe, slot_mapping):
      return backend.write_cache(cache, kv_c_normed, k_pe,
                                 local_slots(slot_mapping, cache, split))
    return smap(per_shard, in_specs=(specs, rep, rep, rep), out_specs=specs)(
        cache, kv_c_normed, k_pe, slot_mapping)

  def write_indexer_cache(k_cache, k, slot_mapping):
    specs, split = placement(k_cache)

    def per_shard(k_cache, k, slot_mapping):
      return backend.write_indexer_cache(k_cache, k, local_slots(slot_mapping, k_cache, split))
    return smap(per_shard, in_specs=(specs, rep, rep), out_specs=specs)(k_cache, k, slot_mapping)

  def gather_cache(cache, slots):
    specs, split = placement(cache)

    def per_shard(cache, slots):
      rows = backend.gather_cache(cache, local_slots(slots, cache, split))
      # One device owns each slot; the others read zeros for it, so the sum is the row exactly.
      return lax.psum(rows, dcp) if split else rows
    return smap(per_shard, in_specs=(specs, rep), out_specs=rep)(cache, slots)

  def sparse_attention(q, cache, slots, **kw):
    specs, split = placement(cache)

    def per_shard(q, cache, slots):
      o, lse = backend.sparse_attention(q, cache, local_slots(slots, cache, split), **kw)
      return as_part(*merge(o, lse)) if split else (o, lse)
    return smap(per_shard, in_specs=(heads, specs, rep),
                out_specs=(split_o if split else heads, heads))(
        q, cache, slots)

  def indexer_logits(q, weights, k_cache, block_tables, seq_lens, *, distinct_tables=False):
    specs, split = placement(k_cache)
    logits = functools.partial(backend.indexer_logits, distinct_tables=distinct_tables)
    if not split:
      return smap(logits, in_specs=(rep, rep, specs, rep, rep), out_specs=rep)(
          q, weights, k_cache, block_tables, seq_lens)

    def per_shard(q, weights, k_cache, block_tables, seq_lens):
      # Positions stay the row's (global table order): others' blocks are -1, scored -inf.
      nb = k_cache.num_blocks
      local = block_tables - lax.axis_index(dcp) * nb
      tables = jnp.where((block_tables >= 0) & (local >= 0) & (local < nb), local, -1)
      return logits(q, weights, k_cache, tables, seq_lens)[None]
    return smap(per_shard, in_specs=(rep, rep, specs, rep, rep), out_specs=blocks)(
        q, weights, k_cache, block_tables, seq_lens)

  def topk(logits, seq_lens, k):
    if logits.ndim == 2:  # one selection over the whole row (no dcp split of the indexer cache)
      return smap(lambda logits, seq_lens: backend.topk(logits, seq_lens, k), in_specs=rep,
                  out_specs=rep)(logits, seq_lens)

    def per_shard(logits, seq_lens):
      logits = logits[0]
      own = backend.topk(logits, seq_lens, k)
      scores = jnp.where(own >= 0, jnp.take_along_axis(logits, jnp.maximum(own, 0), axis=1),
                         -jnp.inf)
      gather = lambda a: lax.all_gather(a, dcp, axis=1, tiled=True)  # [T, dcp*k]
      return merge_topk(gather(scores), gather(own), k)
    return smap(per_shard, in_specs=(blocks, rep), out_specs=rep)(logits, seq_lens)

  def topk_slots(logits, seq_lens, k, block_tables, *, block_size, num_blocks):
    if logits.ndim == 2:
      def replicated(logits, seq_lens, block_tables):
        return backend.topk_slots(logits, seq_lens, k, block_tables, block_size=block_size,
                                  num_blocks=num_blocks)
      return smap(replicated, in_specs=rep, out_specs=rep)(logits, seq_lens, block_tables)
    # Under dcp the selection is merged after the devices' own top-k: its slots are mapped after.
    positions = topk(logits, seq_lens, k)
    return positions, positions_to_slots(positions, block_tables, block_size, num_blocks)

  tp_size = mesh.shape[tp] if tp else 1
  return dataclasses.replace(
      backend, decode=decode, prefill=prefill, write_cache=write_cache,
      write_indexer_cache=write_indexer_cache, gather_cache=gather_cache,
      sparse_attention=sparse_attention, indexer_logits=indexer_logits, topk=topk,
      topk_slots=topk_slots,
      # Backend.check sees the global head count; each kernel call sees N / tp of them.
      max_heads=None if backend.max_heads is None else backend.max_heads * tp_size)
