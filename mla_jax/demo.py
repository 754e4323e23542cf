"""Demo: a DeepSeek-V2-Lite-shaped MLA layer with random weights, batched prefill then decode.

    python -m mla_jax.demo [--backend reference|pallas|pallas_triton|pallas_mosaic] [--steps 8]
                           [--dtype float32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax import backends
from mla_jax.cache import LatentCache
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--backend", choices=sorted(backends.BACKENDS), default=None,
                      help=f"default: ${backends.ENV_VAR}, else by platform")
  parser.add_argument("--prompts", type=int, nargs="+", default=[37, 120, 64, 251])
  parser.add_argument("--steps", type=int, default=8, help="decode steps after the prefill")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--block-size", type=int, default=16)
  args = parser.parse_args(argv)

  config = MLAConfig.preset("DeepSeek-V2-Lite")
  dtype = jnp.dtype(args.dtype)
  layer = DeepseekV2MLAAttention(config, backend=args.backend, dtype=dtype, param_dtype=dtype,
                                 rngs=nnx.Rngs(0))
  print(f"backend: {layer.mla_attn.backend_name} on {jax.default_backend()}; dtype {dtype.name}")
  print(f"layer: hidden {config.hidden_size}, heads {config.num_heads}, latent {config.latent_dim} "
        f"(L {config.kv_lora_rank} + R {config.qk_rope_head_dim}), "
        f"q_lora_rank {config.q_lora_rank}")

  bs, prompts = args.block_size, args.prompts
  max_len = max(prompts) + args.steps
  blocks_per_seq = -(-max_len // bs)
  num_blocks = blocks_per_seq * len(prompts) + 1
  cache = LatentCache.allocate(num_blocks, bs, config.latent_dim, dtype)
  rng = np.random.default_rng(0)
  tables = rng.permutation(num_blocks)[:blocks_per_seq * len(prompts)].reshape(len(prompts), -1)
  inputs = [rng.standard_normal((p + args.steps, config.hidden_size)).astype(np.float32)
            for p in prompts]
  step = jitted_step(layer)

  outputs = [[] for _ in prompts]
  done = [0] * len(prompts)
  for s in range(args.steps + 1):
    q_lens = prompts if s == 0 else [1] * len(prompts)
    reqs = [RequestState(done[i], q_lens[i], tables[i]) for i in range(len(prompts))]
    md, layout = build_metadata(reqs, block_size=bs, num_blocks=num_blocks,
                                max_blocks_per_seq=blocks_per_seq)
    x = layout.pack([inputs[i][done[i]:done[i] + q_lens[i]] for i in range(len(prompts))])
    start = time.perf_counter()
    out, cache = step(jnp.asarray(x, dtype), cache, md)
    out.block_until_ready()
    ms = (time.perf_counter() - start) * 1e3
    for i, o in enumerate(layout.unpack(out)):
      outputs[i].append(o)
      done[i] += q_lens[i]
    kind = "prefill" if s == 0 else "decode "
    print(f"step {s:2d} {kind} {sum(q_lens):4d} tokens in {md.num_rows:4d} rows "
          f"(decode {md.num_decode_rows} + prefill {md.num_prefill_rows}, power-of-two buckets) "
          f"x {x.shape[1]}: {ms:8.2f} ms" + ("  (includes compilation)" if s <= 1 else ""))

  worst = 0.0
  for i in range(len(prompts)):
    got = np.concatenate(outputs[i]).astype(np.float32)
    ref = np.asarray(layer.unabsorbed_forward(jnp.asarray(inputs[i][:done[i]], dtype),
                                              jnp.arange(done[i])), np.float32)
    worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
  print("padding rows write no cache slot; layout.unpack drops them")
  print(f"max error against the unabsorbed attention math (relative to max |out|): {worst:.2e}")


if __name__ == "__main__":
  main()
