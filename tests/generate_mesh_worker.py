"""Generates on meshes of host CPU devices and on one device; prints what it measured as one JSON
line. test_generation.py starts it in a subprocess (see sharding_worker.run_with_host_devices)."""

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import sharding
from mla_jax.model import DeepseekForCausalLM, forward, generate
from mla_jax.tiny_checkpoint import write_tiny_checkpoint
from test_generation import NEW_TOKENS, POOL, PROMPTS, SAMPLED, STOP

MESH_CASES = [("v3", 2, 2), ("v3.2", 2, 1), ("v3.2", 2, 2)]  # (variant, tp, dcp)
# Under dcp, pages of 4 tokens: every request's blocks spread over the devices (generate deals
# a request's consecutive blocks to the dcp ranges in turn).
DCP_POOL = dict(block_size=4, num_blocks=32)


def outputs(model, variant, pool):
  """Greedy tokens and logits, tokens with the stop token, sampled tokens: 4 steps a dispatch;
  forward's logits over the prompts."""
  run = lambda **kw: generate(model, PROMPTS, NEW_TOKENS, steps_per_dispatch=4, **pool, **kw)
  tokens, logits = run(return_logits=True)
  return {"tokens": tokens, "logits": logits, "stopped": run(stop_token_id=STOP[variant]),
          "sampled": run(sampling=SAMPLED, key=jax.random.key(4)),
          "forward": forward(model, PROMPTS, block_size=pool["block_size"])}


def case(variant, tp, dcp):
  path = tempfile.mkdtemp()
  write_tiny_checkpoint(path, variant, index_topk=8)
  load = lambda: DeepseekForCausalLM.from_checkpoint(path, backend="reference", dtype=jnp.float32)
  pool = POOL if dcp == 1 else DCP_POOL
  ref = outputs(load(), variant, pool)
  got = outputs(sharding.shard_layer(load(), sharding.make_mesh(tp=tp, dcp=dcp)), variant, pool)
  report = {k: got[k] == ref[k] for k in ("tokens", "stopped", "sampled")}
  for k in ("logits", "forward"):
    report[f"max_{k}_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(got[k], ref[k]))
    report[f"max_abs_{k}"] = max(float(np.abs(a).max()) for a in ref[k])
  return report


def main():
  assert jax.device_count() == 8, f"need 8 host devices, got {jax.device_count()}"
  print(json.dumps({f"{v}-{tp}x{dcp}": case(v, tp, dcp) for v, tp, dcp in MESH_CASES}))


if __name__ == "__main__":
  sys.exit(main())
