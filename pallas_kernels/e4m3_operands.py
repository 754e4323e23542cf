"""e4m3 wgmma operands in lane-level Mosaic GPU code, shared by the kernels whose consumers take an
e4m3 cache as wgmma's register A operand with heads in wgmma's N (mosaic_decode's
fp8_pipeline="register_a", mosaic_sparse_register_a's fp8_ds_mla kernel):
- q split exactly into two e4m3 parts per head for fp8 wgmma's B (`e4m3_queries`, the oracle and
  the interpreter's form; `split_queries`, the same bytes computed by warpgroup 0 from q's bf16 row
  in GMEM);
- V^T's f16 A fragments from 16-byte loads of an e4m3 slot, the value columns in
  `wide_value_order` (`wide_value_tiles`; with per-token scales for fp8_ds_mla's tiles);
- the O^T tiles staged into a bf16 [heads, 512] output in the value columns' own order
  (`store_wide_values`).
The interpreter runs none of the lane-level code: the kernels keep a Pallas-level form for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, scf, vector

from pallas_kernels.common import DS_MLA_TILE, F8, SWIZZLE
from pallas_kernels.mosaic_lanes import (WARPGROUP_THREADS, lane_asm, read_only_ref,
                                         swizzled_unit_offset, warpgroup_thread)

STEP = 64  # tokens of an e4m3 slot: wgmma's M in S^T = K Q^T and its K in O^T = V^T P^T
FP8_COLS = 64  # e4m3 columns per shared-memory tile: 64 bytes, the 64-byte swizzle
SWIZZLE_TILE_ROWS = 8  # rows of a tiled (8, 64) shared-memory tile: 512 bytes
# A [64, 64] e4m3 tile's row: 64 bytes, 4 units of 16 the 4 lanes of a quad (lane % 4) load.
WIDE_UNITS = 4


# wide_values: V^T's tile c [64 value columns (M), 64 tokens (K)] as wgmma's register A holds on
# thread (warp w, lane l) rows m = 16w + l/4 + 8h (h < 2); the kernel gives row m of tile c a value
# column of unit u = 8w + l/4 (the 16 columns 16u ..), byte 2c + h of it (`wide_value_order`), so
# that over the 8 tiles of the 512 value columns a thread's 16 rows are the 16 bytes of one unit
# of a token's row: wide loads a token for every tile, where WGMMA_TRANSPOSED's loads take a token
# pair's bytes per tile and a relayout through shuffles (`value_tile`).
WIDE_VALUE_COLS = 512
# bf16 columns of q (`split_queries`) or of an output row (`store_wide_values`) a lane takes as
# one unit: 32 bytes.
_UNIT_COLS = 16
_WIDE_VALUE_TILES = WIDE_VALUE_COLS // FP8_COLS
# Tiles converted from one pass of loads (16-byte loads at 8, 8-byte at 4), and value tiles in
# flight (`_VALUE_TILES_IN_FLIGHT`), by heads in the tile: a pass's raw bytes (2 registers a tile
# and token pair, 64 at 8) stay live until its tiles are converted, beside the O^T accumulators
# (64 registers a thread at 16 heads, 128 at 32). Spill-free step loops with ptxas 13.5; 4 tiles
# in flight spilled in them at 16 heads, 8-tile passes at 32.
WIDE_VALUE_GROUP = {16: 8, 32: 4}
WIDE_VALUE_TILES_IN_FLIGHT = {16: 3, 32: 2}
# prmt selectors interleaving two rows' words a, b bytewise (bytes 0-3 of a, 4-7 of b): [a0, b0,
# a1, b1] and [a2, b2, a3, b3], or with b the even row [b0, a0, b1, a1] and [b2, a2, b3, a3].
_EVEN_FIRST_SELECTORS, _ODD_FIRST_SELECTORS = (0x5140, 0x7362), (0x1504, 0x3726)


def wide_value_order(x: jax.Array, group: int, inverse: bool = False) -> jax.Array:
  """x [..., 512] (value columns) in the order of wide_values' O^T tiles loaded `group` (8 or 4)
  tiles a pass: output column 64c + 16w + 8h + r (tile c's row 16w + r + 8h) is byte 2c + h of
  unit u = 8w + r, value column 16u + 2c + h; with 8-byte passes (group 4), units with an odd u / 2
  hold tiles 0-3 in bytes 8-15 and 4-7 in 0-7 (byte 2c + h XOR 8), so that the 16 lanes of a
  half-warp phase read 16 distinct 8-byte bank pairs. inverse: the kernel's output order back to
  the value columns'. Reshapes, a transpose and a flip only: the interpreter form runs it in the
  kernel, which takes no array constants."""
  *lead, d = x.shape
  if d != WIDE_VALUE_COLS:
    raise ValueError(f"wide_value_order takes {WIDE_VALUE_COLS} columns, got {d}")
  if group not in (_WIDE_VALUE_TILES, _WIDE_VALUE_TILES // 2):
    raise ValueError(f"wide_values loads 8 or 4 tiles a pass, got {group}")

  def rotate(y):  # y [..., s, b, k, c, h]: k XOR s (its own inverse)
    if group == _WIDE_VALUE_TILES:
      return y
    even, odd = (lax.index_in_dim(y, i, -5, keepdims=False) for i in range(2))
    return jnp.stack([even, jnp.flip(odd, -3)], axis=-5)

  # Value column 128w + 64a + 32s + 16b + 8k + 2c + h (unit u = 8w + 4a + 2s + b, byte 8k + 2c +
  # h) is output column 64 (4k' + c) + 16w + 8h + 4a + 2s + b, k' = k XOR s with group 4, else k.
  if inverse:
    x = x.reshape(*lead, 2, 4, 4, 2, 2, 2, 2)
    return rotate(jnp.einsum("...kcwhasb->...wasbkch", x)).reshape(*lead, d)
  x = rotate(x.reshape(*lead, 4, 2, 2, 2, 2, 4, 2))
  return jnp.einsum("...wasbkch->...kcwhasb", x).reshape(*lead, d)


def store_wide_values(tiles, o_rows):
  """wide_values' output tiles (the 8 O^T tiles [64 rows, heads] bf16, their rows the value
  columns in `wide_value_order`) written into the output staging o_rows [heads, 512] bf16 (tiled
  (8, 64), 128-byte swizzled) in the value columns' own order, so no XLA transpose follows the
  call. Thread (warp w, lane l) holds rows 16w + l/4 + 8h of every tile, all 16 bytes of unit
  u = 8w + l/4 (`wide_value_order`): for each of its heads (columns 8j + 2 (l % 4) + e) it packs
  value columns 16u .. 16u + 15 (column 16u + b from tile (b XOR f) / 2, row half b % 2; f = 8
  where the 8-byte passes rotate the unit, else 0) into two 16-byte stores. Straight to GMEM
  instead, ptxas (13.5) spilled two barrier addresses into warpgroup 0's step loop (N=16:
  1.001x; benchmarks/RESULTS.md, session 26). Lane-level code; the interpreter stores O^T
  transposed and the caller reorders."""
  heads, cols = o_rows.shape
  group = WIDE_VALUE_GROUP[heads]
  layout = plgpu.Layout.WGMMA
  transforms = (plgpu.TilingTransform((SWIZZLE_TILE_ROWS, SWIZZLE // 2)),
                plgpu.SwizzleTransform(SWIZZLE))

  @plgpu.inline_mgpu(arg_types=((layout,) * len(tiles), plgpu.RefType(transforms)))
  def store(_, tiles, o_rows):
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    c32 = lambda v: arith.constant(i32, v)
    _, lane, warp = warpgroup_thread()
    r, q = arith.divui(lane, c32(4)), arith.remui(lane, c32(4))
    unit = arith.addi(arith.muli(warp, c32(8)), r)
    # [tile][register 2j + h]: rows + 8h, columns 8j + 2q, + 1 as i32 (two bf16)
    regs = [[mgpu_utils.bitcast(v, i32) for v in t.registers.flat] for t in tiles]
    rotated = None
    if group != _WIDE_VALUE_TILES:  # units with an odd u / 2: tile k XOR 4 for word k
      rotated = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(unit, c32(2)), c32(0))
    base = mgpu_utils.memref_ptr(o_rows)
    words_type = ir.VectorType.get((4,), i32)
    for j in range(heads // 8):
      for e, selector in enumerate((0x5410, 0x7632)):
        head = arith.addi(arith.muli(q, c32(2)), c32(8 * j + e))
        words = []
        for k in range(_WIDE_VALUE_TILES):  # columns 16u + 2k, + 1: tile k (or k XOR 4), h 0, 1
          pick = lambda c: lane_asm(f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
                                    regs[c][2 * j], regs[c][2 * j + 1])
          word = pick(k)
          if rotated is not None:
            word = arith.select(rotated, pick(k ^ 4), word)
          words.append(word)
        for half in range(2):  # the unit's two 16-byte halves
          offset = swizzled_unit_offset(head, arith.addi(arith.muli(unit, c32(2)), c32(half)),
                                        2 * cols, SWIZZLE)
          llvm.store(vector.from_elements(words_type, words[4 * half:4 * half + 4]),
                     mgpu_utils.getelementptr(base, [offset], i8), alignment=16)

  store(tuple(tiles), o_rows)


def wide_value_tiles(slot, first: int, count: int, scales=None):
  """V^T tiles first .. first + count - 1 [64 value columns, 64 tokens] of an e4m3 slot [64, D]
  (tiled (8, 64), 64-byte swizzled) as f16 WGMMA-layout A fragments with their columns in
  `wide_value_order` (count: 8 or 4, its `group`). Per token pair (t, t + 1) of its fragment, a
  thread loads its unit's bytes of the pass's tiles (2 a tile) of both rows (one load a row),
  interleaves the rows' words bytewise (prmt) and converts each (t, t + 1) byte pair (cvt e4m3x2
  -> f16x2): register j of row half h of tile c. Lanes with an odd lane / 4 load their odd row
  first, so that the lanes of a phase (8 of a 16-byte load) read distinct bank groups (every lane
  reads row 2 (lane % 4) + its parity, unit (8w + lane / 4) % 4 swizzled with lane % 4; 8-byte
  loads: and their half of the unit, rotated by lane / 8). Lane-level code (`plgpu.inline_mgpu`);
  the interpreter does not run it.
  scales (fp8_ds_mla): [D / 128, 64] f32, each token's scale of each 128-column tile: the f16
  values are multiplied by their token's scale (mul.f16x2 on each converted token pair; exact
  for power-of-two scales that keep the value an f16). A thread's rows are the 16 columns of unit
  8 w + lane / 4, all in tile w (D = 512: 4 tiles for the 4 warps), so it takes the scales of its
  16 tokens in tile w: one 8-byte load a token pair."""
  tiles = slot.shape[-1] // FP8_COLS
  if scales is not None and (slot.shape[-1] != WIDE_VALUE_COLS
                             or scales.shape != (WIDE_VALUE_COLS // DS_MLA_TILE, STEP)):
    raise ValueError(f"scaled value tiles take a [64, {WIDE_VALUE_COLS}] slot and [4, 64] scales, "
                     f"got {slot.shape} and {scales.shape}")
  tile_bytes = SWIZZLE_TILE_ROWS * FP8_COLS
  layout = plgpu.Layout.WGMMA
  transforms = (plgpu.TilingTransform((SWIZZLE_TILE_ROWS, FP8_COLS)),
                plgpu.SwizzleTransform(FP8_COLS))
  fragment = plgpu.ShapeDtypeStruct((FP8_COLS, STEP), jnp.float16, layout=layout)

  scaled = scales is not None

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),) + (plgpu.RefType(),) * scaled,
                     return_type=(fragment,) * count)
  def load(_, slot, *scales):
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    c32 = lambda v: arith.constant(i32, v)
    _, lane, warp = warpgroup_thread()
    quad, group = arith.remui(lane, c32(WIDE_UNITS)), arith.divui(lane, c32(WIDE_UNITS))
    if scaled:  # f16x2 (scale of token 8j + 2 quad, of the next) in tile `warp`, for each j
      f32x2 = ir.VectorType.get((2,), ir.F32Type.get())
      scale_base = mgpu_utils.getelementptr(
          mgpu_utils.memref_ptr(scales[0]),
          [arith.addi(arith.muli(warp, c32(STEP)), arith.muli(quad, c32(2)))], ir.F32Type.get())
      token_scales = []
      for j in range(8):
        pair = llvm.load(f32x2, mgpu_utils.getelementptr(scale_base, [c32(8 * j)],
                                                         ir.F32Type.get()), alignment=8)
        token_scales.append(lane_asm("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f",
                                     *(vector.extract(pair, [], [e]) for e in range(2))))
    unit = arith.addi(arith.muli(warp, c32(8)), group)  # of the row's 32 value units
    odd_first = arith.remui(group, c32(2))
    # Byte 2c of a unit is tile c's (2 bytes a tile), 8-byte passes rotated (`wide_value_order`).
    first_byte = c32(2 * first)
    if count < _WIDE_VALUE_TILES:
      first_byte = arith.xori(first_byte, arith.andi(lane, c32(8)))  # 8 at an odd lane / 8
    # Token 8j + 2 quad + e is row 2 quad + e of 8-row tile j: the 64-byte swizzle XORs its 16-byte
    # unit with (row % 8) / 2 = quad.
    offset = arith.addi(
        arith.addi(arith.muli(arith.divui(unit, c32(WIDE_UNITS)), c32(tile_bytes)),
                   arith.muli(quad, c32(2 * FP8_COLS))),
        arith.addi(arith.muli(arith.xori(arith.remui(unit, c32(WIDE_UNITS)), quad), c32(16)),
                   first_byte))
    odd_offset = arith.muli(odd_first, c32(FP8_COLS))
    base = mgpu_utils.memref_ptr(slot)
    rows_first = (arith.addi(offset, odd_offset),  # the lane's first and second rows
                  arith.subi(arith.addi(offset, c32(FP8_COLS)), odd_offset))
    is_odd = arith.cmpi(arith.CmpIPredicate.ne, odd_first, c32(0))
    selectors = [arith.select(is_odd, c32(odd), c32(even))
                 for even, odd in zip(_EVEN_FIRST_SELECTORS, _ODD_FIRST_SELECTORS)]
    words_type = ir.VectorType.get((count // 2,), i32)
    pair_type = ir.VectorType.get((2,), ir.F16Type.get())
    regs = np.empty((count, 8, 2), dtype=object)  # [tile, register j, row half h]
    for j in range(8):  # tokens 8j + 2 quad + (0, 1): K chunk j // 2, 8-row tile j
      rows = [llvm.load(words_type, mgpu_utils.getelementptr(
          base, [arith.addi(r, c32(j * tiles * tile_bytes))], i8), alignment=2 * count)
              for r in rows_first]
      for w in range(count // 2):
        a, b = (vector.extract(x, [], [w]) for x in rows)
        for s, selector in enumerate(selectors):  # tile 2w + s: bytes 4w + 2s (h = 0), + 1
          pair = llvm.inline_asm(i32, [a, b, selector], "prmt.b32 $0, $1, $2, $3;",
                                 "=r,r,r,r")
          for h, part in enumerate(("lo", "hi")):
            if scaled:
              f16x2 = lane_asm("{ .reg .b16 lo, hi; .reg .b32 x; mov.b32 {lo, hi}, $1; "
                               f"cvt.rn.f16x2.e4m3x2 x, {part}; mul.rn.f16x2 $0, x, $2; }}",
                               "=r,r,r", pair, token_scales[j])
            else:
              f16x2 = lane_asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                               f"cvt.rn.f16x2.e4m3x2 $0, {part}; }}", "=r,r", pair)
            regs[2 * w + s, j, h] = mgpu_utils.bitcast(f16x2, pair_type)
    mgpu_layout = layout.to_mgpu()
    return tuple(mgpu_fa.FragmentedArray(
        _registers=tile.reshape(mgpu_layout.registers_shape((FP8_COLS, STEP))),
        _layout=mgpu_layout, _is_signed=None) for tile in regs)

  return load(slot, *([scales] if scaled else []))


# e4m3_scores: q = hi + E4M3_LO_SCALE * lo, lo = e4m3((q - hi) / E4M3_LO_SCALE).
E4M3_LO_SCALE = 2.0 ** -4


def e4m3_queries(q):
  """q [T, Np, D] bf16 as e4m3_scores' B operand: [T, 2 Np, D] e4m3, each token's hi parts then
  lo parts, and the inverse powers of two [T, Np] f32 the kernel folds into each head's scores:
  what the kernel's warpgroup 0 computes (`split_queries` on the GPU; this function in the
  interpreter's form) and its oracle.
  Each head of each token is scaled by the power of two that puts its largest magnitude in
  [2^7, 2^8) (e4m3 ends at 448), hi = e4m3(q), lo = e4m3((q - hi) / E4M3_LO_SCALE). Exact,
  q = hi + 2^-4 lo, for every element at least 2^-6 after the scaling (2^(E - 13) for a head
  whose largest magnitude is in [2^E, 2^(E+1))): hi rounds its 8 significant bits to 4 (e4m3
  normals from 2^-6), and the residual, a multiple of the element's bf16 ulp at most half of hi's,
  is 4 bits on e4m3's grid (subnormals to 2^-9); smaller ones lose bits, at most 2^-14 after the
  scaling (the check over every bf16 value: tests/test_decode_backends.py). Per head, not per
  token as `_f16_queries`: e4m3's range is narrow, and one head's outlier must not push the
  token's other heads below it. A row's result never depends on the batch."""
  _, exponent = jnp.frexp(jnp.max(jnp.abs(q.astype(jnp.float32)), axis=2))  # |q| < 2^e
  # Kept within float32's normal powers (an all-zero head: e = 0, scaled up by 2^8, still 0).
  shift = jnp.clip(exponent - 8, -120, 120)
  scaled = q.astype(jnp.float32) * jnp.ldexp(jnp.float32(1), -shift)[..., None]
  # The barrier keeps XLA from folding hi's f32 -> e4m3 -> f32 round trip into the identity (GPU
  # compilation allows such "excess precision"): lo was then 0 on the H200, never on the CPU.
  hi = lax.optimization_barrier(scaled.astype(F8))
  lo = ((scaled - hi.astype(jnp.float32)) / E4M3_LO_SCALE).astype(F8)
  return jnp.concatenate([hi, lo], axis=1), jnp.ldexp(jnp.float32(1), shift)


# e4m3 x 2 -> the hi and lo bytes of two bf16 q values (one i32 word, element 2k in its low half)
# scaled by $2 (an f32 power of two): the low 16 bits of $0 hold hi's two bytes, the high 16 lo's;
# hi = e4m3(x), lo = e4m3((x - hi) * 16), as `e4m3_queries` (cvt's first source is the upper byte).
_SPLIT_PAIR = (
    "{ .reg .b32 x0, x1, hh; .reg .f32 s0, s1, r0, r1; .reg .b16 h, l, a0, a1; "
    "shl.b32 x0, $1, 16; and.b32 x1, $1, 0xffff0000; "
    "mul.rn.f32 s0, x0, $2; mul.rn.f32 s1, x1, $2; "
    "cvt.rn.satfinite.e4m3x2.f32 h, s1, s0; cvt.rn.f16x2.e4m3x2 hh, h; mov.b32 {a0, a1}, hh; "
    "cvt.f32.f16 r0, a0; cvt.f32.f16 r1, a1; sub.rn.f32 r0, s0, r0; sub.rn.f32 r1, s1, r1; "
    "mul.rn.f32 r0, r0, 0f41800000; mul.rn.f32 r1, r1, 0f41800000; "
    "cvt.rn.satfinite.e4m3x2.f32 l, r1, r0; mov.b32 $0, {h, l}; }")


def split_queries(q_rows, q_smem, qs_smem):
  """`e4m3_queries` of one token inside the kernel, in lane-level code (warpgroup 0, before its
  first product): q_rows [heads, D] bf16 in GMEM, read by 16-byte loads straight into registers;
  q_smem [2 x heads, C] e4m3 (tiled (8, 64), 64-byte swizzled) gets the hi rows then the lo rows
  of q's first C columns (all D in mosaic_decode; fp8_ds_mla's NoPE columns in
  mosaic_sparse_register_a, whose RoPE columns stay bf16),
  qs_smem [heads] f32 the scale-backs 2^shift. A head's max |q| is the largest of its bf16 bit
  patterns less the sign (their order is the magnitudes'), its frexp exponent e that pattern's
  exponent field - 126 (0 for 0; a subnormal's e is below -126, clipped alike to -120 by the
  shift), so the bytes and scales are `e4m3_queries`' for finite q. Spares the call the XLA
  kernels of the split (a reduction and three elementwise passes). The interpreter runs
  `e4m3_queries` itself (`_decode_kernel`)."""
  heads, d = q_rows.shape
  cols = q_smem.shape[1]
  group = WARPGROUP_THREADS // heads
  units = cols // _UNIT_COLS
  per_thread = pl.cdiv(units, group)
  transforms = (plgpu.TilingTransform((SWIZZLE_TILE_ROWS, FP8_COLS)),
                plgpu.SwizzleTransform(FP8_COLS))

  @plgpu.inline_mgpu(arg_types=(read_only_ref(), plgpu.RefType(transforms), plgpu.RefType()))
  def split(_, q_rows, q_smem, qs_smem):
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    c32 = lambda v: arith.constant(i32, v)
    words_type = ir.VectorType.get((4,), i32)
    tid, _, _ = warpgroup_thread()
    head, sub = arith.divui(tid, c32(group)), arith.remui(tid, c32(group))
    src = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(q_rows),
                                   [arith.muli(head, c32(2 * d))], i8)
    # Unit j of this thread: sub + group j; past the row (the last round at 16 heads) it reads
    # the row's last unit again (max unchanged) and stores nothing.
    unit_of = [arith.minui(arith.addi(sub, c32(group * j)), c32(units - 1))
               for j in range(per_thread)]
    words = []  # [unit][8 i32 words: bf16 pairs]
    for u in unit_of:
      ptr = mgpu_utils.getelementptr(src, [arith.muli(u, c32(2 * _UNIT_COLS))], i8)
      pair = [llvm.load(words_type, mgpu_utils.getelementptr(ptr, [c32(16 * k)], i8),
                        alignment=16) for k in range(2)]
      words.append([vector.extract(pair[k], [], [w]) for k in range(2) for w in range(4)])
    largest = c32(0)
    for w in (w for unit in words for w in unit):
      for x in (arith.andi(w, c32(0x7FFF)), arith.andi(arith.shrui(w, c32(16)), c32(0x7FFF))):
        largest = arith.maxui(largest, x)
    for distance in (1, 2, 4, 8)[:group.bit_length() - 1]:
      largest = arith.maxui(largest, mgpu_utils.shfl_bfly(largest, distance))
    exponent = arith.select(arith.cmpi(arith.CmpIPredicate.eq, largest, c32(0)), c32(0),
                            arith.subi(arith.shrui(largest, c32(7)), c32(126)))
    shift = arith.maxsi(arith.minsi(arith.subi(exponent, c32(8)), c32(120)), c32(-120))
    factor = arith.shli(arith.subi(c32(127), shift), c32(23))  # 2^-shift
    scale_back = arith.bitcast(ir.F32Type.get(), arith.shli(arith.addi(c32(127), shift), c32(23)))
    first = arith.cmpi(arith.CmpIPredicate.eq, sub, c32(0))
    store_scale = scf.IfOp(first)
    with ir.InsertionPoint(store_scale.then_block):
      memref.store(scale_back, qs_smem, [arith.index_cast(ir.IndexType.get(), head)])
      scf.yield_([])
    dst = mgpu_utils.memref_ptr(q_smem)

    for j, (u, unit) in enumerate(zip(unit_of, words)):
      split_words = [lane_asm(_SPLIT_PAIR, "=r,r,r", w, factor) for w in unit]
      parts = [vector.from_elements(words_type, [
          lane_asm(f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r", split_words[2 * k],
                   split_words[2 * k + 1]) for k in range(4)]) for selector in (0x5410, 0x7632)]

      def store(u=u, parts=parts):
        for row, part in zip((head, arith.addi(head, c32(heads))), parts):
          offset = swizzled_unit_offset(row, u, cols, FP8_COLS)
          llvm.store(part, mgpu_utils.getelementptr(dst, [offset], i8), alignment=16)
      if group * (j + 1) <= units:
        store()
      else:
        inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, arith.addi(sub, c32(group * j)),
                                     c32(units)))
        with ir.InsertionPoint(inside.then_block):
          store()
          scf.yield_([])

  split(q_rows, q_smem, qs_smem)
