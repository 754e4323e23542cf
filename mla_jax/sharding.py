"""Scale-out on jax.sharding: tensor parallelism over heads (mesh axis "tp") and decode context
parallelism over the latent cache's tokens (mesh axis "dcp"), with no communication code of our own.

Parameters and the cache go on NamedShardings; XLA's partitioner splits the projections along them
(and all-reduces o_proj's head-split contraction), and the attention kernels run per shard through
`shard_map` (`mla_jax.sharded_backend`, which also says how dcp owns cache blocks).

  mesh = sharding.make_mesh(tp=4, dcp=2)
  layer = sharding.shard_layer(layer, mesh)  # after loading weights, before jitted_step
  cache = sharding.shard_cache(layer.allocate_cache(...), mesh)
  step = jitted_step(layer)
  md, layout = build_metadata(..., dcp=2)  # dcp: each device's block tables, built on the host
  out, cache = step(sharding.place(x, mesh), cache, sharding.place_metadata(md, mesh))

`place_metadata` puts the step's metadata on every device once (the dcp tables split over dcp):
arrays left on one device would be copied to every device on every call of the jitted step.

Without a mesh nothing here runs and the layer is the single-device one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mla_jax.attention import MLAAttention
from mla_jax.cache import DSACache, LatentCache
from mla_jax.metadata import AttentionMetadata
from mla_jax.sharded_backend import DCP_AXIS, DCP_MERGES, TP_AXIS, dcp_size, mesh_axis

# Parameter path suffix -> its split. Per-head weights are head-major along the split axis, so
# contiguous shards are whole heads. Everything else (the down projections, norms, the V3.2
# indexer) is replicated, as vLLM's replicated layers and indexer are.
PARAM_RULES = (
    (("q_b_proj", "kernel"), P(None, TP_AXIS)),  # [Lq, N*(P+R)]: output columns
    (("q_proj", "kernel"), P(None, TP_AXIS)),  # [hidden, N*(P+R)]
    (("kv_b_proj", "kernel"), P(None, TP_AXIS)),  # [L, N*(P+V)]
    (("mla_attn", "W_UK_T"), P(TP_AXIS)),  # [N, P, L]
    (("mla_attn", "W_UV"), P(TP_AXIS)),  # [N, L, V]
    # [N*V, hidden]: input rows, so each device's product is a partial sum that XLA all-reduces.
    (("o_proj", "kernel"), P(TP_AXIS, None)),
)


def make_mesh(*, tp: int = 1, dcp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (dcp, tp) mesh over the first dcp*tp devices (or `devices`), tp innermost so that a head
  group sits on neighbouring devices. Its axes are Auto: XLA propagates the parameters' shardings
  through the layer's plain jnp code (Explicit axes would ask every op for its output sharding)."""
  devices = jax.devices()[:tp * dcp] if devices is None else devices
  return jax.make_mesh((dcp, tp), (DCP_AXIS, TP_AXIS), axis_types=(AxisType.Auto,) * 2,
                       devices=devices)


def _check_mesh(mesh: Mesh):
  if not mesh.are_all_axes_auto:
    raise ValueError(f"the layer runs under a mesh with Auto axes (sharding.make_mesh gives one), "
                     f"got axis types {mesh.axis_types}")


def param_spec(path: Sequence[object], mesh: Mesh) -> P:
  """The split on `mesh` of the parameter at `path` (its names from the root, any prefix) by
  PARAM_RULES; axes the mesh does not split over are dropped."""
  path = tuple(path)
  for suffix, spec in PARAM_RULES:
    if path[-len(suffix):] == suffix:
      return P(*(mesh_axis(mesh, a) if a else None for a in spec))
  return P()


def shard_layer(layer: nnx.Module, mesh: Mesh, *, dcp_merge: str = "all_reduce") -> nnx.Module:
  """Places the parameters of `layer` (or of a model holding MLA layers) on `mesh` by PARAM_RULES
  and makes every MLAAttention in it run its kernels per shard, merging dcp's partial attentions
  by `dcp_merge` (one of `sharded_backend.DCP_MERGES`). Returns the same module.

  Call it after loading weights (absorbing kv_b_proj again would lose the W_UK_T / W_UV placement)
  and before `jitted_step`, which takes the state as it is then. Raises ValueError when the heads do
  not divide over tp.
  """
  _check_mesh(mesh)
  if dcp_merge not in DCP_MERGES:
    raise ValueError(f"unknown dcp_merge {dcp_merge!r}; supported: {DCP_MERGES}")
  attention = [m for _, m in nnx.iter_modules(layer) if isinstance(m, MLAAttention)]
  if not attention:
    raise ValueError(f"{type(layer).__name__} holds no MLAAttention to shard")
  for m in attention:
    m.config.num_local_heads(mesh.shape.get(TP_AXIS, 1))
  names = lambda path: [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  put = lambda path, x: jax.device_put(x, NamedSharding(mesh, param_spec(names(path), mesh)))
  nnx.update(layer, jax.tree.map_with_path(put, nnx.state(layer)))
  for m in attention:
    m.mesh, m.dcp_merge = mesh, dcp_merge
  return layer


def shard_cache(cache: LatentCache | DSACache, mesh: Mesh) -> LatentCache | DSACache:
  """Places a cache on `mesh`: every paged array's blocks split over dcp in contiguous ranges
  (a LatentCache's data; a V3.2 DSACache's latent cache, dense or fp8_ds_mla, and indexer K cache),
  replicated over tp; scales replicated."""
  _check_mesh(mesh)
  dcp = dcp_size(mesh)
  if cache.num_blocks % dcp:
    raise ValueError(f"the cache's {cache.num_blocks} blocks do not divide over dcp={dcp}")
  return jax.device_put(cache, cache.dcp_shardings(
      NamedSharding(mesh, P(mesh_axis(mesh, DCP_AXIS))), NamedSharding(mesh, P())))


def place(tree: Any, mesh: Mesh) -> Any:
  """Every array of `tree` replicated on `mesh` (a step's inputs, a decode state)."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


def place_metadata(md: AttentionMetadata, mesh: Mesh | None) -> AttentionMetadata:
  """The step's metadata on every device of `mesh` at once (None: as it is), the dcp tables split
  over dcp, so that the jitted step finds it where it runs. Raises ValueError when it was built for
  another dcp size than the mesh's."""
  if mesh is None:
    return md
  dcp = dcp_size(mesh)
  md.check_dcp(dcp, "the mesh")
  split = NamedSharding(mesh, P(mesh_axis(mesh, DCP_AXIS)))
  return jax.device_put(md, dataclasses.replace(
      jax.tree.map(lambda _: NamedSharding(mesh, P()), md),
      **({} if dcp == 1 else {"dcp_block_tables": split, "dcp_seq_lens": split})))
