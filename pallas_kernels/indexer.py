"""V3.2 lightning-indexer logits for GPUs, in Pallas lowered through Triton.

`I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * k_scale[s])` over the paged indexer K cache, for
every position s of row t's block table (SPEC 6). One program per (row, chunk of positions); it
walks its chunk block_n positions at a time: looks each position's page up in the row's table,
gathers the key rows from the flattened cache by index vectors, and scores them with one [H, D] x
[D, block_n] product. Positions past the row's window, and positions on -1 / out-of-range pages, are
masked (their index clamped to 0, never read) and come out -inf; whole steps past the window are
not computed at all, only filled with -inf.

e4m3 q and keys are multiplied as fp8 x fp8 with float32 accumulation, anything else in the
(exact) widened compute dtype. Compiled for sm_90, Triton turns this Pallas fp8 product into f16
mma.sync after an in-register upcast (Pallas sets no max_num_imprecise_acc, which Hopper's fp8
wgmma needs); `widen_fp8=True` multiplies the e4m3 inputs as bf16 instead (also exact), which
takes wgmma. Which is faster is for the benchmark to say. Pure arrays in and out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (F8, MAX_FP8_ELEMENTS, check_indexer_args, check_triton_config,
                                   is_pow2, next_pow2)

_DTYPES = ("float8_e4m3fn", "bfloat16", "float16", "float32")



@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  """Launch knobs of one call; the field names are the jit entry's keyword arguments."""
  block_n: int  # positions per product (short spans take the next power of two >= 16)
  chunk: int  # positions per program
  num_warps: int
  num_stages: int

  def __post_init__(self):
    check_triton_config(self, ("block_n", "chunk"))
    if self.block_n > self.chunk:
      raise ValueError(f"block_n ({self.block_n}) must not exceed chunk ({self.chunk})")


# The chosen config: 128-key products keep the scores at 64 registers a thread for H=64 on 4 warps
# (no spills); the H200 sweep behind it: benchmarks/RESULTS.md, "DSA kernels (pallas_triton)".
DEFAULT = IndexerConfig(128, 2048, 4, 2)  # T=2048 over 32K: 282 TFLOP/s
# The sweep space: the variants `benchmarks/bench_sparse.py --sweep` times.
SWEEP = tuple(IndexerConfig(*v) for v in [
    (128, 2048, 4, 2), (128, 2048, 4, 1), (128, 2048, 4, 3), (128, 2048, 8, 2), (64, 2048, 4, 2),
    (128, 4096, 4, 2), (128, 1024, 4, 2), (256, 2048, 8, 2)])


def _kernel(q_ref, w_ref, k_ref, ks_ref, bt_ref, len_ref, o_ref, *, block_n, page, dot_dtype):
  # q_ref [H, D]; w_ref [H] f32; k_ref [num_blocks * page, D]; ks_ref [num_blocks * page] f32;
  # bt_ref [T, max_blocks] int32; len_ref [T] int32; o_ref [chunk] f32 (this program's positions)
  t, c = pl.program_id(0), pl.program_id(1)
  chunk = o_ref.shape[0]
  num_slots, d = k_ref.shape
  max_blocks = bt_ref.shape[1]
  num_blocks = num_slots // page
  start = c * chunk
  length = jnp.clip(len_ref[t], 0, max_blocks * page)
  num_steps = jnp.clip(pl.cdiv(length - start, block_n), 0, chunk // block_n)
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  q = q_ref[...].astype(dot_dtype)
  w = w_ref[...]

  def step(i, carry):
    pos = start + i * block_n + jnp.arange(block_n, dtype=jnp.int32)
    # pos // page is below max_blocks for every in-window position; the clamp covers the rest.
    block = plgpu.load(bt_ref.at[t, jnp.minimum(pos // page, max_blocks - 1)])
    valid = (pos < length) & (block >= 0) & (block < num_blocks)
    row = jnp.where(valid, block * page + pos % page, 0)
    k = plgpu.load(k_ref.at[row[:, None], jnp.arange(d, dtype=jnp.int32)[None, :]],
                   mask=jnp.broadcast_to(valid[:, None], (block_n, d)), other=0.0)
    k_scale = plgpu.load(ks_ref.at[row], mask=valid, other=0.0)
    # XLA:CPU multiplies e4m3 x e4m3 too, so interpret mode runs this very product.
    s = plgpu.dot(q, k.astype(dot_dtype), trans_b=True, precision=precision)  # [H, block_n] f32
    logits = (w[:, None] * jnp.maximum(s * k_scale[None, :], 0.0)).sum(axis=0)
    o_ref[pl.ds(i * block_n, block_n)] = jnp.where(valid, logits, -jnp.inf)
    return carry

  def fill(i, carry):
    o_ref[pl.ds(i * block_n, block_n)] = jnp.full((block_n,), -jnp.inf, jnp.float32)
    return carry

  lax.fori_loop(0, num_steps, step, 0)
  lax.fori_loop(num_steps, chunk // block_n, fill, 0)



@functools.partial(jax.jit, static_argnames=("block_n", "chunk", "num_warps", "num_stages",
                                             "widen_fp8", "interpret"))
def indexer_logits(q: jax.Array, weights: jax.Array, k_values: jax.Array, k_scales: jax.Array,
                   block_tables: jax.Array, seq_lens: jax.Array, *, block_n: int | None = None,
                   chunk: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, widen_fp8: bool = False,
                   interpret: bool = False) -> jax.Array:
  """Indexer logits over a paged K cache (semantics of `mla_jax.reference.indexer_logits`).

  q [T, H, D] e4m3 or bf16/f16/f32 (fp8 q scales belong in `weights`); weights [T, H] float32;
  k_values [NB, BS, D] e4m3 or bf16/f16/f32; k_scales [NB, BS] float32 (per-token dequant scale);
  block_tables [T, MB] int32 (the row's request's table); seq_lens [T] int32 (row t sees positions
  s < seq_lens[t]). D must be a power of two >= 16; any H (padded with zero weights to a power of
  two >= 16). block_n (positions per product) and chunk (positions per program) are powers of two,
  block_n <= chunk. widen_fp8: multiply e4m3 q and keys as bf16 (see the module docstring).
  Returns logits [T, MB*BS] float32, -inf outside the window and on -1 blocks.
  """
  check_indexer_args(q, weights, k_values, k_scales, block_tables, seq_lens)
  t, h, d = q.shape
  nb, page, _ = k_values.shape
  if not (is_pow2(d) and d >= 16):
    raise ValueError(f"head dim must be a power of two >= 16 (Triton blocks), got {d}")
  if q.dtype.name not in _DTYPES or k_values.dtype.name not in _DTYPES:
    raise ValueError(f"q and k_values must be one of {_DTYPES}; got {q.dtype.name} and "
                     f"{k_values.dtype.name}")
  if k_values.dtype == F8 and k_values.size > MAX_FP8_ELEMENTS:
    raise ValueError(f"an fp8 K cache of {k_values.size} elements is over the {MAX_FP8_ELEMENTS} "
                     "that int32 offsets reach (Pallas-Triton lowering)")
  for name, v in (("block_n", block_n), ("chunk", chunk)):
    if v is not None and not (is_pow2(v) and v >= 16):
      raise ValueError(f"{name} must be a power of two >= 16, got {v}")
  span = block_tables.shape[1] * page
  block_n = block_n or min(DEFAULT.block_n, max(16, next_pow2(span)))
  chunk = chunk or max(block_n, min(DEFAULT.chunk, next_pow2(span)))
  if block_n > chunk:
    raise ValueError(f"block_n ({block_n}) must not exceed chunk ({chunk})")
  if t == 0 or span == 0:  # Triton cannot take a zero-sized grid
    return jnp.full((t, span), -jnp.inf, jnp.float32)

  if q.dtype == F8 and k_values.dtype == F8 and not widen_fp8:
    dot_dtype = F8
  else:  # widen fp8 (exactly) to the other side's type
    widen = lambda x: jnp.bfloat16 if x == F8 else x
    dot_dtype = jnp.promote_types(widen(q.dtype), widen(k_values.dtype))
  # Zero q rows and weights for the padded heads: relu(0) * 0 adds nothing.
  hp = max(16, next_pow2(h))
  if hp != h:
    q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
    weights = jnp.pad(weights, ((0, 0), (0, hp - h)))
  num_chunks = pl.cdiv(span, chunk)
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, c: (0,) * x.ndim)
  k_flat, ks_flat = k_values.reshape(nb * page, d), k_scales.reshape(nb * page)
  kernel = functools.partial(_kernel, block_n=block_n, page=page, dot_dtype=dot_dtype)
  # Rows vary fastest: the rows of one request (prefill) read the same keys together, from L2.
  logits = pl.pallas_call(
      kernel,
      grid=(t, num_chunks),
      in_specs=[pl.BlockSpec((None, hp, d), lambda i, c: (i, 0, 0)),
                pl.BlockSpec((None, hp), lambda i, c: (i, 0)),
                whole(k_flat), whole(ks_flat), whole(block_tables), whole(seq_lens)],
      out_specs=pl.BlockSpec((None, chunk), lambda i, c: (i, c)),
      out_shape=jax.ShapeDtypeStruct((t, num_chunks * chunk), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps or DEFAULT.num_warps,
                                           num_stages=num_stages or DEFAULT.num_stages),
      interpret=interpret,
      name=f"indexer_logits_n{block_n}_c{chunk}",
  )(q, weights, k_flat, ks_flat, block_tables, seq_lens)
  return logits[:, :span]
