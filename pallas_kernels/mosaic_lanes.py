"""Lane-level Mosaic GPU helpers the attention kernels share (mosaic_sparse, mosaic_decode): the
e4m3 -> bf16 "wide widening" by bit placement, 16-byte shared-memory loads and stores, inline PTX.

Apart from common.py because these build MLIR (jaxlib's llvm, arith and vector dialects) inside
`plgpu.inline_mgpu` functions, which the Triton kernels never need; the interpreter runs none of
it (the kernels keep a Pallas-level form for interpret=True).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, nvvm, scf, vector

from pallas_kernels.common import F8

# e4m3 -> bf16 by bit placement. A byte sign-extended to 16 bits (prmt's sign-replicating
# selectors: bytes 0, 1 or 2, 3 of a word into the halves of one), shifted left 4 and masked to
# the sign, exponent and mantissa fields, is the bf16 of its e4m3 value times 2^-120 (normals and
# subnormals alike; zero stays zero); one bf16x2 multiply by scale * 2^120 finishes.
WIDE_SELECTORS = (0x9180, 0xB3A2)
WIDE_MASK = 0x87F087F0
WIDE_BIAS = 120
WIDE_UNIT_FACTOR = 0x7B807B80  # bf16x2 (2^120, 2^120): the factor of scale 1
# The bit placement's multiply is today's f32 product rounded to bf16 when the scale is a bf16
# (its low 16 bits 0) of magnitude <= 2^7 (so scale * 2^120 is a finite bf16); other scales take
# today's conversion (cvt e4m3x2 -> f16x2, f32 multiplies, cvt -> bf16x2).
WIDE_MAX_SCALE_BITS = 0x43000000  # 2^7


def wide_widening_model(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """What the wide widening's lane code computes, in numpy (XLA on CPUs flushes the bit
  placement's subnormals), on uint32 words (4 e4m3 bytes, the first in the low byte) and float32
  scales of the same shape: bf16 [..., 4], byte k times its scale. Scales `wide_fast_scale`
  accepts go through the bit placement; the others through f32, as the Pallas-level widening."""
  words, scales = np.asarray(words, np.uint32), np.asarray(scales, np.float32)
  halves = []
  for selector in WIDE_SELECTORS:  # prmt: bytes 2p, 2p + 1 sign-extended into a word's halves
    pair = np.zeros_like(words)
    for half in range(2):
      byte = (words >> np.uint32(8 * ((selector >> (8 * half)) & 0x7))) & np.uint32(0xFF)
      extended = byte | np.where(byte & 0x80, 0xFF00, 0).astype(np.uint32)
      pair |= extended << np.uint32(16 * half)
    halves.append((pair << np.uint32(4)) & np.uint32(WIDE_MASK))
  # [..., 2] uint32: bf16x2 of bytes (0, 1) and (2, 3)
  placed = np.stack(halves, -1).view(jnp.bfloat16).reshape(*words.shape, 4)
  factor = (scales * np.float32(2.0 ** WIDE_BIAS)).astype(jnp.bfloat16)[..., None]
  # A bf16 multiply (mul.rn.bf16x2): the float64 product of two bf16 is exact, rounded once.
  fast = (placed.astype(np.float64) * factor.astype(np.float64)).astype(jnp.bfloat16)
  e4m3 = words[..., None].view(np.uint8).view(F8).astype(np.float32).reshape(*words.shape, 4)
  slow = (e4m3 * scales[..., None]).astype(jnp.bfloat16)
  return np.where(wide_fast_scale(scales)[..., None], fast, slow)


def wide_fast_scale(scales: np.ndarray) -> np.ndarray:
  """Whether the wide widening takes the bit placement for these float32 scales (a bf16 of
  magnitude <= 2^7), as the lane code decides it per row and tile."""
  bits = np.asarray(scales, np.float32).view(np.uint32)
  return ((bits & 0x7FFFFFFF) <= WIDE_MAX_SCALE_BITS) & ((bits & 0xFFFF) == 0)


def lane_asm(text, constraints, *args):
  """An inline-PTX instruction sequence of one 32-bit result."""
  return llvm.inline_asm(ir.IntegerType.get_signless(32), list(args), text, constraints)


def placed_bf16x2(word, p, factor, mask=None):
  """The bf16x2 of bytes 2p, 2p + 1 of an i32 word (4 e4m3 values) by bit placement, times the
  bf16x2 factor (an i32: bf16(scale * 2^WIDE_BIAS) twice). mask: an i32 to AND with instead of
  WIDE_MASK (0 widens the word's values to +0: rows past the valid ones, whatever their bytes)."""
  text = (f"{{ .reg .b32 x; prmt.b32 x, $1, 0, {WIDE_SELECTORS[p]:#x}; shl.b32 x, x, 4; "
          f"and.b32 x, x, {'$3' if mask is not None else f'{WIDE_MASK:#x}'}; "
          "mul.rn.bf16x2 $0, x, $2; }")
  if mask is None:
    return lane_asm(text, "=r,r,r", word, factor)
  return lane_asm(text, "=r,r,r,r", word, factor, mask)


WARPGROUP_THREADS = 128


def warpgroup_thread():
  """The running thread's (index in its warpgroup, lane, warp in the warpgroup) as i32 values:
  what lane-level code addresses shared memory by."""
  c32 = lambda v: arith.constant(ir.IntegerType.get_signless(32), v)
  tid = arith.remui(mgpu_utils.thread_idx(), c32(WARPGROUP_THREADS))
  return tid, arith.remui(tid, c32(32)), arith.divui(tid, c32(32))


def swizzled_unit_offset(row, unit, row_bytes, swizzle):
  """Byte offset (i32) of 16-byte unit `unit` of row `row` (i32 values) in a shared-memory buffer
  of `row_bytes`-byte rows in `common.swizzled`'s layout: tiles of 8 rows x `swizzle` bytes, row
  by row of tiles, and within a tile each row's units XOR (row % 8) / (128 / swizzle) (64- and
  128-byte swizzles)."""
  c32 = lambda v: arith.constant(ir.IntegerType.get_signless(32), v)
  units = swizzle // 16  # a tile row's units
  in_tile = arith.remui(row, c32(8))
  tile = arith.addi(arith.muli(arith.divui(row, c32(8)), c32(row_bytes // swizzle)),
                    arith.divui(unit, c32(units)))
  place = arith.xori(arith.remui(unit, c32(units)), arith.divui(in_tile, c32(8 // units)))
  row_start = arith.addi(arith.muli(tile, c32(8 * swizzle)), arith.muli(in_tile, c32(swizzle)))
  return arith.addi(row_start, arith.muli(place, c32(16)))


def wide_offset(base, offset):
  """Byte offset base (i32, a lane's) + offset (static)."""
  return arith.addi(base, arith.constant(ir.IntegerType.get_signless(32), offset))


def wide_load(ref, base, offset):
  """The 16 bytes (4 i32 words) at byte offset base + offset of a shared-memory ref."""
  i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
  ptr = mgpu_utils.memref_ptr(ref)
  return llvm.load(ir.VectorType.get((4,), i32),
                   mgpu_utils.getelementptr(ptr, [wide_offset(base, offset)], i8), alignment=16)


def wide_store(dst, words, convert, offsets):
  """Widens a 16-byte unit's words (16 e4m3 values) with convert and stores their bf16 as two
  16-byte units, values 8 h to 8 h + 7 at byte offset base + offset of dst, offsets[h] = (base,
  offset)."""
  i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
  out = [convert(vector.extract(words, [], [w]), p) for w in range(4) for p in range(2)]
  for h, (base, offset) in enumerate(offsets):
    off = wide_offset(base, offset)
    llvm.store(vector.from_elements(ir.VectorType.get((4,), i32), out[4 * h:4 * h + 4]),
               mgpu_utils.getelementptr(mgpu_utils.memref_ptr(dst), [off], i8), alignment=16)


# jax >= 0.12.1 refuses a kernel that writes an input passed as an array, and counts an
# `inline_mgpu` ref argument as written unless its RefType says `write=False`; 0.11.2's RefType has
# no such field (and no such check).
_REF_TYPE_HAS_WRITE = "write" in {f.name for f in dataclasses.fields(plgpu.RefType)}


def read_only_ref(transforms=()):
  """The `inline_mgpu` type of a ref argument the inline code only reads (a kernel's GMEM input)."""
  if _REF_TYPE_HAS_WRITE:
    return plgpu.RefType(transforms, write=False)
  return plgpu.RefType(transforms)


def cp_async_wait(pending):
  """Waits until at most `pending` of this thread's cp.async groups are in flight."""

  @plgpu.inline_mgpu()
  def wait(_):
    nvvm.cp_async_wait_group(pending)

  wait()


# Lane-level mbarriers in a plain shared-memory buffer (8 bytes each), for what Pallas' barriers
# cannot do: a Pallas barrier does not reach `plgpu.inline_mgpu` (its ref arguments must lower to
# memrefs), and Pallas has no cp.async arrive. Callers keep them in a buffer's 8-byte-aligned
# slack; every thread of the block runs `lane_barriers_init` once, before any use.
LANE_BARRIER_WORDS = 2  # 32-bit words a lane barrier takes


def _lane_barrier_ptr(ref, k):
  i64 = ir.IntegerType.get_signless(64)
  return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [k], i64)


def lane_barriers_init(ref, count):
  """Initializes the ref.size / 2 lane barriers of ref (SMEM, 8-byte aligned) to `count`
  arrivals a phase (one thread of the block), then syncs the whole block (bar.sync 0: every
  thread of the block must run this, before the warpgroups part)."""
  barriers = ref.size // LANE_BARRIER_WORDS

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def init(_, ref):
    i32 = ir.IntegerType.get_signless(32)
    first = mgpu_utils.single_thread_predicate(scope=mgpu_utils.ThreadSubset.BLOCK)
    for k in range(barriers):
      nvvm.mbarrier_init(_lane_barrier_ptr(ref, k), arith.constant(i32, count), predicate=first)
    nvvm.barrier()

  init(ref)


def cp_async_arrive(ref):
  """The lane barrier at the start of ref counts one arrival of this thread once all its cp.async
  copies issued so far have landed (cp.async.mbarrier.arrive.noinc: the arrival is one of the
  phase's count)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def arrive(_, ref):
    nvvm.cp_async_mbarrier_arrive(_lane_barrier_ptr(ref, 0), noinc=True)

  arrive(ref)


def lane_barrier_wait(ref, parity):
  """Waits (every thread) until the lane barrier at the start of ref has completed its phase of
  parity `parity` (an int32 scalar: phases alternate 0, 1, 0, ...); the copies it tracked are then
  visible to this thread."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))
  def wait(_, ref, parity):
    i32 = ir.IntegerType.get_signless(32)
    nvvm.mbarrier_try_wait_parity(_lane_barrier_ptr(ref, 0), parity.registers.item(),
                                  arith.constant(i32, 10_000_000))

  wait(ref, parity)


def row_steps(row_ref, *, num_slots, step, interpret):
  """Steps of `step` slots up to the last valid slot of row_ref [Kp] int32 (GMEM, raw slots: -1 or
  >= num_slots invalid, anywhere in the row), as a scalar every thread of the warpgroup holds.
  On the GPU each warp reads the whole row (Kp / 128 16-byte loads a lane, coalesced) and takes
  the max over its lanes with redux.sync: no shared memory and no barrier, so every warp of every
  warpgroup derives the same count on its own. The interpreter (no inline Mosaic GPU code) loops
  over the slots."""
  kp = row_ref.shape[0]
  if interpret:
    def last_valid(k, extent):
      slot = row_ref[k]
      return jnp.where((slot >= 0) & (slot < num_slots), k + 1, extent)

    extent = lax.fori_loop(0, kp, last_valid, jnp.int32(0))
    return lax.div(extent + (step - 1), step)

  @plgpu.inline_mgpu(arg_types=(read_only_ref(),),
                     return_type=plgpu.ShapeDtypeStruct((), jnp.int32,
                                                        layout=plgpu.Layout.WG_SPLAT(())))
  def count(_, row):
    i32, i64 = (ir.IntegerType.get_signless(w) for w in (32, 64))
    c32 = lambda v: arith.constant(i32, v)
    lane = arith.remui(mgpu_utils.thread_idx(), c32(32))
    base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(row))
    vec = ir.VectorType.get((4,), i32)
    extent = c32(0)
    for g in range(-(-kp // 128)):
      first = arith.addi(c32(g * 128), arith.muli(lane, c32(4)))  # this lane's 4 slots
      if (g + 1) * 128 > kp:  # Kp an odd number of steps: lanes past the row reread its last 4
        first = arith.minui(first, c32(kp - 4))
      ptr = mgpu_utils.getelementptr(base, [arith.extui(i64, first)], i32)
      values = llvm.load(vec, ptr, alignment=16)
      for e in range(4):
        slot = llvm.extractelement(values, c32(e))
        valid = arith.cmpi(arith.CmpIPredicate.ult, slot, c32(num_slots))
        extent = arith.maxsi(extent, arith.select(valid, arith.addi(first, c32(e + 1)), c32(0)))
    extent = mgpu_utils.redux(extent, c32(0xFFFFFFFF), mgpu_utils.ReductionKind.MAX)
    steps = arith.divui(arith.addi(extent, c32(step - 1)), c32(step))
    return mgpu_fa.FragmentedArray.splat(steps, (), layout=mgpu_fa.WGSplatFragLayout(()),
                                          is_signed=True)

  return count(row_ref)


def rows_rescaled(parts, alpha, *, skip_ones):
  """parts (tiles [64, w] f32 in the WGMMA layout: a consumer's output columns, a row per head)
  times alpha [64] (the rows' online-softmax rescale factors), as `part * alpha[:, None]` each.

  skip_ones (lane-level; the kernels' `rescale_slack`): a warp whose rows all have alpha == 1
  keeps its registers and issues no multiply (x * 1 == x: the same values either way). A warp
  holds 16 rows, a thread 2 (r and r + 8); vote.sync makes the one branch for all the tiles
  warp-uniform. For 256 columns that is 128 FMUL a thread on each consumer's path from the
  softmax to P V (H200 SASS of the bf16 decode: warpgroup 0's before it hands P over, warpgroup
  1's after), and with a slack the rows' maxima seldom move after the first steps."""
  if not skip_ones:
    return tuple(part * lax.broadcast_in_dim(alpha, part.shape, [0]) for part in parts)
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=((layout,) * len(parts), layout.reduce(1)),
                     return_type=tuple(plgpu.ShapeDtypeStruct(part.shape, jnp.float32,
                                                              layout=layout) for part in parts))
  def rescale(_, parts, alpha):
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    one = arith.constant(f32, 1.0)
    moved = None
    for reg in alpha.registers.flat:
      for e in range(ir.VectorType(reg.type).shape[0]):
        ne = arith.cmpf(arith.CmpFPredicate.UNE, vector.extract(reg, [], [e]), one)
        moved = ne if moved is None else arith.ori(moved, ne)
    moved = nvvm.vote_sync(arith.constant(i32, 0xFFFFFFFF), moved, "any")
    flat = [reg for part in parts for reg in part.registers.flat]
    branch = scf.IfOp(moved, [reg.type for reg in flat], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scaled = [part * alpha.broadcast_in_dim(part.shape, (0,), part.layout) for part in parts]
      scf.yield_([reg for part in scaled for reg in part.registers.flat])
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(flat)
    results, out = list(branch.results), []
    for part in parts:
      registers = np.empty(part.registers.shape, dtype=object)
      registers.flat, results = results[:part.registers.size], results[part.registers.size:]
      out.append(mgpu_fa.FragmentedArray(_registers=registers, _layout=part.layout,
                                         _is_signed=None))
    return tuple(out)

  return rescale(tuple(parts), alpha)
