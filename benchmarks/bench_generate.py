"""Generation throughput: prefill, `generate`'s decode, and the same decode step back to back.

  python -m benchmarks.bench_generate [--quick] [--variant v3 v3.2] [--batch ...]
      [--layers 4] [--prompt 1024] [--new 128] [--steps-per-dispatch 16 ...] [--time-budget S]

A DeepSeek-V3-shaped (and V3.2-shaped) dense decoder of `--layers` layers with random bf16
weights: hidden 7168, 128 heads, q_lora 1536, kv_lora 512 + rope 64, dense MLP 18432, vocab
129280; V3.2 adds the indexer (64 heads of 128, top-2048). The default backend for the platform
(Pallas on a GPU), page 64, bf16 cache. For each batch size B, B random prompts of `--prompt`
tokens and `--new` new tokens (greedy, no stop token):
  prefill tok/s   `prefill` (one step over every prompt, first token chosen), second run timed.
  gen tok/s       `decode` of the prefilled batch to the end: B*(new-1) tokens over its wall
                  time until it returns the token lists, host work and syncs included (median
                  of `--repeats`), per
                  steps-per-dispatch value. Dispatches run a fixed number of steps (a loop of
                  known trip count), the last, shorter one a loop that may end early.
  gen exit tok/s  the same with a stop token no row emits: every dispatch runs the loop that may
                  end early (what a batch with a stop token gets), whose condition a GPU reads
                  back to the host every step.
  step tok/s      the model's jitted decode step (`jitted_step`, no sampling) dispatched back to
                  back on fixed metadata (every request at prompt + new/2 tokens), the cache
                  donated and threaded through, a step's ms the slope between `--iters` and 2
                  `--iters` steps each drained once (`time_steps`): B / step ms.
  ratio           gen tok/s / step tok/s (issue 21's goal: >= 0.9 at B=64 and 256, >= 0.8 at 1, 8).
  step GB/s       weights (all but the embedding table) + the latent caches read, per step ms.
Cases run V3 before V3.2 and the larger batches first; with `--time-budget`, cases not started
within that many seconds are listed as skipped. Prints each row as it comes, then the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import make_parser, rates, require_gpu, time_steps, write_results
from mla_jax.config import MLAConfig
from mla_jax.metadata import RequestState, build_metadata
from mla_jax.model import (DEFAULT_STEPS_PER_DISPATCH, DecoderConfig, DeepseekForCausalLM,
                           PrefilledBatch, decode, prefill)
from mla_jax.modules import jitted_step

PRESETS = {"v3": "DeepSeek-V3", "v3.2": "DeepSeek-V3.2"}
VOCAB, INTERMEDIATE, PAGE = 129280, 18432, 64


def make_model(variant: str, layers: int, backend: str | None) -> DeepseekForCausalLM:
  config = DecoderConfig(MLAConfig.preset(PRESETS[variant]), VOCAB, layers, INTERMEDIATE)
  return DeepseekForCausalLM(config, backend=backend, dtype=jnp.bfloat16,
                             param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def wall(fn: Callable[[], Any]) -> tuple[float, Any]:
  """(seconds, result) of fn() with its device work drained."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def fresh(batch: PrefilledBatch) -> PrefilledBatch:
  """A copy of a prefilled batch (decode consumes the caches it is given), its copy done."""
  return dataclasses.replace(batch, caches=jax.block_until_ready(jax.tree.map(jnp.copy,
                                                                               batch.caches)))


def with_stop(batch: PrefilledBatch, stop: int | None) -> PrefilledBatch:
  """The prefilled batch with another stop token (None: none)."""
  state = dataclasses.replace(batch.state, stop_token=jnp.int32(-1 if stop is None else stop))
  return dataclasses.replace(batch, state=state, stop_token_id=stop)


def step_ms(model: DeepseekForCausalLM, batch: PrefilledBatch, seq: int, iters: int,
            repeats: int) -> float:
  """Median ms of the jitted decode step, `iters` back to back, every request at `seq` tokens.
  V3.2: the metadata knows top-k, as generate's does, so that both take the same path (dense
  attention while every window fits in top-k; without it the step ran the sparse path)."""
  tables = np.asarray(batch.state.block_tables)
  md, _ = build_metadata([RequestState(seq - 1, 1, tables[i][tables[i] >= 0])
                          for i in range(batch.num_requests)],
                         block_size=PAGE, num_blocks=batch.paging.num_blocks,
                         max_blocks_per_seq=tables.shape[1],
                         index_topk=model.config.attention.index_topk)
  tokens, caches = jnp.zeros(md.num_rows, jnp.int32), jax.tree.map(jnp.copy, batch.caches)
  return time_steps(jitted_step(model), tokens, caches, md, iters=iters, repeats=repeats)


def step_bytes(model: DeepseekForCausalLM, batch_size: int, seq: int) -> int:
  """Bytes one decode step must read: every weight but the embedding table, and the caches."""
  params = nnx.state(model, nnx.Param)
  weights = sum(x.nbytes for x in jax.tree.leaves(params)) - model.embed_tokens.embedding.nbytes
  c = model.config.attention
  return weights + model.config.num_layers * batch_size * seq * c.latent_dim * 2


def run_case(args: argparse.Namespace, variant: str, model: DeepseekForCausalLM,
             batch_size: int) -> dict[str, Any]:
  rng = np.random.default_rng(batch_size)
  prompts = rng.integers(0, VOCAB, (batch_size, args.prompt)).tolist()
  # A PrefilledBatch is no pytree: its arrays are drained by name.
  start = lambda: (b := prefill(model, prompts, args.new, block_size=PAGE), (b.caches, b.state))
  wall(start)  # compiles
  prefill_s, (batch, _) = wall(start)
  row = {"model": variant, "L": args.layers, "B": batch_size, "prompt": args.prompt,
         "new": args.new, "prefill tok/s": batch_size * args.prompt / prefill_s}
  seq = args.prompt + args.new // 2
  ms = step_ms(model, batch, seq, args.iters, args.repeats)
  row |= {"step ms": ms, "step tok/s": batch_size / ms * 1e3}
  row["step GB/s"] = rates(ms, bytes_moved=step_bytes(model, batch_size, seq))["GB/s"]
  for k in args.steps_per_dispatch:
    name = "gen" if len(args.steps_per_dispatch) == 1 else f"gen k={k}"
    # "exit": a stop token no row can emit (the vocabulary's size), so every step still runs, but
    # through the loop that may end early, whose condition a GPU reads back every step.
    for label, stop in ((name, None), (f"{name} exit", VOCAB)):
      copies = [with_stop(fresh(batch), stop) for _ in range(args.repeats + 1)]
      decode(model, copies.pop(), steps_per_dispatch=k)  # compiles its loops
      times = []
      for copy in copies:
        # decode returns host lists it read from the device, so its device work is done when it
        # returns: no jax.block_until_ready, whose walk over B x new Python ints costs ~0.6 us per
        # int (0.16 ms per step at B=256 on the H200 host), which v1 and v2 of RESULTS.md timed as
        # generation.
        start_s = time.perf_counter()
        decode(model, copy, steps_per_dispatch=k)
        times.append(time.perf_counter() - start_s)
      rate = batch_size * (args.new - 1) / statistics.median(times)
      row |= {f"{label} tok/s": rate, f"{label} ms/token": 1e3 * batch_size / rate,
              f"{label} ratio": rate / row["step tok/s"]}
  if len(args.steps_per_dispatch) == 1:
    row["k"] = args.steps_per_dispatch[0]
  return row


def main(argv: Sequence[str] | None = None) -> None:
  parser = make_parser("benchmarks.bench_generate", __doc__)
  parser.add_argument("--variant", nargs="+", default=["v3", "v3.2"], choices=sorted(PRESETS),
                      help="model shapes (default: both)")
  parser.add_argument("--batch", type=int, nargs="+", default=[256, 64, 8, 1],
                      help="batch sizes, run in this order (default: 256 64 8 1)")
  parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
  parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
  parser.add_argument("--new", type=int, default=128, help="new tokens per request (default 128)")
  parser.add_argument("--steps-per-dispatch", type=int, nargs="+",
                      default=[DEFAULT_STEPS_PER_DISPATCH],
                      help=f"decode steps per jitted call (default {DEFAULT_STEPS_PER_DISPATCH}); "
                           "several values give one gen column each")
  parser.add_argument("--backend", default=None, help="backend name (default: the platform's)")
  parser.add_argument("--iters", type=int, default=20, help="back-to-back steps per repeat")
  parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
  parser.add_argument("--time-budget", type=float, default=None,
                      help="seconds after which no new case starts (the rest are listed skipped)")
  parser.add_argument("--quick", action="store_true",
                      help="V3 only, B in {64, 8}, 32 new tokens, 2 repeats")
  parser.add_argument("--out", default="benchmarks/out", help="where the .md/.json tables go")
  args = parser.parse_args(argv)
  require_gpu("benchmarks.bench_generate")
  if args.quick:
    args.variant, args.batch, args.new, args.repeats = ["v3"], [64, 8], 32, 2
  start, rows = time.perf_counter(), []
  for variant in args.variant:
    model = None
    for b in args.batch:
      if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
        rows.append({"model": variant, "L": args.layers, "B": b, "skipped": "time budget"})
        continue
      if model is None:
        model = make_model(variant, args.layers, args.backend)
      rows.append(run_case(args, variant, model, b))
      print({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    del model
  print(f"total {time.perf_counter() - start:.0f} s on {jax.devices()[0].device_kind}")
  print(write_results(rows, "generate", args.out))


if __name__ == "__main__":
  main()
