"""Generates on meshes of host CPU devices and on one device; prints what it measured as one JSON
line. test_generation.py starts it in a subprocess (see sharding_worker.run_with_host_devices)."""

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import sharding
from mla_jax.model import DeepseekForCausalLM, generate
from mla_jax.tiny_checkpoint import write_tiny_checkpoint
from test_generation import NEW_TOKENS, POOL, PROMPTS, SAMPLED, STOP

MESH_CASES = [("v3", 2, 2), ("v3.2", 2, 1)]  # (variant, tp, dcp); dcp shards dense caches only


def outputs(model, variant):
  """Greedy tokens and logits, tokens with the stop token, sampled tokens: 4 steps a dispatch."""
  run = lambda **kw: generate(model, PROMPTS, NEW_TOKENS, steps_per_dispatch=4, **POOL, **kw)
  tokens, logits = run(return_logits=True)
  return {"tokens": tokens, "logits": logits, "stopped": run(stop_token_id=STOP[variant]),
          "sampled": run(sampling=SAMPLED, key=jax.random.key(4))}


def case(variant, tp, dcp):
  path = tempfile.mkdtemp()
  write_tiny_checkpoint(path, variant, index_topk=8)
  load = lambda: DeepseekForCausalLM.from_checkpoint(path, backend="reference", dtype=jnp.float32)
  ref = outputs(load(), variant)
  got = outputs(sharding.shard_layer(load(), sharding.make_mesh(tp=tp, dcp=dcp)), variant)
  report = {k: got[k] == ref[k] for k in ("tokens", "stopped", "sampled")}
  report["max_logit_diff"] = max(float(np.abs(a - b).max())
                                 for a, b in zip(got["logits"], ref["logits"]))
  report["max_abs_logit"] = max(float(np.abs(a).max()) for a in ref["logits"])
  return report


def main():
  assert jax.device_count() == 8, f"need 8 host devices, got {jax.device_count()}"
  print(json.dumps({f"{v}-{tp}x{dcp}": case(v, tp, dcp) for v, tp, dcp in MESH_CASES}))


if __name__ == "__main__":
  sys.exit(main())
