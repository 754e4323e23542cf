"""DSA sparse attention for Hopper GPUs, in Pallas lowered through Mosaic GPU.

The contract and semantics of `pallas_kernels.sparse_attention` (the Pallas-Triton kernel): every
head of a token attends to the cache rows its top-k slots name; -1 and out-of-range slots are
skipped and never read; a row with no valid slot gives o = 0, lse = -inf. bfloat16 q, and either a
bf16 latent cache or an fp8_ds_mla cache (e4m3 NoPE + one float32 scale per 128-column tile + bf16
RoPE). The structure is `mosaic_decode`'s, with per-token slot lists instead of pages: one program
(CTA) per (64-head tile, split, token) gathers each selected row once for all 64 heads, with three
warpgroups:
- memory (warpgroup 2): the token's query tile, then per step of 64 slots their indices (a ring
  of 4 steps, fetched two steps ahead) and the 64 rows they name (`gather_step`, for both
  caches). Hopper has no gather copy; on the GPU rows are gathered warp-cooperatively
  (`gather="cp_async"`, `_cp_async_rows`): each of the 128 lanes issues 16-byte `cp.async` copies
  into the swizzled tiles (a bf16 row is 9 chunks of 128 bytes, 4608 copies a step; an
  fp8_ds_mla row 4 e4m3 chunks + 1 bf16 RoPE chunk, 2560). The other gather (`"bulk"`, and every
  row in the interpreter) is one bulk copy per row and 128-byte chunk (the widest box the
  128-byte swizzle that wgmma reads allows); issued by one thread, 576 a bf16 step, it measured
  2.2-2.6x slower. Invalid slots become the row index past the cache: both gathers read nothing
  there and fill zeros, so their P V terms are 0 * 0, never 0 * NaN.
  fp8_ds_mla: the rows land in a staging buffer (e4m3 NoPE, bf16 RoPE, the step's tile scales,
  gathered by XLA beforehand, or with prep_in_kernel by this warpgroup, 16 bytes a row); this
  warpgroup widens them into the bf16 tile the consumers read (e4m3 times a power-of-two scale is
  exact in bf16; with wide_widening in lane-level code, `_wide_widen` and
  `_wide_widen_in_place`, the latter starting on a step's first NoPE tiles while the rest land,
  `landing_groups`), then fetches the next step.
- scores (warpgroup 0): S = Q K^T (wgmma, M = 64 heads, N = 64 rows, K = 576 in 9 chunks), the
  masked float32 online softmax, P and the rescale factors to warpgroup 1, O[:, :L/2] += P V.
- values (warpgroup 1): O[:, L/2:] += P V.
With heads_in="n" (N <= 32, one split; by default for bf16 caches there, `default_heads_in`) a
program's heads are wgmma's N instead, and the consumers compute S^T = K Q^T and O^T = V^T P^T
(`MosaicSparseConfig`).
bf16 caches use 2 row slots (the next step's rows land while this one computes); fp8_ds_mla uses
1 bf16 slot + the staging buffer (two bf16 slots, the query tile and the staging do not fit in a
block's 227 KB), or with fp8_pipeline="half_rows" the same bytes as two 32-row slots that the
consumers step through 32 slots at a time while the other is widened, fed by a ring of 32-row
staging buffers, or with "in_place" bf16's two 64-row slots, each holding its own step's e4m3 rows
and scales until they are widened there (`MosaicSparseConfig`; by default "in_place" over many
one-split programs, else "half_rows": `default_fp8_pipeline`; there at 16 and 32 heads the kernel
of `mosaic_sparse_register_a`, which widens nothing). Splits of a token's slot
list are merged by their log-sum-exps (`merge_splits`).

Shared memory holds a row slot as 9 tiles of 64 rows x 64 columns, each in the tiled, 128-byte-
swizzled layout wgmma reads. The cp.async gather computes each 16-byte unit's swizzled address
itself. Mosaic GPU slices tiled buffers by whole 8-row tiles only, so the bulk row copies go
through an untiled, swizzled alias of the same bytes ([9 * 8, 8, 64]: tile-row, row in tile,
column): the bulk copy applies the swizzle from the destination address, which gives the same
bytes. Mosaic GPU's interpreter (jax 0.11.2) does not alias the views of a `RefUnion` (nor
simulate swizzles), so there the rows are copied into the tiled view directly, and, as in
`mosaic_decode`, each P V product goes to a fresh accumulator.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, scf

from pallas_kernels import mosaic_sparse_register_a as register_a
from pallas_kernels.common import (DS_MLA_TILE, F8, HALF_ROWS, HALF_ROWS_LAYOUT, HEADS_M_TILE,
                                   HEADS_N_TILES, HOPPER_SMEM_BYTES, LOG2E,
                                   REDUCTION_BYTES_PER_8_HEADS, RESCALE_SLACK, check_rescale_slack,
                                   check_softmax_scale, check_sparse_args, default_num_kv_splits,
                                   hand_over_p, heads_tile, in_phase, leading_rows, merge_splits,
                                   mosaic_compiler_params, one_wave_splits, padded_heads,
                                   row_broadcast, run_scores, run_values, sm_count, smem_bytes,
                                   softmax_step, step_variant, swizzled, SWIZZLE)
from pallas_kernels.mosaic_lanes import (LANE_BARRIER_WORDS, WARPGROUP_THREADS,
                                         WIDE_MAX_SCALE_BITS, cp_async_arrive, cp_async_wait,
                                         lane_asm, lane_barrier_wait, lane_barriers_init,
                                         placed_bf16x2, read_only_ref, row_steps,
                                         rows_rescaled, warpgroup_thread, wide_load, wide_store)

_TILE_H = HEADS_M_TILE  # heads per program: the M of every Hopper wgmma
_STEP = 64  # slots per step: N of S = Q K^T, K of P V
_COLS = 64  # columns per shared-memory tile: 128 bytes of bf16, the swizzle width
_VALUE_WGS = 2
_IDX_RING = 4  # steps of slot indices in shared memory: fetched 2 ahead, read until consumed
_MAX_HEAD_DIM = 576
_SMEM_LIMIT = HOPPER_SMEM_BYTES  # (a module name: tests lower it)
# (consumer, memory) registers a thread: 2 x consumer + memory <= common.register_pool(3).
# fp8_ds_mla's memory warpgroup widens tiles. (224, 64) asked for 512 and hung on the H200.
_REGS = {False: (232, 40), True: (224, 56)}


def _copy_row_chunk(src, tiled, raw, r, c, barrier):
  """Copies src [1, w] (128 bytes of one cache row) into row r of tile column c of tiled
  [tiles, rows, w] (tiled by 8 rows, 128-byte swizzled). Mosaic GPU slices tiled buffers by whole
  8-row tiles only, so on the GPU the copy goes to the same bytes through the untiled, swizzled
  alias raw [tiles * rows / 8, 8, w] (the bulk copy swizzles by destination address); raw=None
  (the interpreter, which neither aliases union members nor swizzles) copies into tiled."""
  if raw is None:
    dst = tiled.at[c, pl.ds(r, 1)]
  else:
    dst = raw.at[c * (tiled.shape[1] // 8) + lax.div(r, 8), pl.ds(lax.rem(r, 8), 1)]
  plgpu.copy_gmem_to_smem(src, dst, barrier)


_SEG = 16  # bytes a lane moves per cp.async
_SWIZZLE_ROWS = 8  # the 128-byte swizzle permutes 16-byte units by the row's place in 8 rows
_CHUNK_BYTES = 128  # a tile row: the swizzle width


def _cp_async_rows(parts, idx, *, num_slots, scales=None, groups=1):
  """Warp-cooperative gather of a step's 64 rows (or a half step's 32), issued by every lane of
  the memory warpgroup (then one `cp.async` group committed).

  parts: (src, dst) pairs, one per part of a row (bf16: the whole row; fp8_ds_mla: the e4m3 NoPE
  and the bf16 RoPE). src [S, C, w] (GMEM, C chunks of 128 bytes a row); dst [C, rows, w] in the
  tiled, 128-byte-swizzled layout (rows x 128 B a chunk); idx [rows] int32 (the rows; an index
  >= num_slots, or negative, is an invalid slot: the compare is unsigned, so raw slots' -1 too).
  Each lane copies 16 bytes at a time: 8 lanes cover one row's 128-byte chunk, a warp 4 rows, so
  each warp instruction reads 4 whole 128-byte lines; a warp takes rows / 4 rows, rows / 16 x C
  instructions a part. The destination of row r, chunk c, unit u is c * rows * 128 + r * 128 +
  (u ^ (r % 8)) * 16 (the 128-byte swizzle). An invalid row copies 0 source bytes: cp.async fills
  the 16 bytes with zeros and reads nothing.
  scales (prep_in_kernel's fp8_ds_mla): (src [S, J] f32, the cache's tile scales; dst [J, rows]
  f32, what the widening reads): rows x J 4-byte copies in the same group, J consecutive lanes
  reading one row's 4 J contiguous bytes (rows * J / 128 a lane; 0, zero-filled, for an invalid
  row).
  groups (fp8_ds_mla "in_place", `_wide_widen_in_place`): the copies in this many committed groups
  instead of one, so that the widening can start on the first while the others land: group g
  holds the first part's chunks g C / groups to (g + 1) C / groups - 1 (and the scales, g = 0),
  the last group the other parts too. One group keeps the row-by-row order.
  """
  rows = parts[0][1].shape[1]
  unit_per_row = _CHUNK_BYTES // _SEG
  rows_per_instr = 32 // unit_per_row
  arg_types = [read_only_ref()]
  chunk_counts = [dst.shape[0] for _, dst in parts]
  for src, dst in parts:
    width = _CHUNK_BYTES // jnp.dtype(dst.dtype).itemsize
    if src.shape[1:] != dst.shape[::2] or dst.shape[1:] != (rows, width):
      raise ValueError(f"want src [S, C, {width}] and dst [C, {rows}, {width}], got {src.shape} "
                       f"and {dst.shape}")
    swizzle = (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(_CHUNK_BYTES))
    arg_types += [read_only_ref(), plgpu.RefType(swizzle)]
  if chunk_counts[0] % groups:
    raise ValueError(f"groups must divide the first part's {chunk_counts[0]} chunks, got {groups}")
  if scales is not None:
    per_row = scales[0].shape[1]
    if scales[1].shape != (per_row, rows):
      raise ValueError(f"want scales src [S, J] and dst [J, {rows}], got {scales[0].shape} and "
                       f"{scales[1].shape}")
    arg_types += [read_only_ref(), plgpu.RefType()]

  @plgpu.inline_mgpu(arg_types=tuple(arg_types))
  def issue(_, rows_ref, *refs):
    i32, i64, i8 = (ir.IntegerType.get_signless(w) for w in (32, 64, 8))
    c32 = lambda v: arith.constant(i32, v)
    tid, lane, warp = warpgroup_thread()
    unit = arith.remui(lane, c32(unit_per_row))
    global_ptr = llvm.PointerType.get(address_space=1)
    if scales is not None:
      *refs, scale_src, scale_dst = refs
    bases = [(llvm.addrspacecast(global_ptr, mgpu_utils.memref_ptr(src)),
              mgpu_utils.memref_ptr(dst), chunks)
             for src, dst, chunks in zip(refs[::2], refs[1::2], chunk_counts)]
    # The (part, chunk) copies of each group.
    first_chunks = chunk_counts[0] // groups
    plan = [[(0, c) for c in range(g * first_chunks, (g + 1) * first_chunks)]
            for g in range(groups)]
    plan[-1] += [(p, c) for p in range(1, len(bases)) for c in range(chunk_counts[p])]
    row_terms = {}

    def row_term(g):
      """(row, copy size, destination offset) of this lane's row of row group g (computed at its
      first copy: with one group, the order row after row)."""
      if g not in row_terms:
        r = arith.addi(arith.muli(warp, c32(rows // 4)),
                       arith.addi(c32(g * rows_per_instr), arith.divui(lane, c32(unit_per_row))))
        row = memref.load(rows_ref, [arith.index_cast(ir.IndexType.get(), r)])
        valid = arith.cmpi(arith.CmpIPredicate.ult, row, c32(num_slots))
        swz = arith.xori(unit, arith.remui(r, c32(_SWIZZLE_ROWS)))
        row_terms[g] = (arith.select(valid, row, c32(0)), arith.select(valid, c32(_SEG), c32(0)),
                        arith.addi(arith.muli(r, c32(_CHUNK_BYTES)), arith.muli(swz, c32(_SEG))))
      return row_terms[g]

    def issue_scales():
      """The rows' tile scales (prep_in_kernel's fp8_ds_mla), in the first group."""
      if scales is not None:
        src_base = llvm.addrspacecast(global_ptr, mgpu_utils.memref_ptr(scale_src))
        dst_base = mgpu_utils.memref_ptr(scale_dst)
        total = rows * per_row
        for g in range(-(-total // WARPGROUP_THREADS)):
          e = arith.addi(tid, c32(g * WARPGROUP_THREADS))  # row e / J, tile e % J
          # Lanes past the end repeat the last copy (same bytes).
          if (g + 1) * WARPGROUP_THREADS > total:
            e = arith.minui(e, c32(total - 1))
          r, j = arith.divui(e, c32(per_row)), arith.remui(e, c32(per_row))
          row = memref.load(rows_ref, [arith.index_cast(ir.IndexType.get(), r)])
          valid = arith.cmpi(arith.CmpIPredicate.ult, row, c32(num_slots))
          row = arith.select(valid, row, c32(0))
          src_ptr = mgpu_utils.getelementptr(
              src_base, [arith.extui(i64, arith.addi(arith.muli(row, c32(per_row)), j))],
              ir.F32Type.get())
          dst_ptr = mgpu_utils.getelementptr(
              dst_base, [arith.addi(arith.muli(j, c32(rows)), r)], ir.F32Type.get())
          # 4 bytes: cp.async's .cg takes 16 only (.ca: 4, 8 or 16).
          nvvm.cp_async_shared_global(dst_ptr, src_ptr, 4, nvvm.LoadCacheModifierKind.CA,
                                      cp_size=arith.select(valid, c32(4), c32(0)))

    unit_off = arith.extui(i64, arith.muli(unit, c32(_SEG)))
    for group_index, group in enumerate(plan):
      for g in range(rows // 4 // rows_per_instr):
        row, size, dst_off = row_term(g)
        for p, c in group:
          src_base, dst_base, chunks = bases[p]
          src_off = arith.addi(
              arith.muli(arith.extui(i64, row), arith.constant(i64, chunks * _CHUNK_BYTES)),
              unit_off)
          src_ptr = mgpu_utils.getelementptr(
              src_base, [arith.addi(src_off, arith.constant(i64, c * _CHUNK_BYTES))], i8)
          dst_ptr = mgpu_utils.getelementptr(
              dst_base, [arith.addi(dst_off, c32(c * rows * _CHUNK_BYTES))], i8)
          nvvm.cp_async_shared_global(dst_ptr, src_ptr, _SEG, nvvm.LoadCacheModifierKind.CG,
                                      cp_size=size)
      if group_index == 0:
        issue_scales()
      nvvm.cp_async_commit_group()

  issue(idx, *(ref for part in parts for ref in part), *(scales or ()))


_WIDE_LOAD_GROUP = 4  # 16-byte units a lane loads before converting them


def _wide_paths(scale, units, result_types=()):
  """Emits units(convert) twice, the then and else of one branch on whether the lane's f32 scale
  takes the bit placement (`mosaic_lanes.wide_fast_scale`) or today's conversion. convert(word,
  p): the bf16x2 of bytes 2p, 2p + 1 of an i32 word (4 e4m3 values) times the scale. units
  returns the values of result_types that the branch yields (its results, returned)."""
  i32 = ir.IntegerType.get_signless(32)
  c32 = lambda v: arith.constant(i32, v)
  bits = arith.bitcast(i32, scale)
  fast = arith.andi(
      arith.cmpi(arith.CmpIPredicate.ule, arith.andi(bits, c32(0x7FFFFFFF)),
                 c32(WIDE_MAX_SCALE_BITS)),
      arith.cmpi(arith.CmpIPredicate.eq, arith.andi(bits, c32(0xFFFF)), c32(0)))

  def fast_units():
    factor = lane_asm("{ .reg .f32 m; mul.rn.f32 m, $1, 0f7B800000; mov.b32 $0, m; "
                      "prmt.b32 $0, $0, 0, 0x3232; }", "=r,r", scale)  # bf16x2 scale * 2^120
    return units(lambda word, p: placed_bf16x2(word, p, factor))

  def slow_units():
    return units(lambda word, p: lane_asm(
        "{ .reg .b16 lo, hi, a, b; .reg .b32 x; .reg .f32 f0, f1; mov.b32 {lo, hi}, $1; "
        f"cvt.rn.f16x2.e4m3x2 x, {('lo', 'hi')[p]}; mov.b32 {{a, b}}, x; "
        "cvt.f32.f16 f0, a; cvt.f32.f16 f1, b; mul.rn.f32 f0, f0, $2; "
        "mul.rn.f32 f1, f1, $2; cvt.rn.bf16x2.f32 $0, f1, f0; }", "=r,r,f", word, scale))

  branch = scf.IfOp(fast, list(result_types), has_else=True)
  for block, path in ((branch.then_block, fast_units), (branch.else_block, slow_units)):
    with ir.InsertionPoint(block):
      scf.yield_(list(path() or ()))
  return list(branch.results)


def _wide_widen(nope, scales, dst):
  """Lane-level widening of a staged half step's (32 rows) or step's (64) e4m3 NoPE tiles into
  the bf16 tiles of a row slot (wide_widening): nope [J, rows, 128] e4m3 (tiled (8, 128),
  128-byte swizzled), scales [J, rows] f32, dst [C, rows, 64] bf16 (tiled by 8 rows and the
  swizzle's width: 64 bytes for 32 rows, 128 for 64), its tiles 2j and 2j + 1 written from nope's
  tile j (times the row's scale j). Each lane takes one row r = 8 g + lane % 8 and one tile j =
  lane / 8 % 4 (g = warp, and with 64 rows warp + 4 too) and walks its 8 16-byte units: one
  16-byte load (16 e4m3 values), 8 x (prmt, shl, and, mul.bf16x2), two 16-byte stores. The 8
  lanes of a quarter warp (what one 16-byte shared access serves at a time) take the 8 rows of a
  swizzle period and the same unit: their loads and stores hit 8 distinct 16-byte bank groups
  under either swizzle. A lane whose scale `mosaic_lanes.wide_fast_scale` refuses converts as the
  Pallas-level widening does (`mosaic_lanes.wide_widening_model`)."""
  tiles, rows, _ = nope.shape
  sw = dst.shape[1] // HALF_ROWS * 64  # bytes: 64 for 32 rows (half_rows), 128 for 64
  if (rows not in (HALF_ROWS, _STEP) or nope.shape[2] != DS_MLA_TILE
      or scales.shape != (tiles, rows) or dst.shape[1:] != (rows, _COLS)
      or dst.shape[0] < 2 * tiles):
    raise ValueError(f"want nope [J, 32 or 64, 128], scales [J, rows], dst [C >= 2J, rows, 64]; "
                     f"got {nope.shape}, {scales.shape}, {dst.shape}")
  nope_t = (plgpu.TilingTransform((8, DS_MLA_TILE)), plgpu.SwizzleTransform(_CHUNK_BYTES))
  dst_t = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(nope_t), plgpu.RefType(), plgpu.RefType(dst_t)))
  def run(_, nope, scales, dst):
    i32 = ir.IntegerType.get_signless(32)
    c32 = lambda v: arith.constant(i32, v)
    tid, lane, warp = warpgroup_thread()
    l = arith.remui(lane, c32(_SWIZZLE_ROWS))  # the row in its swizzle period
    j = arith.divui(lane, c32(_SWIZZLE_ROWS))  # the e4m3 tile
    # This lane's rows r = 8 (warp + 4 m) + l, m < rows / 32: rows 32 apart lie 4096 bytes apart
    # in nope and in each dst tile, so every address is one of 8 + 8 lane terms plus a constant.
    src_lane = arith.addi(arith.muli(j, c32(rows * _CHUNK_BYTES)),
                          arith.muli(arith.addi(arith.muli(warp, c32(_SWIZZLE_ROWS)), l),
                                     c32(_CHUNK_BYTES)))
    # tile j, row r, unit u at j * rows * 128 + r * 128 + (u ^ l) * 16
    src_unit = [arith.addi(src_lane, arith.muli(arith.xori(c32(u), l), c32(16)))
                for u in range(_CHUNK_BYTES // _SEG)]
    # bf16 tile c's row r at c * rows * 128 + r * 128, 16-byte units ^ l; 64-byte swizzle: tiles
    # of 32 columns, (8-row group, column tile) 512 bytes each, rows of 64 bytes, units ^ l / 2
    dst_lane = arith.addi(arith.muli(j, c32(2 * rows * _CHUNK_BYTES)),
                          arith.addi(arith.muli(warp, c32(_SWIZZLE_ROWS * _CHUNK_BYTES)),
                                     arith.muli(l, c32(sw))))
    period = l if sw == _CHUNK_BYTES else arith.divui(l, c32(2))
    dst_unit = [arith.addi(dst_lane, arith.muli(arith.xori(c32(w), period), c32(16)))
                for w in range(sw // 16)]
    scale_row = arith.addi(arith.muli(warp, c32(_SWIZZLE_ROWS)), l)
    index = lambda x: arith.index_cast(ir.IndexType.get(), x)
    for m in range(rows // HALF_ROWS):
      group_off = m * 4 * _SWIZZLE_ROWS * _CHUNK_BYTES
      scale = memref.load(scales, [index(j), index(arith.addi(scale_row, c32(m * HALF_ROWS)))])

      def dst_offset(u, h):  # bf16 columns 16 (u % 4) + 8 h of tile 2 j + u / 4
        col = 16 * (u % 4) + 8 * h  # its 16-byte unit: 64-byte tiles hold 32 columns
        tile_off = (u // 4) * rows * _CHUNK_BYTES + (col // (sw // 2)) * (8 * sw)
        return dst_unit[(col % (sw // 2)) // 8], group_off + tile_off

      def units(convert):
        # The loads of a group first: the compilers cannot move a load above a store to the
        # same shared memory, which would expose each load's latency.
        for g in range(0, _CHUNK_BYTES // _SEG, _WIDE_LOAD_GROUP):
          group = range(g, g + _WIDE_LOAD_GROUP)
          loaded = [wide_load(nope, src_unit[u], group_off) for u in group]
          for u, words in zip(group, loaded):
            wide_store(dst, words, convert, [dst_offset(u, h) for h in range(2)])

      _wide_paths(scale, units)

  run(nope, scales, dst)


def _wide_widen_in_place(nope, scales, dst, groups):
  """wide_widening with fp8_pipeline="in_place": a step's e4m3 NoPE tiles, staged in its own row
  slot dst [C, 64, 64] bf16 (tiled (8, 64), 128-byte swizzled) as nope [J, 64, 128] e4m3 (tiled
  (8, 128), the same swizzle: its tile j is dst's tile J + j), with their scales [J, 64] f32 in
  dst's tile 0 (its first 8 rows), widened into dst's tiles 2j and 2j + 1 by `_wide_widen`'s lane
  code. All 128 lanes widen one tile after another: a lane takes row r = 8 (tid / 16) + tid % 8
  and the 4 16-byte units of its half h = tid / 8 % 2 (into bf16 tile 2j + h), and loads the
  next tile's unit after storing this tile's (a tile of loads in flight, 16 registers). Tile j's
  stores overwrite what other lanes read: the scales (j = 0; every warp's) and staged tiles
  2j - J and 2j + 1 - J (the last tile its own), whose rows only the lanes of the same warp read
  (a row's two halves lie in one warp). So every lane loads its row's scales and its units of
  tile 0 before a warpgroup barrier, and a warp barrier precedes the stores of a tile that
  overwrite a tile loaded since the last barrier (J = 4: before tiles 2 and 3). A quarter warp
  takes 8 rows of a swizzle period and one unit at a time: 8 distinct 16-byte bank groups.
  The step's rows are still landing, in `groups` cp.async groups (`_cp_async_rows`: group g holds
  tiles g J / groups to (g + 1) J / groups - 1, the first the scales, the last the RoPE rows):
  before loading a group's first tile every lane waits for that group and then for the
  warpgroup (a barrier: the other lanes' copies), so the widening of a group's tiles runs while
  the later groups land. The tiles 2j and 2j + 1 that tile j's stores fill are free meanwhile (the
  first J hold nothing, the rest staged tiles loaded before). groups=0: the rows are in for
  every lane already (gather_by="values": each lane waited on the slot's lane barrier), so no
  cp.async wait and no barrier for them."""
  tiles = nope.shape[0]
  if (nope.shape[1:] != (_STEP, DS_MLA_TILE) or scales.shape != (tiles, _STEP)
      or dst.shape[1:] != (_STEP, _COLS) or dst.shape[0] < 2 * tiles or tiles % max(groups, 1)):
    raise ValueError(f"want nope [J, 64, 128], scales [J, 64], dst [C >= 2J, 64, 64] and groups "
                     f"0 or dividing J; got {nope.shape}, {scales.shape}, {dst.shape}, {groups}")
  per_group = tiles // max(groups, 1)
  swizzle = (plgpu.SwizzleTransform(_CHUNK_BYTES),)
  nope_t = (plgpu.TilingTransform((8, DS_MLA_TILE)), *swizzle)
  dst_t = (plgpu.TilingTransform((8, _COLS)), *swizzle)
  tile_bytes = _STEP * _CHUNK_BYTES

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(nope_t), plgpu.RefType(), plgpu.RefType(dst_t)))
  def run(_, nope, scales, dst):
    i32 = ir.IntegerType.get_signless(32)
    c32 = lambda v: arith.constant(i32, v)
    tid = warpgroup_thread()[0]
    l = arith.remui(tid, c32(_SWIZZLE_ROWS))  # the row in its swizzle period
    h = arith.remui(arith.divui(tid, c32(_SWIZZLE_ROWS)), c32(2))
    row = arith.addi(arith.muli(arith.divui(tid, c32(2 * _SWIZZLE_ROWS)), c32(_SWIZZLE_ROWS)), l)
    row_off = arith.muli(row, c32(_CHUNK_BYTES))
    # Row r's 16-byte unit u at r * 128 + (u ^ l) * 16 of a tile: this lane's e4m3 units 4 h + k,
    # and bf16 units w of tile 2j + h (k's 16 values: w = 2k, 2k + 1); 16 (u ^ l) < 128, so
    # each is one lane term XOR 16 k or 16 w.
    l16 = arith.muli(l, c32(16))
    src_base = arith.addi(row_off, arith.xori(arith.muli(h, c32(64)), l16))
    dst_base = arith.addi(arith.addi(row_off, arith.muli(h, c32(tile_bytes))), l16)
    src = [arith.xori(src_base, c32(16 * k)) for k in range(4)]
    dst_unit = [arith.xori(dst_base, c32(16 * w)) for w in range(8)]
    index = lambda x: arith.index_cast(ir.IndexType.get(), x)
    load = lambda j, k: wide_load(nope, src[k], j * tile_bytes)

    def landed(j):
      """Group j / per_group's rows (and the earlier groups') in, for every lane."""
      if not groups:
        return
      nvvm.cp_async_wait_group(groups - 1 - j // per_group)
      mgpu_utils.warpgroup_barrier()

    landed(0)
    scale = [memref.load(scales, [index(c32(j)), index(row)]) for j in range(tiles)]
    words = [load(0, k) for k in range(4)]
    mgpu_utils.warpgroup_barrier()  # every warp's scales loaded: tile 0's stores overwrite them
    unguarded = set()  # tiles loaded since the last barrier
    for j in range(tiles):
      if j and j % per_group == 0:  # a group's first tile, loaded once the group is in
        landed(j)
        words = [load(j, k) for k in range(4)]
        unguarded = {j}
      if unguarded & {2 * j - tiles, 2 * j + 1 - tiles}:
        mgpu_utils.warp_barrier()
        unguarded = set()
      ahead = j + 1 < tiles and (j + 1) % per_group != 0

      def units(convert, j=j, words=words, ahead=ahead):
        loaded = []
        for k in range(4):
          wide_store(dst, words[k], convert,
                      [(dst_unit[2 * k + p], 2 * j * tile_bytes) for p in range(2)])
          if ahead:  # tile j's stores overwrite no later tile's rows
            loaded.append(load(j + 1, k))
        return loaded

      words = _wide_paths(scale[j], units, [ir.VectorType.get((4,), i32)] * (4 * ahead))
      if ahead:
        unguarded.add(j + 1)

  run(nope, scales, dst)


def _kernel(q_ref, idx_ref, *rest, scale, lora, num_splits, fp8, in_place, num_slots, gather,
            heads_n, prep_in_kernel, wide_widening, landing_groups, values_gather, hand_over_first,
            rescale_slack, interpret):
  # GMEM: q_ref [T, Np, D] bf16 (Np: heads padded to 64, or fewer unpadded, `padded_heads`: the
  # tile's first Np rows, the others never stored); idx_ref [T, Kp] int32 (slot, or num_slots
  # where invalid); steps_ref [T] int32 (steps of 64 slots up to the last valid one).
  # prep_in_kernel: idx_ref holds the raw slots (-1 padded to Kp; -1 and past the cache invalid),
  # there is no steps_ref (each warpgroup counts its row's steps from idx_ref, `own_steps`), fp8's
  # scales_ref is the cache's [S, L/128] (gathered with the rows), and with the cp_async gather
  # there is no staged barrier.
  # bf16: kv_ref [S, D/64, 64] bf16. fp8: nope_ref [S, L/128, 128] e4m3, rope_ref [S, R/64, 64]
  # bf16, scales_ref [T, Kp/64, L/128, 64] f32 (the selected rows' tile scales, a block a step).
  # o_ref [T, splits, Np, L]; lse_ref [T, splits, Np] f32.
  # SMEM: buffers = union of (q_smem [64, D], kv [slots, D/64, rows, 64]) bf16 tiled, and
  # (o_smem [2, 64, L/2], lse_smem [64]) (and on the GPU, for the bulk bf16 gather, the untiled
  # alias kv_raw [slots, D/64 * 8, 8, 64]); fp8: staging = union of (stage_nope [L/128, 64, 128]
  # e4m3 and stage_rope [R/64, 64, 64] bf16, tiled) and (on the GPU, bulk) their untiled aliases;
  # stage_scales [L/128, 64] f32; p_smem [64, rows] bf16; row_smem [64] f32; idx_smem [4, 64]
  # int32. Barriers: q_bar; ready [slots] (a slot holds its rows); consumed [slots]; p_ready,
  # p_free (the P hand-off); idx_bar [4]; fp8: staged (the scales, and with the bulk gather the
  # rows, landed in the staging buffer).
  # rows (the consumers' step): 64, or with fp8_pipeline="half_rows" 32 in 2 slots, 64-byte
  # swizzled (query, slots and P); its staging is then a ring of fp8_stage_halves buffers of 32
  # rows (a leading [S] on stage_nope, stage_rope, stage_scales and staged).
  # fp8_pipeline="in_place": 2 slots of 64 rows, no staging buffers: buffers has two more union
  # members, aliases of the row slots past a query-sized pad: slot_nope [2, D/64, 64, 128] e4m3
  # tiled and swizzled (a step's e4m3 NoPE rows land in tiles L/128 to L/64 - 1 of its slot) and
  # slot_scales [2, D/64, 32, 64] f32 (its tile scales in tile 0); the RoPE rows land in the
  # slot's RoPE tiles; staged [2].
  if not prep_in_kernel:
    steps_ref, *rest = rest
  elif fp8 and gather == "cp_async":
    rest = (*rest, None)  # no staged barrier: the rows' cp.async groups carry the tile scales
  if in_place:
    (nope_ref, rope_ref, scales_ref, o_ref, lse_ref, buffers, p_smem, row_smem, idx_smem, q_bar,
     ready, consumed, p_ready, p_free, idx_bar, staged) = rest
    kv_ref = None
  elif fp8:
    (nope_ref, rope_ref, scales_ref, o_ref, lse_ref, buffers, staging, stage_scales, p_smem,
     row_smem, idx_smem, q_bar, ready, consumed, p_ready, p_free, idx_bar, staged) = rest
    kv_ref = None
    (stage_nope, stage_rope), *raw = staging
    nope_raw, rope_raw = raw[0] if raw else (None, None)
  else:
    (kv_ref, o_ref, lse_ref, buffers, p_smem, row_smem, idx_smem, q_bar, ready, consumed, p_ready,
     p_free, idx_bar) = rest
  (q_smem, kv), (o_smem, lse_smem), *raw = buffers
  # heads_in="n": the program's tile_h (16 or 32) heads are wgmma's N: S^T = K Q^T [64 slots,
  # heads], its softmax over axis 0 (l as [rows, heads] partial sums), P^T stored transposed into
  # p_smem [heads, 64] (so that it reads as the K-major B operand P^T), and O^T = V^T P^T
  # [64 columns, heads] a value tile.
  # Else the 64 heads are wgmma's M: S = Q K^T, O = P V.
  heads_axis = 1 if heads_n else 0
  tile_h = q_smem.shape[0]
  if values_gather:
    # The two slots' lane barriers (their rows landed) in row_smem's slack (8-byte aligned).
    landed = row_smem.at[pl.ds(tile_h, 2 * LANE_BARRIER_WORDS)]
    row_smem = row_smem.at[pl.ds(0, tile_h)]
    lane_barriers_init(landed, WARPGROUP_THREADS)
    landed_at = lambda slot: landed.at[pl.ds(slot * LANE_BARRIER_WORDS, LANE_BARRIER_WORDS)]
  head_broadcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [heads_axis])
  if in_place:
    (_, slot_nope), (_, slot_scales) = raw
  kv_raw = raw[0][1] if raw and not in_place else None
  h, split, t = lax.axis_index("heads"), lax.axis_index("splits"), lax.axis_index("tokens")
  wg = lax.axis_index("wg")
  slots, chunks, step_rows = kv.shape[:3]
  pieces = _STEP // step_rows  # consumer steps a step of 64 slots
  value_chunks = lora // _COLS // _VALUE_WGS  # tiles of value columns per consumer warpgroup
  half = lora // _VALUE_WGS
  qk_scale = scale * LOG2E
  # The lane-level skip of rows whose maximum kept (rescale_slack); the interpreter runs no
  # lane-level code and multiplies every step (by 1 where skipped).
  lazy_rescale = rescale_slack is not None and not interpret

  def split_steps(num_steps):
    """(first step, steps) of this program's split of a row of num_steps steps."""
    per_split = lax.div(num_steps + (num_splits - 1), num_splits)
    first = split * per_split
    return first, jnp.maximum(jnp.minimum(first + per_split, num_steps) - first, 0)

  def consumer_steps_of(n):
    """Consumer steps of n steps of 64 slots (the 64-slot steps when pieces is 1, traced as they
    were)."""
    return n if pieces == 1 else n * pieces

  if prep_in_kernel:
    # Each warpgroup counts its row's steps in its own branch (`own_steps`): a count taken here
    # would stay live through the other warpgroups' code (the branches are consecutive ifs), and
    # ptxas then spills in their step loops (fp8_ds_mla; RESULTS, sparse v14).
    first = n = consumer_steps = None
  else:
    first, n = split_steps(jnp.maximum(steps_ref[t], 0))
    consumer_steps = consumer_steps_of(n)

  def own_steps():
    """prep_in_kernel: this warpgroup's (first, n, consumer_steps), which the helpers below read,
    from its own count of the row (`mosaic_lanes.row_steps`: every warp reads the row and derives
    the same count, so the three warpgroups agree on every barrier phase without exchanging it)."""
    nonlocal first, n, consumer_steps
    first, n = split_steps(row_steps(idx_ref.at[t], num_slots=num_slots, step=_STEP,
                                     interpret=interpret))
    consumer_steps = consumer_steps_of(n)

  slots_layout = plgpu.Layout.WGMMA.reduce(heads_axis)  # one slot index a score row or column
  acc_shape = (_COLS, tile_h) if heads_n else (_TILE_H, _COLS)  # a value tile of O^T or O

  def zero_acc():
    return tuple(plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
                 for _ in range(value_chunks))

  def pv_operands(slot, tile, p):
    """(A, B) of the P V product over value tile `tile`: P (registers if given, else p_smem) and
    V; with heads in N, V^T (MN-major, 16-bit only) and P^T, so P always comes from p_smem."""
    if heads_n:
      return kv.at[slot, tile].transpose((1, 0)), p_smem.transpose((1, 0))
    return p_smem if p is None else p, kv.at[slot, tile]

  def accumulate_values(acc, alpha, slot, w, p=None):
    """acc * alpha + P V over warpgroup w's value tiles; P from registers when given, else p_smem.
    On the GPU the products accumulate in place; the interpreter adds fresh accumulators."""
    scaled = (tuple(part * head_broadcast(alpha, part.shape) for part in acc) if heads_n
              else rows_rescaled(acc, alpha, skip_ones=lazy_rescale))
    if not interpret:
      def product(acc_ref, c):  # acc_ref [64, 64] f32 (heads in N: [64, tile_h]), the running sum
        # The tile is sliced here: a sliced ref closed over would carry its indices as constants.
        plgpu.wgmma(acc_ref, *pv_operands(slot, w * value_chunks + c, p))

      return tuple(pl.run_state(functools.partial(product, c=c))(plgpu.ACC.init(part))
                   for c, part in enumerate(scaled))
    out = []
    for c, part in enumerate(scaled):
      def product(acc_ref, c=c):  # acc_ref [64, 64] f32 (heads in N: [64, tile_h])
        plgpu.wgmma(acc_ref, *pv_operands(slot, w * value_chunks + c, None))
        return acc_ref[...]

      out.append(part + pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32)))
    return tuple(out)

  # Fewer heads than the tile unpadded: the tile's other rows hold whatever shared memory held,
  # which every product and reduction (per row) keeps out of the stored rows.
  rows_out = pl.ds(h * tile_h, min(tile_h, q_ref.shape[1]))
  out = lambda w: dict(o_smem=o_smem.at[w],  # warpgroup w's output columns
                       o_gmem=o_ref.at[t, split, rows_out, pl.ds(w * half, half)])

  consumer_regs, memory_regs = _REGS[fp8]

  @pl.when(wg == 0)
  def _scores():
    plgpu.set_max_registers(consumer_regs, action="increase")
    if prep_in_kernel:
      own_steps()
      # Every program copies its query tile, even where its split has no step: a wait under
      # n > 0 made ptxas spill in the step loop (the default's 10 reloads a step, bf16 N=128).
      plgpu.barrier_wait(q_bar)
    else:
      @pl.when(n > 0)
      def _():
        plgpu.barrier_wait(q_bar)

    def step(i, carry):
      m, l, acc = carry
      slot = lax.rem(i, slots)
      ring = lax.rem(i if pieces == 1 else lax.div(i, pieces), _IDX_RING)
      wait_indices = functools.partial(plgpu.barrier_wait, idx_bar.at[ring])
      if pieces == 1:
        wait_indices()
      else:  # once a step of 64 slots: a warpgroup waits on each phase once
        pl.when(lax.rem(i, pieces) == 0)(wait_indices)
      in_phase("wg0_rows_wait", plgpu.barrier_wait, ready.at[slot])

      def scores(acc_ref):  # acc_ref [64 heads, rows] f32 (heads in N: S^T [rows, heads])
        q = step_variant(q_smem, i)
        for c in range(chunks):
          q_cols = q.at[:, pl.ds(c * _COLS, _COLS)]
          if heads_n:
            plgpu.wgmma(acc_ref, kv.at[slot, c], q_cols.transpose((1, 0)))
          else:
            plgpu.wgmma(acc_ref, q_cols, kv.at[slot, c].transpose((1, 0)))
        return acc_ref[...]

      s_shape = (step_rows, tile_h) if heads_n else (_TILE_H, step_rows)
      s = in_phase("wg0_scores", pl.run_scoped, scores, plgpu.ACC(s_shape, jnp.float32))
      piece = idx_smem.at[ring] if pieces == 1 else idx_smem.at[
          ring, pl.ds(lax.rem(i, pieces) * step_rows, step_rows)]
      idx = plgpu.load(piece, layout=slots_layout)
      valid = idx < num_slots
      if prep_in_kernel:  # raw slots: -1 is invalid too (XLA's idx maps it to num_slots)
        valid = valid & (idx >= 0)
      valid = lax.broadcast_in_dim(valid, s.shape, [1 - heads_axis])
      m_new, alpha, p, l = in_phase("wg0_softmax", softmax_step, jnp.where(valid, s, -jnp.inf),
                                    m, l, heads_axis, rescale_slack, scale=qk_scale)
      p16 = in_phase("wg0_hand_off", hand_over_p, i, p, alpha,
                     p_smem.transpose((1, 0)) if heads_n else p_smem, row_smem, p_ready, p_free)
      acc = in_phase("wg0_values", accumulate_values, acc, alpha, slot, 0,
                     None if interpret or heads_n else p16)
      plgpu.barrier_arrive(consumed.at[slot])
      return m_new, l, acc

    run_scores(consumer_steps, step, zero_acc(), row_smem=row_smem, p_ready=p_ready, p_free=p_free,
               **out(0), lse_smem=lse_smem, lse_gmem=lse_ref.at[t, split, rows_out],
               heads_axis=heads_axis, partial_sums=(step_rows, tile_h) if heads_n else None)

  def fetch_indices(i, start=None):
    """Step i's slot indices (of the split starting at step `start`, else `first`) into the ring."""
    ring = lax.rem(i, _IDX_RING)
    step = (first if start is None else start) + i
    plgpu.copy_gmem_to_smem(idx_ref.at[t, pl.ds(step * _STEP, _STEP)], idx_smem.at[ring],
                            idx_bar.at[ring])

  def gather_step(i, parts, barrier, half=None, scales=None, groups=1):
    """Issues step i's 64 rows (or rows 32 * half to 32 * half + 31) once its indices have landed
    (waited for here, but not again for half 1: a warpgroup waits on each phase once). parts:
    (src [S, C, w], tiled dst [C, rows, w], its untiled alias or None) per part of a row; scales
    (prep_in_kernel's fp8_ds_mla): (src [S, J] f32, dst [J, rows] f32) the rows' tile scales.
    cp_async: one committed group of the warpgroup's copies (the caller waits for it); bulk:
    every row chunk's copy (and every row's tile scale's) arrives on barrier. groups: the
    cp_async gather's groups (`_cp_async_rows`)."""
    ring = lax.rem(i, _IDX_RING)
    if half != 1 and not in_place:  # "in_place" waits for them a step earlier (indices_landed)
      plgpu.barrier_wait(idx_bar.at[ring])
    rows, first_row = (_STEP, 0) if half is None else (HALF_ROWS, half * HALF_ROWS)
    if gather == "cp_async":
      _cp_async_rows(tuple((src, dst) for src, dst, _ in parts),
                     idx_smem.at[ring, pl.ds(first_row, rows)], num_slots=num_slots,
                     scales=scales, groups=groups)
      return

    @pl.loop(0, rows)
    def _(r):
      # Raw slots (prep_in_kernel) need no mapping: a copy at row -1 reads nothing either (bulk
      # copy coordinates are signed: the box lies outside the cache and fills zeros; so does the
      # interpreter's).
      row = idx_smem[ring, first_row + r]
      for src, tiled, raw in parts:
        for c in range(tiled.shape[0]):
          _copy_row_chunk(src.at[pl.ds(row, 1), c], tiled, raw, r, c, barrier)
      if scales is not None:  # one float a copy: the interpreter's (the GPU's bulk copies take
        src, dst = scales     # 16-byte boxes; prep_in_kernel's fp8_ds_mla takes cp_async there)
        for j in range(src.shape[1]):
          plgpu.copy_gmem_to_smem(src.at[pl.ds(row, 1), j], dst.at[j, pl.ds(r, 1)], barrier)

  def scale_part(block, dst, barrier):
    """A staging fill's tile scales into dst [L/128, rows]: XLA's gathered block (a bulk copy
    arriving on barrier, issued here), or with prep_in_kernel the (src, dst) that gather_step
    gathers with the rows."""
    if prep_in_kernel:
      return scales_ref, dst
    plgpu.copy_gmem_to_smem(scales_ref.at[t, block], dst, barrier)
    return None

  def staged_barrier(k):
    """Staging fill k's barrier (None without one, as wait_staged says)."""
    return None if staged is None else staged.at[k]

  def wait_staged(barrier):
    """Waits for a staging fill's bulk copies: none with prep_in_kernel's cp_async gather (no
    barrier; the rows' cp.async group carries the scales, which the caller waits for)."""
    if barrier is not None:
      plgpu.barrier_wait(barrier)

  def stage_in_place(i, groups=1):
    """fp8_pipeline="in_place": step i's tile scales, e4m3 NoPE rows and RoPE rows into its row
    slot (free by now), in `groups` cp.async groups."""
    tiles = lora // DS_MLA_TILE
    slot = lax.rem(i, slots)
    scales = scale_part(first + i, slot_scales.at[slot, 0, pl.ds(0, tiles)],
                        staged_barrier(slot))
    gather_step(i, ((nope_ref, slot_nope.at[slot, pl.ds(tiles, tiles)], None),
                    (rope_ref, kv.at[slot, pl.ds(2 * tiles, chunks - 2 * tiles)], None)),
                staged_barrier(slot), scales=scales, groups=groups)

  def refill(k):
    """values_gather (warpgroup 1): step k's rows into slot k % 2, once its indices are in (and,
    from `run_values`, both consumers released the slot's step k - 2), each lane's copies tracked
    by the slot's lane barrier, which the memory warpgroup waits on before widening."""
    plgpu.barrier_wait(idx_bar.at[lax.rem(k, _IDX_RING)])
    in_phase("wg1_gather", stage_in_place, k)
    cp_async_arrive(landed_at(lax.rem(k, slots)))

  @pl.when(wg == 1)
  def _values():
    plgpu.set_max_registers(consumer_regs, action="increase")
    if prep_in_kernel:
      own_steps()
    run_values(consumer_steps, slots,
               lambda acc, alpha, slot: accumulate_values(acc, alpha, slot, 1),
               zero_acc(), ready=ready, consumed=consumed, row_smem=row_smem, p_ready=p_ready,
               p_free=p_free, **out(1), heads_axis=heads_axis,
               widen=refill if values_gather else None)

  @pl.when(wg == _VALUE_WGS)
  def _memory():
    plgpu.set_max_registers(memory_regs, action="decrease")

    def copy_q():
      q_rows = q_ref.at[t, rows_out]
      plgpu.copy_gmem_to_smem(q_rows, leading_rows(q_smem, q_rows), q_bar)

    # Slot indices are fetched 2 steps ahead ("half_rows": 3, as its gathers run ahead of the
    # widening by up to 2 half steps; "in_place": 3, as it reads them a step before its gather).
    ahead = 3 if pieces > 1 or in_place else 2
    early = 0
    if prep_in_kernel:
      copy_q()  # before the count: the row's read overlaps the query tile's copy
      # With one split the first steps' indices start at slot 0 whatever the count: they are
      # fetched before it, and those past the row's steps waited for here, where no step will.
      early = min(ahead, idx_ref.shape[1] // _STEP) if num_splits == 1 else 0
      for i in range(early):
        fetch_indices(i, start=0)
      own_steps()
      for i in range(early):
        pl.when(i >= n)(functools.partial(plgpu.barrier_wait, idx_bar.at[i]))
    else:
      pl.when(n > 0)(copy_q)
    for i in range(early, ahead):
      pl.when(i < n)(functools.partial(fetch_indices, i))

    def rows_landed():
      """cp_async: this lane's last group has landed; the fence (in commit_smem) makes the
      generic-proxy writes visible to wgmma's async proxy, its warpgroup barrier every lane's rows
      to every lane."""
      cp_async_wait(0)
      plgpu.commit_smem()

    if not fp8:
      def hand_over_previous(i, in_flight):
        """cp_async: step i - 1's rows have landed once at most `in_flight` groups are."""
        @pl.when(i > 0)
        def _():
          cp_async_wait(in_flight)
          plgpu.commit_smem()
          plgpu.barrier_arrive(ready.at[lax.rem(i - 1, slots)])

      @pl.loop(0, n)
      def _(i):
        slot = lax.rem(i, slots)
        if gather == "cp_async" and hand_over_first:  # before this step's slot is free
          hand_over_previous(i, 0)
        in_phase("memory_slot_wait", pl.when(i >= slots),
                 lambda: plgpu.barrier_wait(consumed.at[slot]))
        pl.when(i + 2 < n)(functools.partial(fetch_indices, i + 2))
        in_phase("memory_gather", gather_step, i,
                 ((kv_ref, kv.at[slot], None if kv_raw is None else kv_raw.at[slot]),),
                 ready.at[slot])
        if gather == "cp_async" and not hand_over_first:
          hand_over_previous(i, 1)  # this step's group issued, still in flight

      if gather == "cp_async":
        @pl.when(n > 0)
        def _():
          rows_landed()
          plgpu.barrier_arrive(ready.at[lax.rem(n - 1, slots)])

      # Sees the last uses of the slots out too (a warpgroup waits on every phase of a barrier).
      @pl.loop(jnp.maximum(n - slots, 0), n)
      def _(i):
        plgpu.barrier_wait(consumed.at[lax.rem(i, slots)])
      return

    if in_place:
      tiles = lora // DS_MLA_TILE

      stage = functools.partial(stage_in_place, groups=landing_groups if wide_widening else 1)

      def widen_in_place(slot, groups):
        """The slot's e4m3 NoPE tile j (staged in bf16 tile L/128 + j) times its tile scales
        becomes bf16 tiles 2j and 2j + 1. Those stores overwrite staged tiles up to j, and tile
        0's the scales: every lane loads all scales, and tile j's e4m3 rows, before the
        warpgroup barrier ahead of tile j's stores. wide_widening (on the GPU): lane-level
        code instead (`_wide_widen_in_place`), which waits for the step's landing_groups
        cp.async groups one by one (0: none, the values gather's rows are in)."""
        if wide_widening:
          _wide_widen_in_place(slot_nope.at[slot, pl.ds(tiles, tiles)],
                               slot_scales.at[slot, 0, pl.ds(0, tiles)], kv.at[slot], groups)
          return
        scale_layout = plgpu.Layout.WGMMA.reduce(1)
        tile_scales = [plgpu.load(slot_scales.at[slot, 0, j], layout=scale_layout)
                       for j in range(tiles)]
        for j in range(tiles):
          x = slot_nope[slot, tiles + j]  # [64, 128] e4m3
          plgpu.commit_smem()
          x = plgpu.layout_cast(x.astype(jnp.float16).astype(jnp.float32), plgpu.Layout.WGMMA)
          y = (x * row_broadcast(tile_scales[j], x.shape)).astype(kv.dtype)
          kv[slot, 2 * j] = y[:, :_COLS]
          kv[slot, 2 * j + 1] = y[:, _COLS:]

      def indices_landed(i):
        """Waits for step i's slot indices (a warpgroup waits on each phase once), an iteration
        before its gather: the order the H200 timed (RESULTS v11; laid out for an L2 prefetch of
        the rows since removed), hence the indices fetched 3 steps ahead."""
        plgpu.barrier_wait(idx_bar.at[lax.rem(i, _IDX_RING)])

      if values_gather:  # warpgroup 1 gathers (`refill`); this one widens
        @pl.loop(0, n)
        def _(i):
          slot = lax.rem(i, slots)
          in_phase("memory_staged_wait", wait_staged, staged_barrier(slot))
          in_phase("memory_landing_wait", lane_barrier_wait, landed_at(slot),
                   lax.rem(lax.div(i, slots), 2))
          in_phase("memory_widen", widen_in_place, slot, 0)
          plgpu.commit_smem()
          plgpu.barrier_arrive(ready.at[slot])
          # Ring entry (i + 3) % 4 was last read for step i - 1: by its gather (landed) and its
          # scores (released).
          pl.when(i > 0)(lambda: plgpu.barrier_wait(consumed.at[lax.rem(i + 1, slots)]))
          pl.when(i + 3 < n)(functools.partial(fetch_indices, i + 3))

        pl.when(n > 0)(lambda: plgpu.barrier_wait(consumed.at[lax.rem(n - 1, slots)]))
        return

      pl.when(n > 0)(functools.partial(indices_landed, 0))
      pl.when(n > 0)(functools.partial(stage, 0))
      pl.when(n > 1)(functools.partial(indices_landed, 1))

      @pl.loop(0, n)
      def _(i):
        slot = lax.rem(i, slots)
        in_phase("memory_staged_wait", wait_staged, staged_barrier(slot))
        if gather == "cp_async" and not wide_widening:
          rows_landed()  # this step's is the only group in flight (else the widening waits)
        in_phase("memory_widen", widen_in_place, slot, landing_groups)
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[slot])

        # Step i + 1 into the other slot once both consumers are done with step i - 1 there (and
        # so with ring entry (i + 3) % 4, last read for step i - 1).
        @pl.when(i + 1 < n)
        def _():
          in_phase("memory_slot_wait", pl.when(i > 0),
                   lambda: plgpu.barrier_wait(consumed.at[lax.rem(i + 1, slots)]))
          pl.when(i + 3 < n)(functools.partial(fetch_indices, i + 3))
          in_phase("memory_gather", stage, i + 1)
          pl.when(i + 2 < n)(functools.partial(indices_landed, i + 2))

      @pl.loop(jnp.maximum(n - slots, 0), n)  # the last uses of the slots, as for bf16
      def _(i):
        plgpu.barrier_wait(consumed.at[lax.rem(i, slots)])
      return

    def widen(part, buf=None):
      """Row slot part = the staged rows (of staging buffer buf with "half_rows"): the e4m3 NoPE
      tiles times their tile scales, then the bf16 RoPE. e4m3 times its tile's power-of-two scale
      is exact in bf16 (e4m3 widens to f16 in hardware, f16 to f32 exactly). 64 rows go through
      registers in the WGMMA layout, 32 in HALF_ROWS_LAYOUT (WGMMA's takes 64); wide_widening
      (on the GPU): the NoPE tiles through lane-level code instead (`_wide_widen`)."""
      staged_at = lambda ref, j: ref.at[j] if pieces == 1 else ref.at[buf, j]
      layout = plgpu.Layout.WGMMA if pieces == 1 else HALF_ROWS_LAYOUT
      if wide_widening:  # lane-level; the interpreter runs the Pallas-level form (else)
        staged_buf = lambda ref: ref if pieces == 1 else ref.at[buf]
        _wide_widen(staged_buf(stage_nope), staged_buf(stage_scales), kv.at[part])
      else:
        @pl.loop(0, stage_nope.shape[-3])
        def _(j):
          if pieces == 1:
            x = plgpu.layout_cast(stage_nope[j].astype(jnp.float16).astype(jnp.float32), layout)
          else:
            x = plgpu.load(stage_nope.at[buf, j], layout=layout)
            x = x.astype(jnp.float16).astype(jnp.float32)
          tile_scale = plgpu.load(staged_at(stage_scales, j), layout=layout.reduce(1))
          y = (x * row_broadcast(tile_scale, x.shape)).astype(kv.dtype)  # [rows, 128]
          kv[part, 2 * j] = y[:, :_COLS]
          kv[part, 2 * j + 1] = y[:, _COLS:]

      for j in range(stage_rope.shape[-3]):
        kv[part, lora // _COLS + j] = plgpu.load(staged_at(stage_rope, j), layout=layout)

    if pieces == 1:
      def stage(i):
        scales = scale_part(first + i, stage_scales, staged)
        gather_step(i, ((nope_ref, stage_nope, nope_raw), (rope_ref, stage_rope, rope_raw)),
                    staged, scales=scales)

      pl.when(n > 0)(functools.partial(stage, 0))

      @pl.loop(0, n)
      def _(i):
        wait_staged(staged)
        if gather == "cp_async":
          rows_landed()
        pl.when(i > 0)(lambda: plgpu.barrier_wait(consumed.at[0]))
        widen(0)
        plgpu.commit_smem()
        plgpu.barrier_arrive(ready.at[0])
        pl.when(i + 2 < n)(functools.partial(fetch_indices, i + 2))
        pl.when(i + 1 < n)(functools.partial(stage, i + 1))

      pl.when(n > 0)(lambda: plgpu.barrier_wait(consumed.at[0]))
      return

    # fp8_pipeline="half_rows": half step j = 2 i + p (rows 32 p to 32 p + 31 of step i) goes
    # through staging buffer j % S (a ring of S 32-row buffers) into row slot p. A staging buffer
    # is refilled with half step j + S as soon as j has been widened out of it, so each gather has
    # about S - 1 half steps of widening and products to land; and half j + 1 is widened while the
    # consumers compute on half j. Each lane commits one cp.async group a half step, in order, S
    # ahead: at the top of half step j, G(j) has landed once at most min(S - 1, 2 n - 1 - j) groups
    # are in flight.
    ring = stage_nope.shape[0]

    def stage_half(i, part, buf):
      """Step i's half part (its tile scales, NoPE and RoPE rows) into staging buffer buf."""
      scales = scale_part((first + i) * pieces + part, stage_scales.at[buf], staged_barrier(buf))
      at = lambda ref: None if ref is None else ref.at[buf]
      gather_step(i, ((nope_ref, stage_nope.at[buf], at(nope_raw)),
                      (rope_ref, stage_rope.at[buf], at(rope_raw))), staged_barrier(buf),
                  half=part, scales=scales)

    for j in range(ring):
      pl.when(j < n * pieces)(functools.partial(stage_half, j // pieces, j % pieces, j))

    @pl.loop(0, n)
    def _(i):
      for part in range(pieces):
        j = i * pieces + part
        buf = lax.rem(j, ring)
        wait_staged(staged_barrier(buf))
        if gather == "cp_async":
          in_flight = n * pieces - 1 - j  # groups committed after G(j), up to ring - 1
          for k in range(ring):
            pl.when(in_flight == k if k < ring - 1 else in_flight >= k)(
                functools.partial(cp_async_wait, k))
          plgpu.commit_smem()  # every lane widens rows other lanes copied
        # Slot part took consumer step j - 2: wait until both consumers are done with it.
        pl.when(i > 0)(functools.partial(plgpu.barrier_wait, consumed.at[part]))
        if part == pieces - 1:
          # Ring entry (i + 3) % 4 was last read for step i - 1, which both consumers are done with.
          pl.when(i + 3 < n)(functools.partial(fetch_indices, i + 3))
        widen(part, buf)
        plgpu.commit_smem()  # also: every lane is done reading the buffer before its refill
        plgpu.barrier_arrive(ready.at[part])
        nxt = part + ring  # half step j + ring, in this iteration's terms
        pl.when(j + ring < n * pieces)(
            functools.partial(stage_half, i + nxt // pieces, nxt % pieces, buf))

    for part in range(pieces):  # the last use of each slot
      pl.when(n > 0)(functools.partial(plgpu.barrier_wait, consumed.at[part]))


def _raw(tiled_shape, dtype):
  """The untiled, swizzled alias [..., tiles * 8, 8, w] of a tiled [..., tiles, 64, w] buffer."""
  *lead, tiles, rows, width = tiled_shape
  return plgpu.SMEM((*lead, tiles * rows // 8, 8, width), dtype,
                    transforms=(plgpu.SwizzleTransform(128),))


def head_dims_fit(head_dim, kv_lora_rank):
  """Whether the kernel takes rows of head_dim = kv_lora_rank + rope columns."""
  return (kv_lora_rank % (_VALUE_WGS * _COLS) == 0 and kv_lora_rank < head_dim <= _MAX_HEAD_DIM
          and head_dim % _COLS == 0)


def _check(q, slots, lora, num_splits, scale):
  check_sparse_args(q, slots, num_splits)
  check_softmax_scale(scale)
  d = q.shape[2]
  if not head_dims_fit(d, lora):
    raise ValueError(f"head dim {d} must be kv_lora_rank ({lora}, a multiple of "
                     f"{_VALUE_WGS * _COLS}) + a rope dim, a multiple of {_COLS} and at most "
                     f"{_MAX_HEAD_DIM} (the query tile and the row slots fill shared memory)")
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"q must be bfloat16, got {q.dtype.name}")


def split_count(rule, num_tokens, head_tiles, max_len, sms):
  """Splits of each token's slot list (before the cap of one step a split). "fill": the decode
  kernels' rule (`default_num_kv_splits`: about 2 programs a SM). "one_wave": this kernel's shared
  memory holds one program a SM, so splits help only while tokens x head tiles leave SMs idle;
  every split costs a float32 partial output and the merge's read of it (T=128: 1 split where
  "fill" gives 4 at N <= 64 and 2 at N=128)."""
  if rule == "fill":
    return default_num_kv_splits(num_tokens, head_tiles, max_len, sms)
  return one_wave_splits(num_tokens * head_tiles, sms)


def _splits(num_tokens, head_tiles, padded_slots, num_splits, split_rule):
  """The split count the kernel runs: num_splits, else split_rule's, capped at one 64-slot step a
  split (padded_slots: the slot list padded to whole steps)."""
  splits = num_splits or split_count(split_rule, num_tokens, head_tiles, padded_slots, sm_count())
  return max(min(splits, padded_slots // _STEP), 1)


def default_fp8_pipeline(num_tokens, num_heads, top_k, *, num_splits, split_rule, gather,
                         head_dims=None):
  """The fp8_ds_mla pipeline that fp8_pipeline=None runs (static shapes only): "in_place" where
  the kernel runs 1 split a token (several splits, small batches or an explicit num_splits, were
  not timed with "in_place": "half_rows") and the gather is cp_async (the only one "in_place"
  takes), or there "register_a" (`mosaic_sparse_register_a`) for head_dims (kv_lora_rank, rope
  dim; None where the caller's knobs rule it out) that it takes (16 or 32 heads, 512 + 64); else
  "half_rows". Timings in `MosaicSparseConfig`."""
  head_tiles = pl.cdiv(num_heads, _TILE_H)
  if gather != "cp_async":
    return "half_rows"
  padded_slots = max(pl.cdiv(top_k, _STEP), 1) * _STEP
  one_split = _splits(num_tokens, head_tiles, padded_slots, num_splits, split_rule) == 1
  if not one_split:
    return "half_rows"
  if head_dims is not None and register_a.fits(num_heads, *head_dims):
    return "register_a"
  return "in_place"


def default_gather_by(num_tokens):
  """The gather_by that gather_by=None runs (static shapes only): "values" up to
  VALUES_GATHER_MAX_ROWS rows (decode rows, where the memory warpgroup's chain bounds the step),
  "memory" past them (the consumers bound it). H100, session 37: T=128 -6.5% (N=128) and -7%
  (N=64); T=4096 +0.4% and +3%; between, not timed. Timings in `MosaicSparseConfig`."""
  return "values" if num_tokens <= VALUES_GATHER_MAX_ROWS else "memory"


def default_heads_in(num_tokens, num_heads, top_k, *, fp8, num_splits, split_rule):
  """The heads_in that heads_in=None runs (static shapes only): "n" for bf16 caches at N <= 32
  (HEADS_N_TILES[-1]) where the kernel runs one split a token, else "m" (fp8_ds_mla at any N; any
  cache above 32 heads, which "n" does not take; several splits, whose float32 partial output
  "n" cannot store: `heads_n_splits`). H200, T=128 over a 1M-token cache, ms, "m" (unpadded) /
  "n": bf16 N=16 0.107 / 0.106, N=32 0.113 / 0.106 (never slower); fp8_ds_mla N=16 0.143
  (half_rows) / 0.136 (in_place), N=32 0.139 / 0.147 (mixed, within one run's noise: "m" kept).
  T=4096 over 32K: bf16 N=16 2.64 / 2.18, N=32 2.63 / 2.60. Timings in `MosaicSparseConfig`."""
  if fp8 or num_heads > HEADS_N_TILES[-1]:
    return "m"
  padded_slots = max(pl.cdiv(top_k, _STEP), 1) * _STEP
  one_split = _splits(num_tokens, 1, padded_slots, num_splits, split_rule) == 1
  return "n" if one_split else "m"


def heads_n_splits(num_splits):
  """The split count heads_in="n" runs: one. Its output tile is O^T, stored transposed into the
  [heads, columns] output, and Mosaic GPU (jax 0.11.2) lowers that transposed store for bf16 but
  not for a split's float32 partial ("Failed to infer a possible set of layouts")."""
  if num_splits is not None and num_splits != 1:
    raise ValueError(f"heads_in=\"n\" runs one split (its transposed output store takes bf16, "
                     f"not a split's float32 partial); got num_splits={num_splits}")
  return 1




def _sparse_call(q, slots, cache_args, *, scale, lora, num_slots, fp8, num_splits, auto_barriers,
                 gather, split_rule, fp8_pipeline, fp8_stage_halves, heads_in, prep_in_kernel,
                 interpret, wide_widening=False, landing_groups=1, gather_by="memory",
                 hand_over_first=False, rescale_slack=None):
  """Pads heads to tiles of heads_tile(N) and slots to 64-slot steps, runs the kernel, merges
  splits. prep_in_kernel: the kernel takes the padded slots as they are (`MosaicSparseConfig`)."""
  t, n, d = q.shape
  tile_h = heads_tile(n, heads_in)
  if t == 0 or n == 0:  # no program to run (and no split count: it divides by T x head tiles)
    return jnp.zeros((t, n, lora), q.dtype), jnp.zeros((t, n), jnp.float32)
  head_tiles = pl.cdiv(n, tile_h)
  # Heads in N take whole tiles: their query tile is laid out by head, not copied by rows.
  np_ = head_tiles * tile_h if heads_in == "n" else padded_heads(n, tile_h)
  if np_ != n:
    q = jnp.pad(q, ((0, 0), (0, np_ - n), (0, 0)))
  k = max(pl.cdiv(slots.shape[1], _STEP), 1) * _STEP
  slots = jnp.pad(slots, ((0, 0), (0, k - slots.shape[1])), constant_values=-1)
  if prep_in_kernel:
    index_args = (slots,)
  else:
    valid = (slots >= 0) & (slots < num_slots)
    idx = jnp.where(valid, slots, num_slots)  # past the cache: either gather reads nothing there
    # Walk only up to each row's last valid slot: top-k lists of short rows are mostly -1 padding.
    extent = jnp.max(jnp.where(valid, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=1)
    steps = lax.div(extent + (_STEP - 1), _STEP)
    index_args = (idx, steps)
  splits = _splits(t, head_tiles, k, num_splits, split_rule)
  out_dtype = q.dtype if splits == 1 else jnp.float32
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  if interpret:
    gather = "bulk"  # the interpreter runs no inline Mosaic GPU code
  half_rows = fp8 and fp8_pipeline == "half_rows"
  in_place = fp8 and fp8_pipeline == "in_place"
  values_gather = in_place and gather_by == "values" and not interpret  # (cp_async only)
  # Row slots x rows (the consumers' step): bf16 2 x 64 (the next step's rows land while this one
  # computes); fp8_ds_mla 1 x 64, or 2 x 32 with "half_rows" (the same bytes), or bf16's 2 x 64
  # with "in_place" (staged inside the slots). P V's K is the step, and wgmma's K must be a
  # multiple of its operands' swizzle width (one swizzle a wgmma): 32-row steps take 64-byte
  # swizzles for the query, the slots and P.
  row_slots, step_rows = ((2, HALF_ROWS) if half_rows else (1, _STEP) if fp8 and not in_place
                          else (2, _STEP))
  sw = 2 * HALF_ROWS if half_rows else SWIZZLE
  chunks = d // _COLS
  groups = [(swizzled((tile_h, d), q.dtype, sw),
             swizzled((row_slots, chunks, step_rows, _COLS), q.dtype, sw)),
            (swizzled((_VALUE_WGS, tile_h, lora // _VALUE_WGS), out_dtype),
             plgpu.SMEM((tile_h,), jnp.float32))]
  if not fp8 and not interpret and gather == "bulk":
    groups.append((plgpu.SMEM((tile_h, d), q.dtype),
                   _raw((row_slots, chunks, _STEP, _COLS), q.dtype)))
  if in_place:
    # The row slots' bytes as the staging (aliases past a pad the size of the query tile): a
    # 128-column e4m3 tile of 64 rows takes one bf16 tile's 8 KB, as do 32 x 64 float32 scales.
    groups += [(plgpu.SMEM((tile_h, d), q.dtype),
                swizzled((row_slots, chunks, _STEP, DS_MLA_TILE), F8)),
               (plgpu.SMEM((tile_h, d), q.dtype),
                plgpu.SMEM((row_slots, chunks, _COLS // 2, _STEP), jnp.float32))]
  scratch = [plgpu.RefUnion(*groups)]
  tiles = lora // DS_MLA_TILE, (d - lora) // _COLS  # fp8_ds_mla: NoPE scale tiles, RoPE tiles
  if fp8 and not prep_in_kernel:  # prep_in_kernel: the kernel gathers them from tile_scales
    nope, rope, tile_scales = cache_args
    # The selected rows' tile scales, [T, Kp/rows, L/128, rows] (rows: 64, or 32 with
    # "half_rows"): 16 bytes a slot (0 where invalid), one contiguous block a staging fill.
    scales = jnp.where(valid[..., None], tile_scales[jnp.where(valid, slots, 0)], 0.0)
    scales = scales.reshape(t, k // step_rows, step_rows, -1).transpose(0, 1, 3, 2)
    cache_args = (nope, rope, scales)
  # "half_rows": a ring of 32-row buffers, each refilled once widened (2: the bytes of 1 x 64).
  halves = (fp8_stage_halves,) if half_rows else ()
  if fp8 and not in_place:
    staged_shapes = (((*halves, tiles[0], step_rows, DS_MLA_TILE), F8),
                     ((*halves, tiles[1], step_rows, _COLS), jnp.bfloat16))
    staging = [tuple(swizzled(*shape) for shape in staged_shapes)]
    if not interpret and gather == "bulk":
      staging.append(tuple(_raw(*shape) for shape in staged_shapes))
    scratch += [plgpu.RefUnion(*staging),
                plgpu.SMEM((*halves, tiles[0], step_rows), jnp.float32)]
  # row_smem; with values_gather its slack holds the two slots' lane barriers.
  row_words = tile_h + (2 * LANE_BARRIER_WORDS if values_gather else 0)
  scratch += [swizzled((tile_h, step_rows), q.dtype, sw), plgpu.SMEM((row_words,), jnp.float32),
              plgpu.SMEM((_IDX_RING, _STEP), jnp.int32),
              plgpu.Barrier(),
              # bulk bf16: every row chunk's copy arrives; else the memory warpgroup once.
              plgpu.Barrier(num_arrivals=_STEP * chunks if gather == "bulk" and not fp8 else 1,
                            num_barriers=row_slots),
              plgpu.Barrier(num_arrivals=_VALUE_WGS, num_barriers=row_slots),
              plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(num_barriers=_IDX_RING)]
  if fp8 and not (prep_in_kernel and gather == "cp_async"):
    # A staging fill's scales copy, and with the bulk gather every row chunk's copy; prep_in_kernel
    # (bulk in the interpreter): every row chunk's and every row's tile scale's copy (cp_async:
    # none, the rows' cp.async group carries the scales).
    scratch.append(plgpu.Barrier(
        num_arrivals=(step_rows * (sum(tiles) + tiles[0]) if prep_in_kernel
                      else 1 + (step_rows * sum(tiles) if gather == "bulk" else 0)),
        num_barriers=(row_slots,) if in_place else halves))
  heads_n = heads_in == "n"
  reduction_bytes = REDUCTION_BYTES_PER_8_HEADS * tile_h // 8 if heads_n else 0
  used = smem_bytes(scratch, reduction_bytes)
  if used > _SMEM_LIMIT:
    raise ValueError(f"the kernel's shared memory ({used} bytes: fp8_ds_mla {fp8}, fp8_pipeline "
                     f"{fp8_pipeline} x {fp8_stage_halves}, gather {gather}) exceeds a Hopper "
                     f"block's {_SMEM_LIMIT}")

  hands_over_first = hand_over_first and not fp8 and gather == "cp_async"  # where it acts
  grouped = in_place and wide_widening and not interpret and not values_gather  # landing_groups
  # Groups of whole NoPE tiles (DeepSeek's 512 columns: 4 tiles, every choice).
  landing_groups = math.gcd(landing_groups, lora // DS_MLA_TILE)
  landing_name = f"_landing{landing_groups}" if grouped else ""
  kernel = functools.partial(_kernel, scale=scale, lora=lora, num_splits=splits, fp8=fp8,
                             in_place=in_place, num_slots=num_slots, gather=gather,
                             heads_n=heads_n, prep_in_kernel=prep_in_kernel,
                             # The interpreter runs no lane-level code: the Pallas-level widening.
                             wide_widening=wide_widening and not interpret,
                             landing_groups=landing_groups, values_gather=values_gather,
                             hand_over_first=hand_over_first,
                             rescale_slack=None if heads_n else rescale_slack,
                             interpret=bool(interpret))
  o_parts, lse_parts = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((t, splits, np_, lora), out_dtype),
                jax.ShapeDtypeStruct((t, splits, np_), jnp.float32)),
      scratch_types=tuple(scratch),
      # Tokens launch fastest (Mosaic GPU makes the grid's last axis CUDA's x). Head tiles fastest,
      # so that a token's two head tiles gather its rows together, measured no faster (H200, N=128:
      # 0.97-1.03x; benchmarks/RESULTS.md, sparse, session 11): the gather's latency paces, not HBM.
      grid=(head_tiles, splits, t),
      grid_names=("heads", "splits", "tokens"),
      num_threads=_VALUE_WGS + 1,
      thread_name="wg",
      # No automatic barriers: Pallas would put a warpgroup barrier before each of the ~600 row
      # copies of a step. Safe here: no thread reads and writes the same shared memory without a
      # barrier wait between (the hand-offs above), and commit_smem() (a warpgroup barrier) comes
      # between a warpgroup's stores and the copy that reads them, and between the widening
      # warpgroup's reads of the staging buffer and the copies that refill it.
      compiler_params=mosaic_compiler_params(approx_math=True,
                                             reduction_scratch_bytes=reduction_bytes,
                                             unsafe_no_auto_barriers=not auto_barriers),
      interpret=interpret or None,
      kernel_name=(f"mosaic_sparse_{'ds_mla' if fp8 else 'bf16'}"
                   f"{f'_half{fp8_stage_halves}' if half_rows else ''}"
                   f"{'_in_place' if in_place else ''}"
                   f"{f'_heads_n{tile_h}' if heads_n else ''}"
                   f"{'_prep' if prep_in_kernel else ''}"
                   f"{'_wide' if wide_widening else ''}"
                   f"{'_hand_over_first' if hands_over_first else ''}"
                   f"{'_lazy_rescale' if rescale_slack is not None and not heads_n else ''}"
                   f"_{gather}_s{splits}{landing_name}"
                   f"{'_values_gather' if values_gather else ''}"),
  )(q, *index_args, *cache_args)
  if splits == 1:
    o, lse = o_parts[:, 0], lse_parts[:, 0]
  else:
    o, lse = merge_splits(o_parts, lse_parts, q.dtype)
  return o[:, :n], lse[:, :n]


_STATIC = ("scale", "num_splits", "auto_barriers", "interpret", "gather", "split_rule",
           "heads_in", "prep_in_kernel")
GATHERS = ("cp_async", "bulk")
SPLIT_RULES = ("fill", "one_wave")
FP8_PIPELINES = ("serial", "half_rows", "in_place", "register_a")
HEADS_IN = ("m", "n")
HEADS_N_FP8_PIPELINES = ("serial", "in_place")  # fp8_ds_mla pipelines heads_in="n" takes
LANDING_GROUPS = (1, 2, 4)  # divisors of the 4 NoPE tiles of DeepSeek's 512-column rows
GATHER_BY = ("memory", "values")  # the warpgroup that issues "in_place"'s gathers


@dataclasses.dataclass(frozen=True)
class MosaicSparseConfig:
  """Launch knobs; the field names are the jit entries' keyword arguments (fp8_pipeline and
  fp8_stage_halves the fp8_ds_mla entry's only). Heads per program (64, the M of a wgmma, or 16 or
  32 as its N, heads_in below) and slots per step (64) are fixed by wgmma; the gather (H200:
  cp_async 2.2-2.6x bulk for bf16, 1.4x for fp8_ds_mla, benchmarks/RESULTS.md, "DSA sparse attention
  (pallas_mosaic)", v2 and v3), the split rule (`split_count`; H200, T=128: "one_wave" 1.14-1.38x
  "fill" at N 16, 32, 128 for both caches, v4; once tokens x head tiles >= 2 x 132 both give 1
  split) and fp8_pipeline are the choices.
  fp8_pipeline, how fp8_ds_mla rows are widened into bf16 row slots (one 64-row slot is what fits
  beside the query tile and the staging). None (the default) picks "in_place" or "half_rows" from
  static shapes (`default_fp8_pipeline`): "in_place" with 1 split a token and the cp_async
  gather, else "half_rows". H200 (1980 MHz, RESULTS v11), ms a call, "half_rows" / "in_place",
  before wide_widening: T=4096 over a 32K-token context (4096-8192 programs, 1 split): N=32 4.09
  / 3.90, N=64 3.80 / 3.64, N=128 7.45 / 6.99 (in_place 1.04-1.07x); T=128 over a 1M-token cache
  (128-256 programs, also 1 split under "one_wave"): N=16 0.160 / 0.163, N=32 0.189 / 0.205,
  N=64 0.183 / 0.190, N=128 0.259 / 0.267 (half_rows 1.02-1.08x), so the rule then also asked
  for >= 2 x SMs programs. With wide_widening (session 17, one run, T=128 over 1M tokens, 1
  split, default prep): N=16 0.118 / 0.116, N=32 0.118 / 0.115, N=64 0.120 / 0.117, N=128 0.236
  / 0.223 (in_place 1.02-1.06x; T=4096 N=128 6.75 / 5.52): "in_place" at every one-split shape
  timed, whatever the program count. Not timed: splits with "in_place".
  - "serial": one 64-row slot; the memory warpgroup widens step i + 1 into it only once both
    consumers are done with step i, then gathers step i + 2 (H200, T=128, N=128: 0.357 ms against
    bf16's 0.199, v4);
  - "half_rows": the same bytes as two 32-row slots, the consumers stepping 32 slots at a time,
    the staging as a ring of fp8_stage_halves (2 or 3) 32-row buffers, each refilled with the
    half step S ahead once it has been widened: half j + 1 is widened while the consumers compute
    on half j (mosaic_decode's "half_pages"; H200: 1.34x "serial" at T=128 N=128, 1.29x at N=16,
    1.30x at T=4096 N=128; 3 buffers within 1% of 2; RESULTS v6);
  - "in_place" (RESULTS v9, timed in v11): bf16's two 64-row slots and no staging buffers: a
    step's e4m3 NoPE rows, tile scales and RoPE rows land in its own row slot (once both
    consumers are done with the step two before), and are widened there, so the consumers take
    bf16's 64-slot steps (half_rows' 32-slot steps set its pace at N=128, RESULTS v7, v8); a
    step's gather then waits for its slot to be free (half_rows': two half steps ahead). cp_async
    only (the bulk gather on the GPU would need untiled aliases of the in-place views).
  - "register_a" (RESULTS, "DSA sparse attention (pallas_mosaic)", session 27; another kernel,
    `mosaic_sparse_register_a`): no row is widened. 16 or 32 heads as wgmma's N, the e4m3 rows
    gathered into a 4-slot ring and used as they are: S^T by fp8 wgmma per 128-column tile (q
    split into exact e4m3 hi and lo parts), scaled per slot row; the RoPE part by bf16 wgmma; V^T
    converted and scaled per token in registers as wgmma's A. One split, the cp_async gather, the
    slot prep in the kernel, 512 NoPE and 64 RoPE columns (ValueErrors otherwise). The default
    wherever one split runs at 16 and 32 heads: H200, T=128 over 1M tokens, in turn, us,
    "in_place" (the default before) / "register_a": N=16 105.5 / 64.0 (2.69 TB/s gathered; bf16
    82.6), N=32 105.4 / 83.1; T=4096 over 32K, ms: N=16 2.55 / 1.59, N=32 2.61 / 2.10.
  heads_in, where a program's heads sit in the wgmma shapes. None (the default) picks from static
  shapes (`default_heads_in`): "n" for bf16 caches at N <= 32 run in one split, else "m". "m": 64
  heads as M (N < 64 in the 64-row tile: at N=16 three quarters of the tensor work and of the
  softmax are padding; only the N query rows are copied in and stored, `padded_heads`, where N is
  a multiple of 8).
  "n" (RESULTS, sparse v12): N <= 32 heads as wgmma's N, padded to 16 or 32 (`heads_tile`; a
  ValueError above 32): S^T = K Q^T [64 slots, heads], its softmax over the slot rows (the row
  max a cross-warp reduction a step, through `reduction_scratch_bytes`; the row sum as partial
  sums reduced once at the end, `common.run_scores`' partial_sums), P^T stored transposed into
  p_smem [heads, 64], O^T = V^T P^T a value tile (V^T an MN-major A operand), the output tiles
  stored transposed into the [heads, columns] staging. Both caches; fp8_ds_mla with fp8_pipeline
  "serial" or "in_place" named (their consumers step 64 slots over widened bf16 rows, as bf16's
  do; a ValueError with "half_rows", whose 32-slot steps are under wgmma's M of 64, and with None,
  which picks "half_rows" at few tokens). H200 (RESULTS v12 timed, session 11), T=128 over a
  1M-token cache (2048 slots a token, 1 split), ms a call, "m" / "n": bf16 N=16 0.107 / 0.106,
  N=32 0.113 / 0.106 (2.93 TB/s gathered); fp8_ds_mla N=16 0.143 (half_rows) / 0.136 (in_place),
  N=32 0.139 / 0.147. "n" runs flat over 16 and 32 heads: the gather paces the call, not the
  consumers (the prediction of 0.080-0.098 ms bf16 missed). T=4096 over 32K (session 12), bf16
  "m" / "n": N=16 2.64 / 2.18, N=32 2.63 / 2.60. "n" runs one split (`heads_n_splits`: its
  float32 partials' transposed store does not lower; session 12 found the default failing there,
  T=64); "m" at T=64 (2 splits): N=16 0.0756, N=32 0.0773 ms against Triton's 0.091 / 0.110. Not
  timed: "n" with the bulk gather (which the rule does not see: it is no default).
  prep_in_kernel (RESULTS, sparse v13, v13 timed and v14; None, the default: True, but with
  fp8_ds_mla past FP8_PREP_MAX_ROWS rows and with the bulk gather, which it does not take): the
  kernel takes the slots as they are (-1 padded to whole steps) instead of XLA's idx (invalid slots
  mapped past the cache) and per-row step counts, and fp8_ds_mla's cache tile scales instead of
  XLA's gathered, transposed blocks, so those XLA kernels (T=128: 4.3-4.6 us of slot prep, 9.7-9.8
  us of scale gather) and their launch gaps leave the call. Invalid slots need nothing new on the
  memory side (the cp.async gather's compare is unsigned, so -1 reads nothing like a slot past the
  cache; a bulk copy's signed coordinates put a row at -1 outside the cache, zero-filled); the
  scores mask them with one more compare. Each warpgroup counts the row's steps itself
  (`mosaic_lanes.row_steps`: every warp reads the row's Kp slots from GMEM, 8 KB at Kp=2048, and
  takes the max over its lanes of the last valid position, which -1 anywhere in the row leaves
  right), so a row walks only up to its last valid slot, as the default's XLA count does (v14; v13
  walked all Kp/64 steps: rows of 256 valid slots 2.2-3.4x slower). Every program copies its query
  tile and the consumers wait for it unconditionally: under the default's `n > 0` ptxas spills in
  the scores loop (bf16 N=128: 10 reloads a step; none here). The scales come in each step's
  cp.async group (4-byte copies, 2 a lane a 64-row step), so fp8_ds_mla takes the cp_async gather
  only (bulk copies of 4 bytes are under a bulk copy's 16-byte box). H200 (session 12, v13: every
  step walked), T=128 over a 1M-token cache, ms, default / prep_in_kernel: full rows (2048 valid
  slots) bf16 N=128 0.197 / 0.185, N=16 0.0931 / 0.0862; fp8_ds_mla N=128 0.264 / 0.249, N=16 0.138
  / 0.124; rows of 256 valid slots bf16 N=128 0.0855 / 0.1917, fp8_ds_mla N=128 0.0768 / 0.2641. v14
  (the count in the kernel; session 13, one process), N=128: full rows bf16 0.202 / 0.190,
  fp8_ds_mla 0.267 / 0.251; 256 valid slots bf16 0.0698 / 0.0567, fp8_ds_mla 0.0723 / 0.0697.
  Session 14, full rows, v14 / XLA's prep: T=128 N=128 bf16 0.184 / 0.201, fp8_ds_mla 0.256 / 0.258,
  N=16 equal; over 32K, fp8_ds_mla T=1024 N=16 0.962 / 0.897, N=128 1.88 / 1.79, T=4096 N=16 3.68 /
  3.46, N=128 7.18 / 6.93 (the in-kernel scale gather costs more than the XLA work it saves there),
  bf16 T=1024 and 4096 N=128 1.36 / 1.40 and 5.34 / 5.50, N=16 equal.
  wide_widening (True, the default; fp8_ds_mla, every fp8_pipeline): the memory warpgroup widens
  the staged e4m3 NoPE tiles in lane-level code (`_wide_widen`; "in_place": `_wide_widen_in_place`,
  whose stores overwrite the staged tiles and scales that other lanes read, behind one warpgroup
  and two warp barriers a step) instead of through Pallas arrays (HALF_ROWS_LAYOUT's 2-element
  vectors: per 2 values a 2-byte load, cvt e4m3x2 -> f16x2, 2 f16 -> f32, 2 multiplies, cvt ->
  bf16x2, a 4-byte store): each lane loads 16 e4m3 values of a row at once and places each byte's
  bits into a bf16 (`mosaic_lanes.WIDE_SELECTORS`: prmt, shl, and), times bf16(scale * 2^120) in
  one bf16x2 multiply: 4 instructions per 2 values, one 16-byte load per 16 and two 16-byte
  stores. Bit for bit today's values (`mosaic_lanes.wide_widening_model`, tested over all 256
  bytes): scales that are not bf16 or above 2^7 (the project's quantizer writes powers of two;
  vLLM's non-power-of-two scales are not bf16) take today's conversion in the same lane code, per
  row and tile; e4m3 NaN bytes (0x7F, 0xFF, which no quantizer writes) widen to 480 x scale
  instead of NaN on the fast path. The interpreter runs the Pallas-level widening. ptxas (T=128,
  N=128, half_rows): the widening of a
  half step 289 instructions a lane (8 LDS.128, 16 STS.128) against 496 (68 LDS, 16 STSM), no
  spills (the default: 3 outside step loops; N=16 1 in them). "in_place" (T=4096 over 32K,
  N=128): a step's widening 635 instructions a lane on the bit placement's path (16 LDS.128, 32
  STS.128, 2 barriers) against 1019 (128 LDS.U16, 32 STSM, 5 barriers, 18 spill accesses); the
  memory warpgroup's spill accesses 19 against 51 (N=16: 10 against 49); the consumers' the
  same. H200 (session 17, fp8_ds_mla, ms, Pallas-level / wide): T=128 over a 1M-token cache N=128
  half_rows 0.261 / 0.238 (307 TFLOP/s), serial 0.282 / 0.250; N=16 half_rows 0.136 / 0.122,
  serial 0.142 / 0.130; T=4096 over 32K N=128 in_place 6.96 / 5.52 (423 TFLOP/s), half_rows 7.41
  / 6.75: faster at every shape timed, so the default; False keeps the Pallas-level widening (the
  bit-for-bit test's oracle).
  hand_over_first (bf16 caches, the cp_async gather; the fp8_ds_mla entry takes none): when the
  memory warpgroup hands step i - 1's landed rows over (ready). True (the default): first, as soon
  as step i - 1's rows are in, then the wait for step i's slot and its gather. False: after it has
  waited for step i's slot and issued step i's gather, so step i - 1's ready waited for that issue
  (~36 cp.async a lane) even when its rows landed long before. H200 (session 29, N=128, ms,
  False / True): T=128 over 1M tokens 0.191 / 0.190, T=4096 over 32K 5.20 / 4.74 (449 -> 493
  TFLOP/s). The interpreter's bulk gather has no hand-over: it ignores the knob.
  rescale_slack (None or a float >= 0, log2 units; heads in M, both caches; heads in N and
  "register_a" ignore it): the consumers' lazy rescale, `mosaic_decode.MosaicDecodeConfig`'s: a
  row's running max moves only past the slack, and a consumer warp whose rows all kept theirs
  skips its output's rescale (`mosaic_lanes.rows_rescaled`: 128 FMUL a thread, both consumers,
  between the softmax and P V). 0 is bit-identical to None. H200 (session 29, N=128, 8.0 against
  None, ms, not in turn): fp8_ds_mla T=128 0.215 / 0.219, T=4096 5.04 / 5.18; bf16 T=128 0.26 /
  0.191 (slower: not understood), T=4096 5.32 / 5.20. None (the default) for both caches.
  landing_groups (1, 2 or 4; fp8_ds_mla "in_place" gathered by the memory warpgroup with
  wide_widening on the GPU, which alone acts on it; rows of fewer NoPE tiles take the largest
  divisor of their tile count): the cp.async groups a step's rows land in, the widening starting on
  the first group's NoPE tiles while the others land (`_cp_async_rows`, `_wide_widen_in_place`).
  With one group the memory warpgroup's step is a chain, gather issue -> landing -> widening (H200,
  T=128 N=128 over a 1M-token cache, ncu, session 36: ~2,100 + ~1,700 + ~2,600 of a ~6,400-clock
  step); the groups hide only the spread of their issue (a copy's latency, ~3,000 clocks, is longer
  than the whole issue, so the groups land close together) and each adds a warpgroup barrier. H100
  (session 36, one run, in turn, ms, 1 / 2 / 4 groups): T=128 over 1M tokens N=128 0.205 / 0.200 /
  0.204, N=64 0.111 / 0.107 / 0.110; T=4096 over 32K N=128 5.11 / 5.04 / 5.14, N=64 2.66 / 2.62 /
  2.67: 2 (the default) 1.4-3.6% faster than 1.
  gather_by ("memory", "values", or None: `default_gather_by`; fp8_ds_mla "in_place" on the GPU,
  which alone acts on it): the warpgroup that issues a step's gather. "values": warpgroup 1, which
  waits for P most of a step, issues step k + 2's rows into slot k % 2 once both consumers released
  step k (`common.run_values`' refill hook), each lane then arriving on the slot's lane barrier once
  its copies land (cp.async.mbarrier.arrive, `mosaic_lanes.cp_async_arrive`: Pallas' barriers do not
  reach lane code, so the two live in row_smem's slack), and the memory warpgroup only waits for
  them and widens. Session 36's model of the memory warpgroup's chain (RESULTS, "Session 36")
  predicts the two-slot bound: ~-23% at T=128 N=128, ~-11% at T=4096. H100 (session 37, one run, in
  turn, ms, "memory" / "values"): T=128 over 1M tokens N=128 0.200 / 0.187, N=64 0.107 / 0.0994;
  T=4096 over 32K N=128 5.14 / 5.16, N=64 2.63 / 2.71. The chain is shorter (H100 profile, T=128: a
  step period of ~4,700 clocks; H200's "memory" step, ncu: ~6,400) but the slot's round trip is now
  the bound: release, issue (~700), landing (~2,400), widening (~1,900), the consumers' step
  (~3,300), over 2 slots. Where the consumers bound the step (T=4096), warpgroup 1's issue lands on
  their path."""
  gather: str = "cp_async"
  split_rule: str = "one_wave"
  fp8_pipeline: str | None = None
  fp8_stage_halves: int = 2  # staging in 32-row buffers: "serial" stages 64 rows (2 halves)
  heads_in: str | None = None
  prep_in_kernel: bool | None = None
  wide_widening: bool = True
  hand_over_first: bool = True
  rescale_slack: float | None = None
  landing_groups: int = 2
  gather_by: str | None = None

  def __post_init__(self):
    if self.gather not in GATHERS:
      raise ValueError(f"gather must be one of {GATHERS}, got {self.gather!r}")
    if self.split_rule not in SPLIT_RULES:
      raise ValueError(f"split_rule must be one of {SPLIT_RULES}, got {self.split_rule!r}")
    if self.fp8_pipeline is not None and self.fp8_pipeline not in FP8_PIPELINES:
      raise ValueError(f"fp8_pipeline must be None or one of {FP8_PIPELINES}, got "
                       f"{self.fp8_pipeline!r}")
    if self.fp8_pipeline == "in_place" and self.gather != "cp_async":
      raise ValueError(f"fp8_pipeline \"in_place\" takes the cp_async gather, got {self.gather!r}")
    if self.fp8_stage_halves not in ((2, 3) if self.fp8_pipeline == "half_rows" else (2,)):
      raise ValueError(f"fp8_stage_halves must be 2 (or 3 with fp8_pipeline \"half_rows\"), got "
                       f"{self.fp8_stage_halves!r} with {self.fp8_pipeline!r}")
    if self.heads_in is not None and self.heads_in not in HEADS_IN:
      raise ValueError(f"heads_in must be None or one of {HEADS_IN}, got {self.heads_in!r}")
    if self.prep_in_kernel is not None and not isinstance(self.prep_in_kernel, bool):
      raise ValueError(f"prep_in_kernel must be None or a bool, got {self.prep_in_kernel!r}")
    if not isinstance(self.wide_widening, bool):
      raise ValueError(f"wide_widening must be True or False, got {self.wide_widening!r}")
    if not isinstance(self.hand_over_first, bool):
      raise ValueError(f"hand_over_first must be True or False, got {self.hand_over_first!r}")
    check_rescale_slack(self.rescale_slack)
    if self.landing_groups not in LANDING_GROUPS:
      raise ValueError(f"landing_groups must be one of {LANDING_GROUPS}, got "
                       f"{self.landing_groups!r}")
    if self.gather_by is not None and self.gather_by not in GATHER_BY:
      raise ValueError(f"gather_by must be None or one of {GATHER_BY}, got {self.gather_by!r}")
    if self.gather_by == "values" and (self.fp8_pipeline not in (None, "in_place")
                                       or self.gather != "cp_async"):
      raise ValueError(f"gather_by \"values\" takes fp8_pipeline \"in_place\" (or None) and the "
                       f"cp_async gather, got {self.fp8_pipeline!r} and {self.gather!r}")


CONFIG = MosaicSparseConfig()
# prep_in_kernel=None with fp8_ds_mla: in the kernel up to this many rows (decode rows; timed at
# T=128: equal or faster), XLA's prep past it (T=1024 and 4096 over 32K: 1.04-1.07x; between,
# not timed). bf16 takes it at every T (1.03-1.09x at N=128). See `MosaicSparseConfig`.
FP8_PREP_MAX_ROWS = 256
# gather_by=None: "values" up to this many rows (`default_gather_by`).
VALUES_GATHER_MAX_ROWS = 256
# The sweep space: the variants `benchmarks/bench_sparse.py` times beside the chosen one.
SWEEP = (CONFIG, MosaicSparseConfig(gather="bulk"), MosaicSparseConfig(split_rule="fill"),
         MosaicSparseConfig(fp8_pipeline="serial"), MosaicSparseConfig(fp8_pipeline="half_rows"),
         MosaicSparseConfig(fp8_pipeline="half_rows", fp8_stage_halves=3),
         MosaicSparseConfig(fp8_pipeline="in_place"), MosaicSparseConfig(heads_in="m"),
         MosaicSparseConfig(heads_in="n"),
         MosaicSparseConfig(fp8_pipeline="in_place", heads_in="n"),
         MosaicSparseConfig(prep_in_kernel=False),
         MosaicSparseConfig(fp8_pipeline="half_rows", wide_widening=False),
         MosaicSparseConfig(fp8_pipeline="in_place", wide_widening=False),
         MosaicSparseConfig(fp8_pipeline="register_a"), MosaicSparseConfig(hand_over_first=False),
         MosaicSparseConfig(rescale_slack=RESCALE_SLACK),
         MosaicSparseConfig(fp8_pipeline="in_place", landing_groups=1),
         MosaicSparseConfig(fp8_pipeline="in_place", landing_groups=4),
         MosaicSparseConfig(fp8_pipeline="in_place", gather_by="memory"),
         MosaicSparseConfig(fp8_pipeline="in_place", gather_by="values"))


@functools.partial(jax.jit, static_argnames=_STATIC + ("kv_lora_rank", "hand_over_first",
                                                       "rescale_slack"))
def sparse_attention(q: jax.Array, kv_cache: jax.Array, slots: jax.Array, *, scale: float,
                     kv_lora_rank: int = 512, num_splits: int | None = None,
                     auto_barriers: bool = False, gather: str = CONFIG.gather,
                     split_rule: str = CONFIG.split_rule,
                     heads_in: str | None = CONFIG.heads_in,
                     prep_in_kernel: bool | None = CONFIG.prep_in_kernel,
                     hand_over_first: bool = CONFIG.hand_over_first,
                     rescale_slack: float | None = CONFIG.rescale_slack,
                     interpret: bool | plgpu.InterpretGPUParams = False
                     ) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA over a bf16 latent cache (semantics of `mla_jax.reference.sparse_attention`).

  q [T, N, L+R] bf16 (any N: heads in tiles of 64; heads_in="n": N <= 32, padded to 16 or 32);
  kv_cache [num_blocks, page, L+R] bf16; slots [T, K] int32 (block * page + offset; -1 or past the
  cache: skipped). num_splits=None picks a split count of the slot axis from static shapes by
  split_rule (`split_count`). auto_barriers=True lets Pallas put a warpgroup barrier before every
  bulk copy and around every shared-memory store (its safe default, kept to measure against).
  gather: "cp_async" (the 128 lanes of the memory warpgroup copy 16 bytes each into the swizzled row
  slot) or "bulk" (one bulk copy per row and 64-column chunk, 9 a row; what the interpreter runs
  either way). heads_in: `MosaicSparseConfig`'s ("n": N <= 32 heads in wgmma's N, one split;
  None: `default_heads_in`, "n" at N <= 32 where the split rule gives one split, else "m").
  prep_in_kernel: `MosaicSparseConfig`'s (the kernel reads the raw slots and counts each row's
  steps; None: True). hand_over_first and rescale_slack: `MosaicSparseConfig`'s.
  interpret: True or a `plgpu.InterpretGPUParams`
  runs Mosaic GPU's CPU interpreter. Returns o [T, N, L] bf16 and lse [T, N] float32 (natural
  log); a row with no valid slot gives (0, -inf).
  """
  _check(q, slots, kv_lora_rank, num_splits, scale)
  MosaicSparseConfig(gather, split_rule, heads_in=heads_in, prep_in_kernel=prep_in_kernel,
                     hand_over_first=hand_over_first, rescale_slack=rescale_slack)  # checks them
  if prep_in_kernel is None:
    prep_in_kernel = True
  if heads_in is None:
    heads_in = default_heads_in(q.shape[0], q.shape[1], slots.shape[1], fp8=False,
                                num_splits=num_splits, split_rule=split_rule)
  if heads_in == "n":
    num_splits = heads_n_splits(num_splits)
  if kv_cache.ndim != 3 or kv_cache.shape[2] != q.shape[2] or kv_cache.dtype != jnp.bfloat16:
    raise ValueError(f"want a bfloat16 kv_cache [num_blocks, page, {q.shape[2]}] (q's head dim), "
                     f"got {kv_cache.dtype.name}{kv_cache.shape}")
  num_slots = kv_cache.shape[0] * kv_cache.shape[1]
  rows = kv_cache.reshape(num_slots, q.shape[2] // _COLS, _COLS)
  return _sparse_call(q, slots, (rows,), scale=scale, lora=kv_lora_rank, num_slots=num_slots,
                      fp8=False, num_splits=num_splits, auto_barriers=auto_barriers,
                      gather=gather, split_rule=split_rule, fp8_pipeline=CONFIG.fp8_pipeline,
                      fp8_stage_halves=CONFIG.fp8_stage_halves, heads_in=heads_in,
                      prep_in_kernel=prep_in_kernel, hand_over_first=hand_over_first,
                      rescale_slack=rescale_slack, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC + ("fp8_pipeline", "fp8_stage_halves",
                                                       "wide_widening", "rescale_slack",
                                                       "landing_groups", "gather_by"))
def sparse_attention_fp8_ds_mla(q: jax.Array, nope: jax.Array, tile_scales: jax.Array,
                                rope: jax.Array, slots: jax.Array, *, scale: float,
                                num_splits: int | None = None, auto_barriers: bool = False,
                                gather: str = CONFIG.gather,
                                split_rule: str = CONFIG.split_rule,
                                fp8_pipeline: str | None = CONFIG.fp8_pipeline,
                                fp8_stage_halves: int = CONFIG.fp8_stage_halves,
                                heads_in: str | None = CONFIG.heads_in,
                                prep_in_kernel: bool | None = CONFIG.prep_in_kernel,
                                wide_widening: bool = CONFIG.wide_widening,
                                rescale_slack: float | None = CONFIG.rescale_slack,
                                landing_groups: int = CONFIG.landing_groups,
                                gather_by: str | None = CONFIG.gather_by,
                                interpret: bool | plgpu.InterpretGPUParams = False
                                ) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA over an fp8_ds_mla cache, widened to bf16 once per gathered row.

  q [T, N, L+R] bf16; nope [num_blocks, page, L] float8_e4m3fn; tile_scales [num_blocks, page,
  L/128] float32 (row value = nope * its tile's scale, a power of two); rope [num_blocks, page, R]
  bfloat16; slots and options as in `sparse_attention`; fp8_pipeline ("serial", "half_rows",
  "in_place", or None: `default_fp8_pipeline`'s pick for these shapes, num_splits, split_rule and
  gather) and fp8_stage_halves: `MosaicSparseConfig`'s; heads_in too ("n" with fp8_pipeline "serial"
  or "in_place" named; None: `default_heads_in`, "m") and prep_in_kernel too (None: True with the
  cp_async gather up to FP8_PREP_MAX_ROWS rows, else False) and wide_widening, rescale_slack
  ("register_a", heads in N, ignores it), landing_groups and gather_by too. Returns o
  [T, N, L] bf16 and lse [T, N] float32.
  """
  nb, page, lora = nope.shape
  if fp8_pipeline is None and heads_in != "m" and prep_in_kernel is not False:
    _check(q, slots, lora, num_splits, scale)
    if default_fp8_pipeline(q.shape[0], q.shape[1], slots.shape[1], num_splits=num_splits,
                            split_rule=split_rule, gather=gather,
                            head_dims=(lora, q.shape[2] - lora)) == "register_a":
      fp8_pipeline = "register_a"
  if fp8_pipeline == "register_a":
    MosaicSparseConfig(gather, split_rule, fp8_pipeline, fp8_stage_halves, heads_in,
                       prep_in_kernel, wide_widening, rescale_slack=rescale_slack,
                       landing_groups=landing_groups, gather_by=gather_by)  # checks them
    if heads_in == "m" or gather != "cp_async" or prep_in_kernel is False:
      raise ValueError(f"fp8_pipeline \"register_a\" runs heads in N, the cp_async gather and "
                       f"the slot prep in the kernel; got heads_in={heads_in!r}, "
                       f"gather={gather!r}, prep_in_kernel={prep_in_kernel!r}")
    register_a.check_args(q, nope, tile_scales, rope, slots, num_splits)
    return register_a.sparse_attention_fp8_ds_mla(q, nope, tile_scales, rope, slots, scale=scale,
                                                  interpret=interpret)
  _check(q, slots, lora, num_splits, scale)
  if (nope.dtype != F8 or tile_scales.dtype != jnp.float32 or rope.dtype != jnp.bfloat16
      or tile_scales.shape != (nb, page, lora // DS_MLA_TILE) or rope.shape[:2] != (nb, page)
      or lora % DS_MLA_TILE or q.shape[2] != lora + rope.shape[2]):
    raise ValueError(f"want nope [NB, BS, L] e4m3 (L a multiple of {DS_MLA_TILE}), tile_scales "
                     f"[NB, BS, L/{DS_MLA_TILE}] f32, rope [NB, BS, R] bf16 and q [T, N, L+R]; got "
                     f"{nope.dtype.name}{nope.shape}, {tile_scales.dtype.name}{tile_scales.shape}, "
                     f"{rope.dtype.name}{rope.shape}, q {q.shape}")
  MosaicSparseConfig(gather, split_rule, fp8_pipeline, fp8_stage_halves, heads_in,
                     prep_in_kernel, wide_widening, rescale_slack=rescale_slack,
                     landing_groups=landing_groups, gather_by=gather_by)  # checks them
  if prep_in_kernel is None:
    prep_in_kernel = gather == "cp_async" and q.shape[0] <= FP8_PREP_MAX_ROWS
  if prep_in_kernel and gather != "cp_async":
    raise ValueError(f"prep_in_kernel with fp8_ds_mla takes the cp_async gather (bulk copies of "
                     f"4-byte tile scales are under a bulk copy's 16-byte box), got {gather!r}")
  if heads_in is None:
    heads_in = default_heads_in(q.shape[0], q.shape[1], slots.shape[1], fp8=True,
                                num_splits=num_splits, split_rule=split_rule)
  if heads_in == "n":
    num_splits = heads_n_splits(num_splits)
  if heads_in == "n" and fp8_pipeline not in HEADS_N_FP8_PIPELINES:
    raise ValueError(f"heads_in=\"n\" takes fp8_pipeline {' or '.join(HEADS_N_FP8_PIPELINES)} "
                     f"(named: the default picks per shape), whose consumers step 64 slots; got "
                     f"{fp8_pipeline!r} (\"half_rows\" steps 32, under wgmma's M of 64)")
  if fp8_pipeline is None:
    fp8_pipeline = default_fp8_pipeline(q.shape[0], q.shape[1], slots.shape[1],
                                        num_splits=num_splits, split_rule=split_rule,
                                        gather=gather)
  if gather_by is None:
    gather_by = default_gather_by(q.shape[0])
  num_slots = nb * page
  # Rows as 128-byte chunks [S, C, w], what either gather copies.
  chunked = lambda x: x.reshape(num_slots, -1, _CHUNK_BYTES // x.dtype.itemsize)
  return _sparse_call(q, slots, (chunked(nope), chunked(rope), tile_scales.reshape(num_slots, -1)),
                      scale=scale, lora=lora, num_slots=num_slots, fp8=True, num_splits=num_splits,
                      auto_barriers=auto_barriers, gather=gather, split_rule=split_rule,
                      fp8_pipeline=fp8_pipeline, fp8_stage_halves=fp8_stage_halves,
                      heads_in=heads_in, prep_in_kernel=prep_in_kernel, interpret=interpret,
                      wide_widening=wide_widening, rescale_slack=rescale_slack,
                      landing_groups=landing_groups, gather_by=gather_by)
