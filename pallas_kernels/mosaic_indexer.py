"""V3.2 lightning-indexer logits for Hopper GPUs, in Pallas lowered through Mosaic GPU (fp8 wgmma).

The contract of `pallas_kernels.indexer.indexer_logits` (the Pallas-Triton kernel):
`I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * k_scale[s])` over the paged indexer K cache, -inf
outside row t's window and on -1 / out-of-range pages; here for e4m3 q [T, <=64, 128] and e4m3 keys
in pages of a multiple of 64 tokens. The per-token K scales must be >= 0 (they are dequant scales:
ue8m0 powers of two), so that relu(x * scale) = scale * relu(x) and the scale is applied once per
key after the sum over heads.

One program (CTA) per (group of `rows` rows, chunk of positions), `compute_wgs` + 1 warpgroups:
- memory (the last): one bulk copy of the group's queries ([rows * 64, 128] e4m3) and weights,
  then the chunk's keys block_k positions a step: per 64-position tile the page read from the
  table, one bulk copy of its values and one of its scales, into a ring of `stages` slots;
- compute, in two pairs taking alternate steps (slot s always goes to pair s % 2): the transposed
  score tile S^T = K Q^T on the tensor cores (fp8 wgmma, float32 accumulation, M = block_k keys,
  N = 64 heads a row, K = 128), so that the weighted sum over heads is a per-row reduction of the
  accumulator; relu, the weights (a column broadcast), the sum, the key scales, the masks; the
  [rows, block_k] result is staged in shared memory and bulk-copied out. With compute_wgs=2 a
  "pair" is one warpgroup taking all the group's rows (N = rows * 64); with compute_wgs=4 its two
  warpgroups split them (N = rows * 32 each, half the accumulator and epilogue), so four
  independent chains of product -> epilogue share the SM instead of two (what DeepGEMM's fp8 MQA
  logits kernel does with its four math warpgroups).
The pairs are meant to overlap one's epilogue with the other's product; forcing strict turns
through barriers measured no faster (H200: 0.99x; benchmarks/RESULTS.md, "DSA selection", v4
timed), so nothing orders them.

The rows of a group share the keys they read, so they must share a block table: `rows=4` (N = 256)
suits one request's prefill rows, `rows=1` (N = 64, block_k = 256) decode rows of distinct
requests. With rows=None the wrapper checks (on the device, no host sync) whether every group of 4
consecutive rows has one table and runs the matching variant under `lax.cond`. Callers who know
their rows are distinct requests pass rows=1 (the backend's `distinct_tables=True`): the check and
the cond cost ~12-26 us a call on the H200 (the 128-row decode step at 32K, bench_sparse.py
--parts step: 0.426-0.445 -> 0.410-0.418 ms; session 19). The two kernels sum in different
orders: their logits agree to float32 rounding, not bit for bit.

Steps past the group's longest window are not fetched or computed, only written with -inf.

`interpret=True` (or an `InterpretGPUParams`) runs the same kernel on the CPU through Mosaic GPU's
interpreter (see `pallas_kernels.mosaic_decode` for what it does and does not simulate); lowering
for CUDA, which also runs on a CPU, checks wgmma operand layouts, bulk-copy boxes and shared memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (F8, check_at_least, check_indexer_args, check_pow2, feed_ring,
                                   is_pow2, next_pow2, swizzled)

HEADS = 64  # heads per row a group's product holds (fewer are padded with zero weights)
HEAD_DIM = 128  # one 128-byte swizzle row of e4m3: the K of every wgmma
PAGE_MULTIPLE = 64  # positions per bulk copy; pages hold whole tiles
_TILE = 64
_PAIRS = 2  # the compute warpgroups take alternate steps in this many pairs
# (compute, memory) registers a thread by compute warpgroups: compute_wgs x compute + memory fills
# the file the launch gives the block's (compute_wgs + 1) x 128 threads (168 or 96 a thread).
_REGS = {2: (232, 40), 4: (112, 32)}
_GROUP_ROWS = 4  # rows per group when they share tables


@dataclasses.dataclass(frozen=True)
class MosaicIndexerConfig:
  """Launch knobs of one variant; all but block_k are the jit entry's keyword overrides."""
  block_k: int  # positions per step; block_k * rows = 256 keeps the accumulator at 128 registers
  chunk: int  # positions per program
  stages: int  # slots in the key ring, even: slot s is always consumed by pair s % 2
  compute_wgs: int = 2  # 2: a warpgroup a step; 4: two a step, each over half the rows

  def __post_init__(self):
    check_pow2("block_k", self.block_k, _TILE)
    check_pow2("chunk", self.chunk, max(256, self.block_k))
    check_at_least("stages", self.stages, 2)
    if self.stages % 2:
      raise ValueError(f"stages must be even, got {self.stages}")
    if self.compute_wgs not in _REGS:
      raise ValueError(f"compute_wgs must be one of {sorted(_REGS)}, got {self.compute_wgs}")


_C = MosaicIndexerConfig
# The chosen config per rows (rows of a program); the H200 sweeps behind them:
# benchmarks/RESULTS.md, "DSA selection (pallas_mosaic indexer logits; top-k theta per row)".
TUNING = {
    # T=2048 over 32K: four product -> epilogue chains a CTA (v5: 1.22 ms = 875 TFLOP/s against
    # two warpgroups' 1.49-1.53); chunk 4096 by 5% over 2048, 8 ring slots slower.
    4: _C(64, 4096, 4, compute_wgs=4),
    1: _C(256, 4096, 6),  # T=128 over 128K streams keys: the deepest ring that fits, 4.06 TB/s
}
# The sweep space, (rows, config): the variants `benchmarks/bench_sparse.py --sweep` times.
SWEEP = (
    *((4, _C(64, c, s)) for c, s in [(2048, 4), (4096, 4), (2048, 2), (2048, 8), (4096, 8)]),
    # Four compute warpgroups (rows split in halves): benchmarks/RESULTS.md, "DSA selection", v5.
    *((4, _C(64, c, s, compute_wgs=4)) for c, s in [(2048, 4), (4096, 4), (2048, 8)]),
    *((1, _C(256, 4096, s)) for s in (4, 2, 6)),
)


def _kernel(q_ref, w_ref, k_ref, ks_ref, bt_ref, len_ref, o_ref, q_smem, w_smem, k_smem, ks_smem,
            o_smem, q_bar, ready, consumed, *, rows, block_k, chunk, stages, compute_wgs):
  # GMEM: q_ref [Tp * 64, 128] e4m3 (row t's heads at t * 64); w_ref [Tp, 64] f32; k_ref
  # [num_blocks, page, 128] e4m3; ks_ref [num_blocks, page] f32; bt_ref [Tp, max_blocks] int32;
  # len_ref [Tp] int32; o_ref [Tp, width] f32. SMEM: q_smem [split, wr * 64, 128] e4m3 (each
  # warpgroup of a pair reads its part); w_smem [rows, 64] f32; k_smem [stages, block_k, 128] e4m3;
  # ks_smem [stages, block_k] f32; o_smem [compute_wgs, 2, wr, block_k] f32 (each warpgroup's
  # output staging, double-buffered). Barriers: q_bar (queries and weights landed); ready [stages]
  # (slot landed); consumed [stages] (both warpgroups of its pair are done).
  g, c = lax.axis_index("groups"), lax.axis_index("chunks")
  wg = lax.axis_index("wg")
  split = compute_wgs // _PAIRS  # warpgroups sharing a step
  wr = rows // split  # rows a compute warpgroup takes
  pair, half = lax.div(wg, split), lax.rem(wg, split)  # half: which wr rows of the group
  t0 = g * rows
  num_blocks, page, _ = k_ref.shape
  max_blocks = bt_ref.shape[1]
  tiles = block_k // _TILE
  start = c * chunk
  row_len = lambda r: jnp.clip(len_ref[t0 + r], 0, max_blocks * page)
  lens = [row_len(j) for j in range(rows)]
  longest = functools.reduce(jnp.maximum, lens)
  total = chunk // block_k
  # Steps with a position some row of the group sees; every warpgroup derives the same count.
  n = jnp.clip(lax.div(longest - start + (block_k - 1), block_k), 0, total)

  def tile_source(i, tile):
    """(page, first position in it, whether the page is readable) of step i's tile."""
    pos = start + i * block_k + tile * _TILE
    block = bt_ref[t0, jnp.minimum(lax.div(pos, page), max_blocks - 1)]
    ok = (block >= 0) & (block < num_blocks)
    return jnp.where(ok, block, 0), lax.rem(pos, page), ok

  compute_regs, memory_regs = _REGS[compute_wgs]

  @pl.when(wg < compute_wgs)
  def _compute():
    plgpu.set_max_registers(compute_regs, action="increase")
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    mine = [row_len(half * wr + j) for j in range(wr)]  # this warpgroup's rows

    @pl.when(n > pair)
    def _():
      plgpu.barrier_wait(q_bar)

    def step(k, carry):
      i = k * _PAIRS + pair
      slot, buf = lax.rem(i, stages), lax.rem(k, 2)
      pos0 = start + i * block_k
      out = o_smem.at[wg, buf]  # [wr, block_k]
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # buf's previous copy has read it

      @pl.when(i < n)
      def _():
        # The table reads (global memory) are issued before the wait, which hides their latency.
        key = plgpu.broadcasted_iota(jnp.int32, (block_k,), 0, layout=row_layout)
        readable = None
        for tile in range(tiles):
          ok = tile_source(i, tile)[2]
          in_tile = (key >= tile * _TILE) & (key < (tile + 1) * _TILE) & ok
          readable = in_tile if readable is None else readable | in_tile
        plgpu.barrier_wait(ready.at[slot])

        def scores(acc_ref):  # acc_ref [block_k keys, wr * 64 heads] f32
          plgpu.wgmma(acc_ref, k_smem.at[slot], q_smem.at[half].transpose((1, 0)))
          return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((block_k, wr * HEADS), jnp.float32))
        scale = plgpu.load(ks_smem.at[slot], layout=row_layout)
        plgpu.barrier_arrive(consumed.at[slot])
        for j in range(wr):
          w = plgpu.load(w_smem.at[half * wr + j], layout=col_layout)
          part = s[:, j * HEADS:(j + 1) * HEADS]
          logit = (jnp.maximum(part, 0.0) * lax.broadcast_in_dim(w, part.shape, [1])).sum(axis=1)
          out[j] = jnp.where(readable & (pos0 + key < mine[j]), logit * scale, -jnp.inf)

      @pl.when(i >= n)
      def _():
        for j in range(wr):
          out[j] = plgpu.layout_cast(jnp.full((block_k,), -jnp.inf, jnp.float32), row_layout)

      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out, o_ref.at[pl.ds(t0 + half * wr, wr), pl.ds(pos0, block_k)])
      return carry

    lax.fori_loop(0, lax.div(total - pair + (_PAIRS - 1), _PAIRS), step, 0)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == compute_wgs)
  def _memory():
    plgpu.set_max_registers(memory_regs, action="decrease")

    @pl.when(n > 0)
    def _():
      for h in range(split):
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds((t0 + h * wr) * HEADS, wr * HEADS)], q_smem.at[h],
                                q_bar)
      plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(t0, rows)], w_smem, q_bar)

    def fetch(i, slot):
      for tile in range(tiles):
        block, offset, _ = tile_source(i, tile)
        rows_in = pl.ds(tile * _TILE, _TILE)
        plgpu.copy_gmem_to_smem(k_ref.at[block, pl.ds(offset, _TILE)], k_smem.at[slot, rows_in],
                                ready.at[slot])
        plgpu.copy_gmem_to_smem(ks_ref.at[block, pl.ds(offset, _TILE)], ks_smem.at[slot, rows_in],
                                ready.at[slot])

    feed_ring(n, stages, consumed, fetch)


def fits(q: jax.Array, k_values: jax.Array) -> bool:
  """Whether the kernel takes these operands (the others go to the Pallas-Triton kernel)."""
  return (q.ndim == 3 and k_values.ndim == 3 and q.dtype == F8 and k_values.dtype == F8
          and q.shape[1] <= HEADS and q.shape[2] == HEAD_DIM == k_values.shape[2]
          and k_values.shape[1] % PAGE_MULTIPLE == 0)


def _check(q, weights, k_values, k_scales, block_tables, seq_lens, rows, chunk, stages,
           compute_wgs):
  check_indexer_args(q, weights, k_values, k_scales, block_tables, seq_lens)
  if q.dtype != F8 or k_values.dtype != F8:
    raise ValueError(f"q and k_values must be float8_e4m3fn (fp8 wgmma), got {q.dtype.name} and "
                     f"{k_values.dtype.name}")
  if q.shape[1] > HEADS or q.shape[2] != HEAD_DIM:
    raise ValueError(f"want at most {HEADS} heads of {HEAD_DIM} dims, got {q.shape[1]} x "
                     f"{q.shape[2]}")
  if k_values.shape[1] % PAGE_MULTIPLE:
    raise ValueError(f"page size must be a multiple of {PAGE_MULTIPLE} (the bulk-copy tile), got "
                     f"{k_values.shape[1]}")
  if rows is not None and rows not in TUNING:
    raise ValueError(f"rows must be one of {sorted(TUNING)} or None, got {rows}")
  if chunk is not None and not (is_pow2(chunk) and chunk >= 256):
    raise ValueError(f"chunk must be a power of two >= 256, got {chunk}")
  if stages is not None and not (stages >= 2 and stages % 2 == 0):
    raise ValueError(f"stages must be even and >= 2, got {stages}")
  if compute_wgs is not None and compute_wgs not in _REGS:
    raise ValueError(f"compute_wgs must be one of {sorted(_REGS)} or None, got {compute_wgs}")
  if compute_wgs not in (None, 2) and rows != _GROUP_ROWS:
    # Two warpgroups a step split the group's rows; rows=None may pick one-row programs.
    raise ValueError(f"compute_wgs={compute_wgs} needs rows={_GROUP_ROWS}, got {rows}")


def _call(q, weights, k_values, k_scales, block_tables, seq_lens, *, rows, chunk, stages,
          compute_wgs, interpret):
  """The kernel over rows padded to a multiple of `rows` -> logits [Tp, width] f32."""
  t = q.shape[0]
  nb, page, d = k_values.shape
  span = block_tables.shape[1] * page
  tuned = TUNING[rows]
  block_k, stages = tuned.block_k, stages or tuned.stages
  compute_wgs = compute_wgs or tuned.compute_wgs
  split = compute_wgs // _PAIRS
  chunk = max(block_k, min(chunk or tuned.chunk, next_pow2(span)))
  width = pl.cdiv(span, chunk) * chunk
  tp = pl.cdiv(t, rows) * rows
  if tp != t:  # padded rows see nothing; their table repeats the last row's (groups share one)
    pad = tp - t
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    weights = jnp.pad(weights, ((0, pad), (0, 0)))
    block_tables = jnp.concatenate([block_tables, jnp.repeat(block_tables[-1:], pad, 0)])
    seq_lens = jnp.pad(seq_lens, (0, pad))
  kernel = functools.partial(_kernel, rows=rows, block_k=block_k, chunk=chunk, stages=stages,
                             compute_wgs=compute_wgs)
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((tp, width), jnp.float32),
      scratch_types=(
          swizzled((split, rows // split * HEADS, d), F8),
          plgpu.SMEM((rows, HEADS), jnp.float32),
          swizzled((stages, block_k, d), F8),
          plgpu.SMEM((stages, block_k), jnp.float32),
          plgpu.SMEM((compute_wgs, 2, rows // split, block_k), jnp.float32),
          plgpu.Barrier(num_arrivals=split + 1),
          plgpu.Barrier(num_arrivals=2 * (block_k // _TILE), num_barriers=stages),
          plgpu.Barrier(num_arrivals=split, num_barriers=stages),
      ),
      # Chunks launch fastest (the grid's last axis is CUDA's x): a wave reads a request's keys for
      # a few groups, and the next groups find them in L2 (131072 keys are 17 MB).
      grid=(tp // rows, width // chunk),
      grid_names=("groups", "chunks"),
      num_threads=compute_wgs + 1,
      thread_name="wg",
      # Row reductions of the WGMMA layout stay within a warp (shuffles): no cross-warp scratch.
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
      interpret=interpret or None,
      kernel_name=(f"mosaic_indexer_logits_r{rows}_c{chunk}_s{stages}"
                   + ("" if compute_wgs == 2 else f"_w{compute_wgs}")),
  )(q.reshape(tp * HEADS, d), weights, k_values, k_scales, block_tables, seq_lens)


def groups_share_tables(block_tables: jax.Array, rows: int = _GROUP_ROWS) -> jax.Array:
  """Traced bool: every group of `rows` consecutive rows (the last one padded with its last row)
  has one block table."""
  t = block_tables.shape[0]
  tp = pl.cdiv(t, rows) * rows
  padded = jnp.concatenate([block_tables, jnp.repeat(block_tables[-1:], tp - t, 0)])
  groups = padded.reshape(tp // rows, rows, -1)
  return jnp.all(groups == groups[:, :1])


@functools.partial(jax.jit, static_argnames=("rows", "chunk", "stages", "compute_wgs",
                                             "interpret"))
def indexer_logits(q: jax.Array, weights: jax.Array, k_values: jax.Array, k_scales: jax.Array,
                   block_tables: jax.Array, seq_lens: jax.Array, *, rows: int | None = None,
                   chunk: int | None = None, stages: int | None = None,
                   compute_wgs: int | None = None,
                   interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
  """Indexer logits over a paged fp8 K cache (semantics of `mla_jax.reference.indexer_logits`).

  q [T, H, 128] e4m3 with H <= 64 (fp8 q scales belong in `weights`); weights [T, H] float32;
  k_values [NB, BS, 128] e4m3, BS a multiple of 64; k_scales [NB, BS] float32, >= 0 (per-token
  dequant scale); block_tables [T, MB] int32 (the row's request's table); seq_lens [T] int32 (row t
  sees positions s < seq_lens[t]). rows: rows per program (4: groups of 4 rows must share a table;
  1: any tables; None: 4 where every group shares one, else 1, decided on the device). chunk:
  positions per program, a power of two >= 256. stages: slots in the key ring, even and >= 2.
  compute_wgs: 2 or 4 compute warpgroups (4: two a step, each over 2 of the 4 rows; rows=4 only).
  interpret: True or a `plgpu.InterpretGPUParams` runs Mosaic GPU's CPU interpreter. Returns
  logits [T, MB*BS] float32, -inf outside the window and on -1 / out-of-range blocks.
  """
  _check(q, weights, k_values, k_scales, block_tables, seq_lens, rows, chunk, stages,
         compute_wgs)
  t, h, _ = q.shape
  span = block_tables.shape[1] * k_values.shape[1]
  if t == 0 or span == 0:
    return jnp.full((t, span), -jnp.inf, jnp.float32)
  if h != HEADS:  # zero q rows and weights: relu(0) * 0 adds nothing
    q = jnp.pad(q, ((0, 0), (0, HEADS - h), (0, 0)))
    weights = jnp.pad(weights, ((0, 0), (0, HEADS - h)))
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  run = lambda r: _call(q, weights, k_values, k_scales, block_tables, seq_lens, rows=r, chunk=chunk,
                        stages=stages, compute_wgs=compute_wgs, interpret=interpret)[:t, :span]
  if rows is not None:
    return run(rows)
  if t < _GROUP_ROWS:
    return run(1)
  return lax.cond(groups_share_tables(block_tables), lambda: run(_GROUP_ROWS), lambda: run(1))
