"""Runs the sharded layer on 8 host CPU devices and prints what it measured as one JSON line.

test_sharding.py starts this in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8: the flag only counts if it is set before jax
starts, and the other tests expect one device. The worker reports facts (differences from the
single-device layer, compiled collectives, errors); the tests judge them.
"""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import test_attention as dense
import test_dsa_layer as dsa
from mla_jax import sharding
from mla_jax.cache import LatentCache
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.modules import jitted_step

CFG = dense.SMALL.replace(num_heads=8)
# (tp, dcp, how dcp merges)
DENSE_CASES = [(1, 1, "all_reduce"), (2, 1, "all_reduce"), (8, 1, "all_reduce"),
               (1, 2, "all_reduce"), (1, 4, "all_reduce"), (2, 4, "all_reduce"),
               (2, 2, "all_gather"), (1, 2, "o_proj"), (2, 2, "o_proj")]
# (tp, dcp, latent cache kind, how dcp merges): V3.2, prompts longer than top-k in a mixed
# prefill/decode schedule.
DSA_CASES = [(2, 1, "ds_mla", "all_reduce"), (1, 2, "latent", "all_reduce"),
             (2, 2, "ds_mla", "all_reduce"), (1, 4, "latent", "all_reduce"),
             (2, 2, "ds_mla", "o_proj")]
# Prefill (request 0's prompt in two chunks, its context read back 8 rows at a time), then decodes.
SCHEDULE = [[10, 5, 25], [7, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 1]]
WORKSPACE = 8
# One compiled collective: "%name = TYPE all-reduce(...)"; TYPE is a shape or a tuple of shapes.
_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute|collective-broadcast)(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def run_with_host_devices(script: str) -> dict:
  """Runs tests/`script` in a subprocess that sees 8 host CPU devices; returns the JSON of its
  last output line."""
  tests = Path(__file__).parent
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  path = os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")])
  env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
  proc = subprocess.run([sys.executable, str(tests / script)], cwd=tests, env=env,
                        capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stderr[-6000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def collectives(hlo: str):
  """[{"op": name, "shapes": [[dtype, dims], ...]}] of every collective in compiled HLO text."""
  out = []
  for types, op in _COLLECTIVE.findall(hlo):
    shapes = [[dt, [int(d) for d in dims.split(",") if d]] for dt, dims in _SHAPE.findall(types)]
    out.append({"op": op, "shapes": shapes})
  return out


def poisoned_cache():
  """Every page NaN: a read of a page the step does not own or see would show in the outputs."""
  cache = LatentCache.allocate(dense.NB, dense.BS, CFG.latent_dim, jnp.float32)
  return LatentCache(jnp.full_like(cache.data, jnp.nan), cache.k_scale)


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def case_name(*parts):
  return "-".join(map(str, parts))


def dense_case(tp, dcp, merge, inputs, ref_outs, ref_cache):
  mesh = sharding.make_mesh(tp=tp, dcp=dcp)
  layer = sharding.shard_layer(dense.make_layer(CFG), mesh, dcp_merge=merge)
  tables = dense.tables_for(3, 0)
  outs, cache = dense.run_schedule(layer, inputs, SCHEDULE, tables,
                                   sharding.shard_cache(poisoned_cache(), mesh),
                                   workspace=WORKSPACE, dcp=dcp)
  # The mixed step (decode rows, then prefill rows with earlier context), compiled for its HLO,
  # its metadata placed on the mesh as generate places it.
  md, _ = build_metadata([RequestState(10, 7, tables[0]), RequestState(5, 1, tables[1]),
                          RequestState(25, 1, tables[2])], block_size=dense.BS,
                         num_blocks=dense.NB, max_blocks_per_seq=dense.MB,
                         context_workspace=WORKSPACE, dcp=dcp)
  x = sharding.place(jnp.zeros((md.num_rows, CFG.hidden_size), jnp.float32), mesh)
  hlo = jitted_step(layer).lower(x, cache, sharding.place_metadata(md, mesh)).compile().as_text()
  return {
      "max_abs_diff": max_diff(outs, ref_outs),
      "max_abs_ref": max(float(np.abs(o).max()) for o in ref_outs),
      "cache_equal": bool(np.array_equal(np.asarray(cache.data), ref_cache, equal_nan=True)),
      "cache_spec": str(cache.data.sharding.spec),
      "cache_shard_elements": cache.data.addressable_shards[0].data.size,
      "rows": md.num_rows,
      "decode_rows": md.num_decode_rows,
      "collectives": collectives(hlo),
  }


def jitted_dsa(layer):
  """`layer` as test_dsa_layer.run calls it (always with return_topk=True there), under jit:
  eager op-by-op dispatch over 8 devices is what would make this test slow."""
  step = nnx.jit(lambda layer, x, cache, md: layer(x, cache, md, return_topk=True))
  return lambda x, cache, md, return_topk: step(layer, x, cache, md)


@functools.cache
def dsa_reference(kind):
  """The single-device V3.2 layer's outputs, selections and cache for a cache `kind`: the same
  layer, inputs and tables for every DSA case, so computed once per kind, not once per case."""
  return dsa.run(jitted_dsa(dsa.make_layer()), dsa.inputs_for(dsa.SCHEDULE, 1), dsa.SCHEDULE,
                 dsa.tables(2), dsa.make_cache(kind))


def dsa_case(tp, dcp, kind, merge):
  """V3.2: the indexer replicated over tp, sparse attention split by heads; under dcp every cache
  split by blocks, each device selecting among its own tokens, the selections merged."""
  inputs, tables = dsa.inputs_for(dsa.SCHEDULE, 1), dsa.tables(2)
  ref, ref_sels, ref_cache = dsa_reference(kind)
  mesh = sharding.make_mesh(tp=tp, dcp=dcp)
  layer = sharding.shard_layer(dsa.make_layer(), mesh, dcp_merge=merge)
  cache = sharding.shard_cache(dsa.make_cache(kind), mesh)
  got, sels, cache = dsa.run(jitted_dsa(layer), inputs, dsa.SCHEDULE, tables, cache, dcp=dcp)
  same = all(set(np.asarray(a[t]).tolist()) == set(np.asarray(b[t]).tolist())
             for ra, rb in zip(sels, ref_sels) for a, b in zip(ra, rb) for t in range(len(a)))
  # The decode step past the prompts, compiled for its HLO.
  md, _ = build_metadata([RequestState(19, 1, tables[0]), RequestState(12, 1, tables[1])],
                         block_size=dsa.BS, num_blocks=dsa.NB, max_blocks_per_seq=dsa.MB,
                         index_topk=dsa.TOPK, dcp=dcp)
  x = sharding.place(jnp.zeros((md.num_rows, dsa.CFG.hidden_size), jnp.float32), mesh)
  hlo = jitted_step(layer).lower(x, cache, sharding.place_metadata(md, mesh)).compile().as_text()
  leaves = lambda c: [np.asarray(a).reshape(-1).view(np.uint8) for a in jax.tree.leaves(c)]
  return {"max_abs_diff": max_diff(got, ref), "same_selection": same,
          "cache_equal": all(np.array_equal(a, b)
                             for a, b in zip(leaves(cache), leaves(ref_cache))),
          # Element counts of every paged array of the cache, whole and one device's shard.
          "cache_sizes": sorted({n for a in jax.tree.leaves(cache) if a.ndim >= 2
                                 for n in (a.size, a.addressable_shards[0].data.size)}),
          "cache_specs": sorted({str(a.sharding.spec) for a in jax.tree.leaves(cache)
                                 if a.ndim >= 2}),
          "collectives": collectives(hlo)}


def errors():
  """The ValueError message of each misuse (None: it was accepted)."""
  misuse = {
      "heads_over_tp3": lambda: sharding.shard_layer(dense.make_layer(CFG),
                                                     sharding.make_mesh(tp=3)),
      "blocks_over_dcp4": lambda: sharding.shard_cache(
          LatentCache.allocate(42, dense.BS, CFG.latent_dim, jnp.float32),
          sharding.make_mesh(dcp=4)),
      "metadata_without_dcp": lambda: dense.run_schedule(
          sharding.shard_layer(dense.make_layer(CFG), sharding.make_mesh(dcp=2)),
          dense.inputs_for([[3]], 0), [[3]], dense.tables_for(1, 0), poisoned_cache()),
      "place_metadata_for_another_dcp": lambda: sharding.place_metadata(
          build_metadata([RequestState(0, 3, [0])], block_size=dense.BS, num_blocks=dense.NB,
                         max_blocks_per_seq=1, dcp=2)[0], sharding.make_mesh(dcp=4)),
      "dcp_merge_unknown": lambda: sharding.shard_layer(
          dense.make_layer(CFG), sharding.make_mesh(dcp=2), dcp_merge="reduce"),
      "explicit_mesh": lambda: sharding.shard_layer(dense.make_layer(CFG),
                                                    jax.make_mesh((2,), (sharding.TP_AXIS,))),
  }
  out = {}
  for name, call in misuse.items():
    try:
      call()
      out[name] = None
    except ValueError as e:
      out[name] = str(e)
  return out


def main():
  assert jax.device_count() == 8, f"need 8 host devices, got {jax.device_count()}"
  inputs = dense.inputs_for(SCHEDULE, seed=1)
  ref_outs, ref_cache = dense.run_schedule(dense.make_layer(CFG), inputs, SCHEDULE,
                                           dense.tables_for(3, 0), poisoned_cache(),
                                           workspace=WORKSPACE)
  report = {
      "dense": {case_name(*c): dense_case(*c, inputs, ref_outs, np.asarray(ref_cache.data))
                for c in DENSE_CASES},
      "dsa": {case_name(*c): dsa_case(*c) for c in DSA_CASES},
      "errors": errors(),
  }
  print(json.dumps(report))


if __name__ == "__main__":
  main()
