"""A backend's kernels run per shard of a device mesh, through `jax.shard_map`.

Tensor parallelism (mesh axis "tp"): queries, keys, values and outputs are split by heads. Every
kernel is independent per head, so each device runs the unchanged kernel on its N/tp heads against
the whole latent cache, which is replicated over tp (it has no head axis). The V3.2 indexer is
replicated too, as in vLLM: its kernels run on every device with the same inputs.

Decode context parallelism (mesh axis "dcp"): the latent cache's num_blocks axis is split into dcp
contiguous ranges, device d owning global blocks [d*nb, (d+1)*nb) with nb = num_blocks / dcp (what
a NamedSharding of that axis gives). Block tables keep global block indices, so any allocator works;
one that spreads each request's blocks over the ranges balances the devices. Each device decodes
over the tokens of its own blocks (`metadata.dcp_local_view`) with the normal decode kernel and the
partial (o, lse) are merged across dcp by their log-sum-exps: all-reduces of o-sized data, the cache
itself never moves. Cache writes land on the owning device only. Prefill runs un-split (replicated
over dcp): its earlier-context rows are gathered from their owners (an all-reduce of the workspace
rows), and the V3.2 sparse path takes a replicated cache (`sharding.shard_cache` refuses dcp there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from mla_jax.backends import Backend
from mla_jax.metadata import dcp_local_view

TP_AXIS = "tp"
DCP_AXIS = "dcp"


def mesh_axis(mesh: Mesh, name: str) -> str | None:
  """`name` when `mesh` splits over it; None for an absent or size-1 axis (nothing to split or
  reduce over, so no specs mention it and no collective over it is emitted)."""
  return name if mesh.shape.get(name, 1) > 1 else None


def _merge_across(axis, o, lse):
  """Merges partial attentions over disjoint keys, one per device of `axis`, by their LSEs: the
  all-reduce form of `attention.merge_attn_states` (max-shifted weights, +inf lse counts as
  -inf)."""
  lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
  m = lax.pmax(lse, axis)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse - m)
  total, acc = lax.psum((w, w[..., None] * o.astype(jnp.float32)), axis)
  safe = jnp.where(total > 0, total, 1.0)
  return (acc / safe[..., None]).astype(o.dtype), jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)


@functools.cache
def shard_backend(backend: Backend, mesh: Mesh) -> Backend:
  """`backend` with every kernel run per shard of `mesh` (axes "tp" and/or "dcp"; others replicate).

  Takes and returns global arrays with the layer's shardings: heads split over tp, cache blocks
  over dcp. Cached per (backend, mesh), so tracing a layer twice reuses the same functions.
  """
  tp, dcp = mesh_axis(mesh, TP_AXIS), mesh_axis(mesh, DCP_AXIS)
  heads, blocks, rep = P(None, tp), P(dcp), P()
  # The kernels are written for plain arrays (e.g. loop carries started from constants), not for
  # shard_map's tracking of which values vary over which axes: leave that check off.
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)

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
    return jnp.where((local >= 0) & (local < owned), local, -1)

  def decode(q, cache, block_tables, seq_lens, **kw):
    specs, split = placement(cache)

    def per_shard(q, cache, block_tables, seq_lens):
      if not split:
        return backend.decode(q, cache, block_tables, seq_lens, **kw)
      nb = cache.num_blocks
      tables, lens = dcp_local_view(block_tables, seq_lens, first_block=lax.axis_index(dcp) * nb,
                                    num_blocks=nb, block_size=cache.block_size)
      return _merge_across(dcp, *backend.decode(q, cache, tables, lens, **kw))
    return smap(per_shard, in_specs=(heads, specs, rep, rep), out_specs=(heads, heads))(
        q, cache, block_tables, seq_lens)

  def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    return smap(lambda *a: backend.prefill(*a, **kw), in_specs=(heads, heads, heads, rep, rep),
                out_specs=(heads, heads))(q, k, v, cu_seqlens_q, cu_seqlens_k)

  def write_cache(cache, kv_c_normed, k_pe, slot_mapping):
    specs, split = placement(cache)

    def per_shard(cache, kv_c_normed, k_pe, slot_mapping):
      return backend.write_cache(cache, kv_c_normed, k_pe,
                                 local_slots(slot_mapping, cache, split))
    return smap(per_shard, in_specs=(specs, rep, rep, rep), out_specs=specs)(
        cache, kv_c_normed, k_pe, slot_mapping)

  def gather_cache(cache, slots):
    specs, split = placement(cache)

    def per_shard(cache, slots):
      rows = backend.gather_cache(cache, local_slots(slots, cache, split))
      # One device owns each slot; the others read zeros for it, so the sum is the row exactly.
      return lax.psum(rows, dcp) if split else rows
    return smap(per_shard, in_specs=(specs, rep), out_specs=rep)(cache, slots)

  def sparse_attention(q, cache, slots, **kw):
    return smap(lambda q, cache, slots: backend.sparse_attention(q, cache, slots, **kw),
                in_specs=(heads, rep, rep), out_specs=(heads, heads))(q, cache, slots)

  def indexer_logits(*args):
    return smap(backend.indexer_logits, in_specs=rep, out_specs=rep)(*args)

  def topk(logits, seq_lens, k):
    return smap(lambda logits, seq_lens: backend.topk(logits, seq_lens, k), in_specs=rep,
                out_specs=rep)(logits, seq_lens)

  tp_size = mesh.shape[tp] if tp else 1
  return dataclasses.replace(
      backend, decode=decode, prefill=prefill, write_cache=write_cache, gather_cache=gather_cache,
      sparse_attention=sparse_attention, indexer_logits=indexer_logits, topk=topk,
      # Backend.check sees the global head count; each kernel call sees N / tp of them.
      max_heads=None if backend.max_heads is None else backend.max_heads * tp_size)
