"""DSA sparse attention over an fp8_ds_mla cache at 16 or 32 heads, the e4m3 rows as wgmma operands
(Hopper GPUs, Pallas lowered through Mosaic GPU).

`mosaic_sparse`'s contract (`sparse_attention_fp8_ds_mla` with fp8_pipeline="register_a" runs
this kernel): every head of a token attends to the cache rows its top-k slots name; -1 and
out-of-range slots are skipped and never read; a row with no valid slot gives o = 0, lse = -inf.
Built as mosaic_decode's fp8_pipeline="register_a" with gathered rows instead of pages, so no row
is widened to bf16 in shared memory and no head is padding (benchmarks/RESULTS.md, "DSA sparse
attention (pallas_mosaic)", "Session 26 (CPU)" and "Session 27"). One program (CTA) a token, its
16 or 32 heads as wgmma's N, three warpgroups:
- memory (warpgroup 2): per step of 64 slots, each lane gathers its part of the 64 rows with
  16-byte `cp.async` copies (`_gather_rows`) into a ring of _RING slots: the e4m3 NoPE rows
  [64, 512] (64-byte swizzled, as wgmma reads fp8 A operands), the bf16 RoPE rows [64, 64], the
  rows' tile scales [4, 64] f32 (the step's slot list fetched by a bulk copy two steps before,
  into a ring of _INDEX_RING); an invalid slot copies 0 bytes (zeros, nothing read). A step is
  handed over (ready) once _LANDING_LAG later steps are issued and its group has landed, so up
  to _LANDING_LAG + 1 steps are in flight.
- scores (warpgroup 0): q split exactly into e4m3 hi and lo parts per head
  (`e4m3_operands.split_queries`, its NoPE columns; the RoPE columns stay bf16), then per step
  S^T [64 slots, heads] = sum over the 4 scale tiles j of scale[:, j] * (K_j hi^T + 2^-4 K_j lo^T)
  (one fp8 wgmma of N = 2 x heads a tile straight from the e4m3 slot, each tile its own
  accumulator: DeepGEMM's 128-column promotion, Hopper's fp8 wgmma keeping ~14 bits as it adds)
  + K_rope q_rope^T (bf16 wgmma); the masked online softmax over the slots (a cross-warp row max,
  partial row sums); P^T (f16) and the rescale factors to warpgroup 1.
- values (warpgroup 1): O^T [512, heads] += V^T P^T, V^T's f16 fragments from 16-byte loads of the
  e4m3 slot times each token's tile scale (`e4m3_operands.wide_value_tiles`: a warp's rows all lie
  in one scale tile), as wgmma's register A; at the end the output rows are staged in the value
  columns' order (`e4m3_operands.store_wide_values`).

`interpret=True` (or an `InterpretGPUParams`) runs the same kernel in Mosaic GPU's interpreter,
which runs no lane-level code: there the rows are gathered by one bulk copy a row and part, q is
split by `e4m3_operands.e4m3_queries` from a bf16 copy of the row, V^T's tiles go through shared
memory, and the output's columns are put back in order after the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, nvvm

from pallas_kernels.common import (DS_MLA_TILE, F8, HEADS_N_TILES, HOPPER_SMEM_BYTES, LOG2E,
                                   REDUCTION_BYTES_PER_8_HEADS, check_softmax_scale,
                                   check_sparse_args, hand_over_p, in_phase,
                                   mosaic_compiler_params, row_broadcast, run_scores, run_values,
                                   smem_bytes, softmax_step, swizzled, SWIZZLE)
from pallas_kernels.e4m3_operands import (E4M3_LO_SCALE, FP8_COLS, STEP, WIDE_VALUE_COLS,
                                          WIDE_VALUE_GROUP, WIDE_VALUE_TILES_IN_FLIGHT,
                                          e4m3_queries, split_queries, store_wide_values,
                                          wide_value_order, wide_value_tiles)
from pallas_kernels.mosaic_lanes import (WARPGROUP_THREADS, cp_async_wait, read_only_ref, row_steps,
                                         swizzled_unit_offset, warpgroup_thread)

_RING = 4  # row slots: 41 KB each (32 KB e4m3 NoPE, 8 KB RoPE, 1 KB scales)
# Steps' slot lists in shared memory, each fetched (one bulk copy) _INDICES_AHEAD steps before its
# gather and read until warpgroup 0 has masked its scores: a ring entry is refilled once the row
# slot _RING steps back is free, by then read.
_INDEX_RING = 8
_INDICES_AHEAD = 2
# Steps issued after a step before it is handed over: its group has landed once at most this many
# later groups are in flight, and the memory warpgroup waits for that before its next issue. H200
# (session 27, T=128 over 1M tokens, in turn, us): 1: N=16 64.0, N=32 86.5; 2: 68.1, 88.4; 3 (a
# hand-off waiting for the consumers to free the slot of step + 3): 89.0, 121.2.
_LANDING_LAG = 1
# Value products a warpgroup 1 keeps running (each pins its register A tile), by heads: the
# decode's at 16 (`e4m3_operands.WIDE_VALUE_TILES_IN_FLIGHT`); at 32, where O^T takes 128
# registers, one (H200, session 27: 83.1 us against the decode's 2 at 88.4; ptxas spilled in the
# step loops with 2).
_VALUE_TILES_IN_FLIGHT = {16: WIDE_VALUE_TILES_IN_FLIGHT[16], 32: 1}
_ROPE_COLS = 64
_VALUE_WGS = 2
_REGS = (232, 40)  # (consumer, memory) registers a thread: the memory warpgroup only copies
_SEG = 16  # bytes a lane copies per cp.async
_HEADS = HEADS_N_TILES  # the heads a program takes: wgmma's N (`e4m3_operands`' passes by heads)


def _gather_rows(slots, nope, rope, scales, nope_dst, rope_dst, scales_dst, *, num_slots):
  """Issues one step's gather as one cp.async group of the memory warpgroup's 128 lanes.

  slots [64] int32 (shared memory: the token's raw slots of this step; -1 or >= num_slots invalid,
  the compare unsigned); nope [S, 512] e4m3, rope [S, 64] bf16, scales [S, 4] f32 (GMEM, the
  cache); nope_dst [64, 512] e4m3 (tiled (8, 64), 64-byte swizzled), rope_dst [64, 64] bf16
  (tiled (8, 64), 128-byte swizzled), scales_dst [4, 64] f32. An invalid row copies 0 source
  bytes: cp.async fills zeros and reads nothing. Every lane reads all its rows' slots first: the
  copies are memory operations the compilers do not move a load above.
  NoPE: warp w takes rows 16 w .. 16 w + 15 two at a time, lanes 0-15 the first and 16-31 the
  second, each lane 2 of a row's 32 units: a warp instruction reads two rows' 256-byte halves
  and writes 8 64-byte rows of tiles that fill every bank twice (rows r and r + 1 sit 64 bytes
  apart). RoPE: 4 rows an instruction, 8 lanes a row. Scales: rows x 4 4-byte copies, 2 a lane
  (cp.async's .ca; .cg takes 16 bytes only)."""
  rows, lora = nope_dst.shape
  tiles = scales_dst.shape[0]
  nope_t = (plgpu.TilingTransform((8, FP8_COLS)), plgpu.SwizzleTransform(FP8_COLS))
  rope_t = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))

  @plgpu.inline_mgpu(arg_types=(read_only_ref(),) * 4 + (
      plgpu.RefType(nope_t), plgpu.RefType(rope_t), plgpu.RefType()))
  def issue(_, slots, nope, rope, scales, nope_dst, rope_dst, scales_dst):
    i32, i64, i8 = (ir.IntegerType.get_signless(w) for w in (32, 64, 8))
    f32 = ir.F32Type.get()
    c32 = lambda v: arith.constant(i32, v)
    tid, lane, warp = warpgroup_thread()
    global_ptr = llvm.PointerType.get(address_space=1)
    gmem = lambda ref: llvm.addrspacecast(global_ptr, mgpu_utils.memref_ptr(ref))
    slots_base = mgpu_utils.memref_ptr(slots)

    def row_of(r):
      """(row, valid) of step row r: row 0 where the slot is invalid."""
      row = llvm.load(i32, mgpu_utils.getelementptr(slots_base, [r], i32))
      valid = arith.cmpi(arith.CmpIPredicate.ult, row, c32(num_slots))
      return arith.select(valid, row, c32(0)), valid

    warp_rows = rows // 4
    first = arith.muli(warp, c32(warp_rows))
    rope_units = _ROPE_COLS * 2 // _SEG
    rope_rows = 32 // rope_units  # rows a warp instruction
    # (step row, cp.async source, destination base, row bytes, swizzle, unit) of each 16-byte copy
    nope_rows = [arith.addi(first, arith.addi(c32(2 * g), arith.divui(lane, c32(16))))
                 for g in range(warp_rows // 2)]
    rope_step_rows = [arith.addi(first, arith.addi(c32(rope_rows * g),
                                                   arith.divui(lane, c32(rope_units))))
                      for g in range(warp_rows // rope_rows)]
    scale_elems = [arith.addi(tid, c32(g * WARPGROUP_THREADS))  # row e / 4, tile e % 4
                   for g in range(rows * tiles // WARPGROUP_THREADS)]
    scale_rows = [arith.divui(e, c32(tiles)) for e in scale_elems]
    loaded = [row_of(r) for r in nope_rows + rope_step_rows + scale_rows]
    nope_of, rope_of, scale_of = (loaded[:len(nope_rows)],
                                  loaded[len(nope_rows):-len(scale_rows)],
                                  loaded[-len(scale_rows):])

    def row_part(src, dst, row_bytes, swizzle, r, row_valid, unit):
      row, valid = row_valid
      src_off = arith.addi(arith.muli(arith.extui(i64, row), arith.constant(i64, row_bytes)),
                           arith.extui(i64, arith.muli(unit, c32(_SEG))))
      nvvm.cp_async_shared_global(
          mgpu_utils.getelementptr(dst, [swizzled_unit_offset(r, unit, row_bytes, swizzle)], i8),
          mgpu_utils.getelementptr(src, [src_off], i8), _SEG, nvvm.LoadCacheModifierKind.CG,
          cp_size=arith.select(valid, c32(_SEG), c32(0)))

    nope_src, nope_base = gmem(nope), mgpu_utils.memref_ptr(nope_dst)
    for r, row_valid in zip(nope_rows, nope_of):
      for k in range(lora // _SEG // 16):
        unit = arith.addi(arith.remui(lane, c32(16)), c32(16 * k))
        row_part(nope_src, nope_base, lora, FP8_COLS, r, row_valid, unit)
    rope_src, rope_base = gmem(rope), mgpu_utils.memref_ptr(rope_dst)
    for r, row_valid in zip(rope_step_rows, rope_of):
      row_part(rope_src, rope_base, _ROPE_COLS * 2, SWIZZLE, r, row_valid,
               arith.remui(lane, c32(rope_units)))
    scales_src, scales_base = gmem(scales), mgpu_utils.memref_ptr(scales_dst)
    for e, r, (row, valid) in zip(scale_elems, scale_rows, scale_of):
      j = arith.remui(e, c32(tiles))
      src = mgpu_utils.getelementptr(
          scales_src, [arith.extui(i64, arith.addi(arith.muli(row, c32(tiles)), j))], f32)
      dst = mgpu_utils.getelementptr(scales_base, [arith.addi(arith.muli(j, c32(rows)), r)], f32)
      nvvm.cp_async_shared_global(dst, src, 4, nvvm.LoadCacheModifierKind.CA,
                                  cp_size=arith.select(valid, c32(4), c32(0)))
    nvvm.cp_async_commit_group()

  issue(slots, nope, rope, scales, nope_dst, rope_dst, scales_dst)


def _kernel(q_ref, idx_ref, nope_ref, rope_ref, scales_ref, o_ref, lse_ref, buffers, q_rope,
            qs_smem, p_smem, row_smem, q_bar, ready, consumed, p_ready, p_free, idx_bar,
            *interpreted, scale, num_slots, interpret):
  # GMEM: q_ref [T, H, L+R] bf16 (H = the program's heads, 16 or 32); idx_ref [T, Kp] int32 (raw
  # slots, -1 padded to whole steps); nope_ref [S, L] e4m3, rope_ref [S, R] bf16, scales_ref
  # [S, L/128] f32 (the cache's rows); o_ref [T, 1, H, L] bf16; lse_ref [T, 1, H] f32.
  # SMEM: buffers = union of (q_e4m3 [2H, L] e4m3 (hi rows, then lo), and the ring: nope
  # [ring, 64, L] e4m3, rope [ring, 64, R] bf16, scales [ring, L/128, 64] f32; and the steps' slot
  # lists idx_smem [_INDEX_RING, 64] int32), live while the steps run, and (o_smem [1, H, L]
  # bf16, lse_smem [H] f32), live after; q_rope [H, R] bf16; qs_smem [H] f32 (each head's scale-back
  # of its e4m3 parts); p_smem [H, 64] f16 (P^T, stored transposed); row_smem [H] f32 (the rescale
  # factors, then l).
  # Interpreter only: qb_smem [H, L+R] bf16 (q's row, split by e4m3_queries) and a_smem [64, 64]
  # f16 (warpgroup 1's V^T tile: the interpreter's wgmma takes shared-memory operands only).
  # Barriers: q_bar (q's RoPE columns, or the interpreter's row); ready [ring] (a slot's rows
  # landed); consumed [ring] (both consumers done with a slot); p_ready, p_free (the P hand-off);
  # idx_bar [_INDEX_RING] (a step's slot list landed).
  (q_e4m3, nope, rope, scales, idx_smem), (o_smem, lse_smem) = buffers
  ring, _, lora = nope.shape
  tiles = scales.shape[1]
  tile_h = p_smem.shape[0]
  t, wg = lax.axis_index("tokens"), lax.axis_index("wg")
  group = WIDE_VALUE_GROUP[tile_h]
  in_flight = _VALUE_TILES_IN_FLIGHT[tile_h]
  acc_shape = (FP8_COLS, tile_h)  # an O^T tile: 64 value columns (wgmma's M), the heads
  value_tiles = lora // FP8_COLS
  heads_layout = plgpu.Layout.WGMMA.reduce(0)  # one value a score column (head)
  slots_layout = plgpu.Layout.WGMMA.reduce(1)  # one value a score row (slot)
  head_broadcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [1])
  p_t = p_smem.transpose((1, 0))  # P^T [64 slots, heads] as wgmma's B, written transposed
  if interpret:
    qb_smem, a_smem = interpreted

  def steps():
    """The row's steps of 64 slots up to its last valid one; every warpgroup counts them itself
    (the same count: their barrier phases agree)."""
    return row_steps(idx_ref.at[t], num_slots=num_slots, step=STEP, interpret=interpret)

  @pl.when(wg == 0)
  def _scores():
    plgpu.set_max_registers(_REGS[0], action="increase")
    n = steps()
    # Every program splits its query, with or without a step (a wait under n > 0 made ptxas
    # spill in mosaic_sparse's step loops).
    if interpret:
      plgpu.barrier_wait(q_bar)
      parts, backs = e4m3_queries(qb_smem[:, :lora][None])
      q_e4m3[...] = parts[0]
      qs_smem[...] = backs[0]
      q_rope[...] = qb_smem[:, lora:]
    else:
      split_queries(q_ref.at[t], q_e4m3, qs_smem)
      plgpu.barrier_wait(q_bar)
    plgpu.commit_smem()  # also a warpgroup barrier: every thread's parts are written
    head_scales = plgpu.load(qs_smem, layout=heads_layout)

    def step(i, carry):
      m, l, acc = carry
      slot, entry = lax.rem(i, ring), lax.rem(i, _INDEX_RING)
      plgpu.barrier_wait(idx_bar.at[entry])  # long landed: a warpgroup waits on every phase
      in_phase("wg0_rows_wait", plgpu.barrier_wait, ready.at[slot])

      def scores(*acc_refs):
        """S^T [64, heads]: the 4 NoPE tiles' fp8 products, each into its own accumulator
        [64, 2 x heads] (hi, lo) read once the next is issued and scaled per slot row, then the
        RoPE's bf16 product."""
        nope_refs, rope_ref = acc_refs[:-1], acc_refs[-1]
        tile_scales = [plgpu.load(scales.at[slot, j], layout=slots_layout) for j in range(tiles)]
        total = None
        for j in range(tiles + 1):
          if j < tiles:
            cols = pl.ds(j * DS_MLA_TILE, DS_MLA_TILE)
            plgpu.wgmma(nope_refs[j], nope.at[slot, :, cols], q_e4m3.at[:, cols].transpose((1, 0)))
          else:
            plgpu.wgmma(rope_ref, rope.at[slot], q_rope.transpose((1, 0)))
          if j:  # tile j - 1: done once at most this product is in flight
            x = plgpu.wgmma_accumulator_load(nope_refs[j - 1], wait_n=1)
            x = (x[:, :tile_h] + x[:, tile_h:] * E4M3_LO_SCALE) * row_broadcast(
                tile_scales[j - 1], (STEP, tile_h))
            total = x if total is None else total + x
        return total * head_broadcast(head_scales, total.shape) + rope_ref[...]

      s = in_phase("wg0_scores", pl.run_scoped, scores,
                   *[plgpu.ACC((STEP, 2 * tile_h), jnp.float32)] * tiles,
                   plgpu.ACC((STEP, tile_h), jnp.float32))
      idx = plgpu.load(idx_smem.at[entry], layout=slots_layout)
      valid = lax.broadcast_in_dim((idx >= 0) & (idx < num_slots), s.shape, [0])
      # A select, not a multiply: an invalid row's score never reaches P.
      m_new, alpha, p, l = in_phase("wg0_softmax", softmax_step, jnp.where(valid, s, -jnp.inf),
                                    m, l, heads_axis=1, scale=scale * LOG2E)
      in_phase("wg0_hand_off", hand_over_p, i, p, alpha, p_t, row_smem, p_ready, p_free)
      plgpu.barrier_arrive(consumed.at[slot])
      return m_new, l, acc

    run_scores(n, step, (), row_smem=row_smem, p_ready=p_ready, p_free=p_free,
               lse_smem=lse_smem, lse_gmem=lse_ref.at[t, 0], heads_axis=1,
               partial_sums=(STEP, tile_h))

  def interpreted_values(acc, slot):
    """The interpreter's O^T += V^T P^T: the slot's values times their tile scales, in
    `wide_value_order` (the GPU's fragments), a tile at a time through a_smem into fresh
    accumulators."""
    values = plgpu.load(nope.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    scaled = jnp.concatenate([
        values[:, j * DS_MLA_TILE:(j + 1) * DS_MLA_TILE] * row_broadcast(
            plgpu.load(scales.at[slot, j], layout=slots_layout), (STEP, DS_MLA_TILE))
        for j in range(tiles)], axis=1)
    ordered = wide_value_order(scaled.astype(jnp.float16), group)
    out = []
    for c, part in enumerate(acc):
      a_smem[...] = ordered[:, c * FP8_COLS:(c + 1) * FP8_COLS].T
      plgpu.commit_smem()  # plain stores read next by wgmma (the async proxy)

      def product(acc_ref):  # acc_ref: acc_shape f32
        plgpu.wgmma(acc_ref, a_smem, p_t)
        return acc_ref[...]

      out.append(part + pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32)))
    return tuple(out)

  @pl.when(wg == 1)
  def _values():
    plgpu.set_max_registers(_REGS[0], action="increase")
    n = steps()

    def accumulate(acc, alpha, slot):
      """acc * alpha + V^T P^T: the value tiles loaded and scaled `group` at a time, each product
      issued as it comes, at most `in_flight` of them running (a register A operand stays pinned
      until its product completes)."""
      acc = tuple(part * head_broadcast(alpha, part.shape) for part in acc)
      if interpret:
        return interpreted_values(acc, slot)

      def products(acc_refs):
        for first in range(0, value_tiles, group):
          loaded = wide_value_tiles(nope.at[slot], first, group, scales=scales.at[slot])
          for c, a in enumerate(loaded, first):
            plgpu.wgmma(acc_refs[c], a, p_t)
            if c >= in_flight:
              plgpu.wgmma_wait(in_flight)

      return tuple(pl.run_state(products)(tuple(plgpu.ACC.init(part) for part in acc)))

    zeros = tuple(plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
                  for _ in range(value_tiles))
    run_values(n, ring, accumulate, zeros, ready=ready, consumed=consumed, row_smem=row_smem,
               p_ready=p_ready, p_free=p_free, o_smem=o_smem.at[0], o_gmem=o_ref.at[t, 0],
               heads_axis=1,
               store=None if interpret else functools.partial(store_wide_values,
                                                              o_rows=o_smem.at[0]))

  @pl.when(wg == _VALUE_WGS)
  def _memory():
    plgpu.set_max_registers(_REGS[1], action="decrease")
    if interpret:
      plgpu.copy_gmem_to_smem(q_ref.at[t], qb_smem, q_bar)
    else:
      plgpu.copy_gmem_to_smem(q_ref.at[t, :, pl.ds(lora, q_rope.shape[1])], q_rope, q_bar)
    n = steps()

    def fetch_indices(i):
      entry = lax.rem(i, _INDEX_RING)
      plgpu.copy_gmem_to_smem(idx_ref.at[t, pl.ds(i * STEP, STEP)], idx_smem.at[entry],
                              idx_bar.at[entry])

    def gather(i, slot):
      entry = lax.rem(i, _INDEX_RING)
      plgpu.barrier_wait(idx_bar.at[entry])
      if not interpret:
        _gather_rows(idx_smem.at[entry], nope_ref, rope_ref, scales_ref, nope.at[slot],
                     rope.at[slot], scales.at[slot], num_slots=num_slots)
        return

      # One bulk copy a row and part, each an arrival on ready (a copy at row -1 or past the
      # cache lies outside it: zeros, nothing read).
      @pl.loop(0, STEP)
      def _(r):
        row = idx_smem[entry, r]
        plgpu.copy_gmem_to_smem(nope_ref.at[pl.ds(row, 1)], nope.at[slot, pl.ds(r, 1)],
                                ready.at[slot])
        plgpu.copy_gmem_to_smem(rope_ref.at[pl.ds(row, 1)], rope.at[slot, pl.ds(r, 1)],
                                ready.at[slot])
        for j in range(tiles):
          plgpu.copy_gmem_to_smem(scales_ref.at[pl.ds(row, 1), j],
                                  scales.at[slot, j, pl.ds(r, 1)], ready.at[slot])

    def hand_over(i):
      """Step i's group has landed: the fence makes the lanes' writes visible to wgmma's async
      proxy, its warpgroup barrier to every lane."""
      plgpu.commit_smem()
      plgpu.barrier_arrive(ready.at[lax.rem(i, ring)])

    for i in range(min(_INDICES_AHEAD, idx_ref.shape[1] // STEP)):  # (steps the row may have)
      pl.when(i < n)(functools.partial(fetch_indices, i))

    @pl.loop(0, n)
    def _(i):
      slot = lax.rem(i, ring)
      # The slot's last step is done, and so is its slot list's use by warpgroup 0 (entry
      # i + _INDICES_AHEAD held step i + _INDICES_AHEAD - _INDEX_RING, before it).
      in_phase("memory_slot_wait", pl.when(i >= ring),
               lambda: plgpu.barrier_wait(consumed.at[slot]))
      pl.when(i + _INDICES_AHEAD < n)(functools.partial(fetch_indices, i + _INDICES_AHEAD))
      in_phase("memory_gather", gather, i, slot)
      if not interpret:
        @pl.when(i >= _LANDING_LAG)
        def _():
          in_phase("memory_landing_wait", cp_async_wait, _LANDING_LAG)
          hand_over(i - _LANDING_LAG)

    if not interpret:
      cp_async_wait(0)

      @pl.loop(jnp.maximum(n - _LANDING_LAG, 0), n)
      def _(i):
        hand_over(i)

    # Sees the last uses of the slots out too (a warpgroup waits on every phase of a barrier).
    @pl.loop(jnp.maximum(n - ring, 0), n)
    def _(i):
      plgpu.barrier_wait(consumed.at[lax.rem(i, ring)])


def fits(num_heads, kv_lora_rank, rope_dim):
  """Whether the kernel takes these shapes: 16 or 32 heads (wgmma's N), 512 NoPE columns (a warp's
  value rows in one scale tile) and 64 RoPE columns."""
  return num_heads in _HEADS and kv_lora_rank == WIDE_VALUE_COLS and rope_dim == _ROPE_COLS


def check_args(q, nope, tile_scales, rope, slots, num_splits=None):
  """ValueError unless this kernel takes these arrays: 16 or 32 heads, a 512-column e4m3 NoPE
  with 4 float32 tile scales and 64 bf16 RoPE columns a row, bf16 q [T, N, 576], one split."""
  check_sparse_args(q, slots, num_splits)
  if q.shape[1] not in _HEADS:
    raise ValueError(f"fp8_pipeline \"register_a\" takes {' or '.join(map(str, _HEADS))} heads "
                     f"(wgmma's N), got {q.shape[1]}")
  nb, page, lora = nope.shape
  if (q.dtype != jnp.bfloat16 or nope.dtype != F8 or tile_scales.dtype != jnp.float32
      or rope.dtype != jnp.bfloat16 or lora != WIDE_VALUE_COLS
      or tile_scales.shape != (nb, page, lora // DS_MLA_TILE)
      or rope.shape != (nb, page, _ROPE_COLS) or q.shape[2] != lora + _ROPE_COLS):
    raise ValueError(f"fp8_pipeline \"register_a\" takes bf16 q [T, N, {WIDE_VALUE_COLS + 64}], "
                     f"nope [NB, BS, {WIDE_VALUE_COLS}] e4m3, tile_scales [NB, BS, 4] f32, rope "
                     f"[NB, BS, {_ROPE_COLS}] bf16; got q {q.dtype.name}{q.shape}, "
                     f"{nope.dtype.name}{nope.shape}, {tile_scales.dtype.name}"
                     f"{tile_scales.shape}, {rope.dtype.name}{rope.shape}")
  if num_splits not in (None, 1):
    raise ValueError(f"fp8_pipeline \"register_a\" runs one split (heads in N store a bf16 "
                     f"output only), got num_splits={num_splits}")


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def sparse_attention_fp8_ds_mla(q: jax.Array, nope: jax.Array, tile_scales: jax.Array,
                                rope: jax.Array, slots: jax.Array, *, scale: float,
                                interpret: bool | plgpu.InterpretGPUParams = False
                                ) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA over an fp8_ds_mla cache (semantics of `mla_jax.reference.sparse_attention`).

  q [T, N, 576] bf16 with N 16 or 32; nope [NB, BS, 512] float8_e4m3fn; tile_scales [NB, BS, 4]
  float32; rope [NB, BS, 64] bf16; slots [T, K] int32 (block * page + offset; -1 or past the
  cache: skipped). interpret: True or a `plgpu.InterpretGPUParams` runs Mosaic GPU's CPU
  interpreter. Returns o [T, N, 512] bf16 and lse [T, N] float32 (natural log); a row with no
  valid slot gives (0, -inf)."""
  check_args(q, nope, tile_scales, rope, slots)
  check_softmax_scale(scale)
  t, n, d = q.shape
  nb, page, lora = nope.shape
  if t == 0:
    return jnp.zeros((t, n, lora), q.dtype), jnp.zeros((t, n), jnp.float32)
  num_slots = nb * page
  kp = max(pl.cdiv(slots.shape[1], STEP), 1) * STEP
  slots = jnp.pad(slots, ((0, 0), (0, kp - slots.shape[1])), constant_values=-1)
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  tiles = lora // DS_MLA_TILE
  # Interpreter: each row and part a bulk copy, every one an arrival on ready.
  arrivals = STEP * (2 + tiles) if interpret else 1
  scratch = [
      plgpu.RefUnion(
          (swizzled((2 * n, lora), F8, FP8_COLS), swizzled((_RING, STEP, lora), F8, FP8_COLS),
           swizzled((_RING, STEP, d - lora), jnp.bfloat16),
           plgpu.SMEM((_RING, tiles, STEP), jnp.float32),
           plgpu.SMEM((_INDEX_RING, STEP), jnp.int32)),
          (swizzled((1, n, lora), jnp.bfloat16), plgpu.SMEM((n,), jnp.float32))),
      swizzled((n, d - lora), jnp.bfloat16), plgpu.SMEM((n,), jnp.float32),
      swizzled((n, STEP), jnp.float16), plgpu.SMEM((n,), jnp.float32),
      plgpu.Barrier(), plgpu.Barrier(num_arrivals=arrivals, num_barriers=_RING),
      plgpu.Barrier(num_arrivals=_VALUE_WGS, num_barriers=_RING), plgpu.Barrier(),
      plgpu.Barrier(), plgpu.Barrier(num_barriers=_INDEX_RING)]
  reduction_bytes = REDUCTION_BYTES_PER_8_HEADS * n // 8
  used = smem_bytes(scratch, reduction_bytes)
  if used > HOPPER_SMEM_BYTES:
    raise ValueError(f"the kernel's shared memory ({used} bytes at {n} heads) exceeds a Hopper "
                     f"block's {HOPPER_SMEM_BYTES}")
  if interpret:  # the interpreter's forms' buffers (it has no shared-memory limit)
    scratch += [plgpu.SMEM((n, d), jnp.bfloat16), swizzled((FP8_COLS, FP8_COLS), jnp.float16)]
  o, lse = plgpu.kernel(
      functools.partial(_kernel, scale=scale, num_slots=num_slots, interpret=bool(interpret)),
      out_type=(jax.ShapeDtypeStruct((t, 1, n, lora), q.dtype),
                jax.ShapeDtypeStruct((t, 1, n), jnp.float32)),
      scratch_types=tuple(scratch),
      grid=(t,),
      grid_names=("tokens",),
      num_threads=_VALUE_WGS + 1,
      thread_name="wg",
      # No automatic barriers: the hand-offs above order every shared-memory read and write.
      compiler_params=mosaic_compiler_params(approx_math=True,
                                             reduction_scratch_bytes=reduction_bytes,
                                             unsafe_no_auto_barriers=True),
      interpret=interpret or None,
      kernel_name=f"mosaic_sparse_ds_mla_register_a_heads_n{n}",
  )(q, slots, nope.reshape(num_slots, lora), rope.reshape(num_slots, d - lora),
    tile_scales.reshape(num_slots, tiles))
  o, lse = o[:, 0], lse[:, 0]
  if interpret:  # the interpreter stores O^T's rows as they are: the columns back in order
    o = wide_value_order(o, WIDE_VALUE_GROUP[n], inverse=True)
  return o, lse
