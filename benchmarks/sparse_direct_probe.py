"""Registers and spills of the memory warpgroup of the fp8_pipeline="direct" design for
mosaic_sparse (benchmarks/RESULTS.md, "DSA sparse attention (pallas_mosaic)", v16: built in
session 15, 0.95x the default at T=128 on the H200, not kept; this probe stays to time its memory
side alone), on a CPU.

A stand-in kernel, not the attention kernel: 3 warpgroups at setmaxnreg 216 / 160 / --regs (the
split the design takes; the first two do nothing), the third loading each step's e4m3 NoPE rows,
tile scales and RoPE rows of its 2 rows from global memory into registers (`fetch`), carrying
them through a loop iteration, and widening them into a 128-byte-swizzled bf16 slot (`widen`).
Compiled as `ptxas_report.py` compiles the repo's kernels (its setup applies):
  PYTHONPATH=. .venv/bin/python benchmarks/sparse_direct_probe.py --regs 120 128 --sass
With --time, on a GPU, it runs at T=128 N=128's launch (256 programs of 32 steps) and prints the
microseconds a step takes the memory warpgroup alone: widening plus the next step's loads (the
design's L + W, to hold under the consumers' 2.87 us a step for bf16's pace).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector

from benchmarks import ptxas_report
from pallas_kernels.mosaic_lanes import read_only_ref

SLOTS = 1 << 20
LOADS = 22  # 16-byte loads a thread a step: 2 rows x (8 NoPE + 1 scales + 2 RoPE)
RAW = plgpu.Layout.WG_STRIDED((128 * LOADS * 4,), vec_size=4)  # i32, 4 a load
SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _thread():
  """(c32, this thread's 16-byte column group g, and its rows r0, r0 + 32) in the warpgroup."""
  i32 = ir.IntegerType.get_signless(32)
  c32 = lambda v: arith.constant(i32, v)
  tid = arith.remui(mgpu_utils.thread_idx(), c32(128))
  lane, warp = arith.remui(tid, c32(32)), arith.divui(tid, c32(32))
  r0 = arith.addi(arith.muli(warp, c32(8)), arith.remui(lane, c32(8)))
  return c32, arith.divui(lane, c32(8)), [r0, arith.addi(r0, c32(32))]


def fetch(idx_smem, nope, rope, scales):
  """The thread's 22 loads of a step: rows idx_smem[r] (0 and zeroed where invalid)."""
  @plgpu.inline_mgpu(arg_types=(read_only_ref(),) * 4,
                     return_type=plgpu.ShapeDtypeStruct((128 * LOADS * 4,), jnp.int32,
                                                        layout=RAW))
  def body(_, idx, nope, rope, scales):
    i32, i64, i8 = (ir.IntegerType.get_signless(w) for w in (32, 64, 8))
    c32, g, rows = _thread()
    v4 = ir.VectorType.get((4,), i32)
    zero = arith.constant(v4, ir.DenseElementsAttr.get_splat(v4, ir.IntegerAttr.get(i32, 0)))
    global_ptr = llvm.PointerType.get(address_space=1)
    bases = [llvm.addrspacecast(global_ptr, mgpu_utils.memref_ptr(r)) for r in (nope, rope, scales)]
    c64 = lambda v: arith.constant(i64, v)
    unit = arith.extui(i64, arith.muli(g, c32(16)))
    regs = []
    for r in rows:
      row = memref.load(idx, [arith.index_cast(ir.IndexType.get(), r)])
      valid = arith.cmpi(arith.CmpIPredicate.ult, row, c32(SLOTS))  # -1 too (unsigned)
      row = arith.extui(i64, arith.select(valid, row, c32(0)))

      def load(base, offset):
        value = llvm.load(v4, mgpu_utils.getelementptr(base, [offset], i8), alignment=16)
        return arith.select(valid, value, zero)  # an invalid row widens to zeros, as cp.async's

      nope_at = arith.addi(arith.muli(row, c64(512)), unit)
      regs += [load(bases[0], arith.addi(nope_at, c64(64 * d))) for d in range(8)]
      regs.append(load(bases[2], arith.muli(row, c64(16))))
      rope_at = arith.addi(arith.muli(row, c64(128)), unit)
      regs += [load(bases[1], arith.addi(rope_at, c64(64 * j))) for j in range(2)]
    return mgpu_fa.FragmentedArray(_registers=np.array(regs, dtype=object),
                                   _layout=RAW.to_mgpu(), _is_signed=True)

  return body(idx_smem, nope, rope, scales)


def widen(raw, slot):
  """raw's rows into slot [9, 64, 64] bf16: NoPE e4m3 x its tile scale (f32), then the RoPE."""
  @plgpu.inline_mgpu(arg_types=(RAW, plgpu.RefType(SWIZZLED)))
  def body(_, raw, slot):
    i32, i16, i8 = (ir.IntegerType.get_signless(w) for w in (32, 16, 8))
    f32 = ir.F32Type.get()
    c32, g, rows = _thread()
    v4 = ir.VectorType.get((4,), i32)
    base = mgpu_utils.memref_ptr(slot)
    regs = list(raw.registers.flat)
    word = lambda vec, k: vector.extract(vec, [], [k])
    asm = lambda ty, args, text, constraints: llvm.inline_asm(ty, args, text, constraints)
    for k, r in enumerate(rows):
      loads = regs[k * LOADS // 2:(k + 1) * LOADS // 2]
      swizzle = arith.remui(r, c32(8))

      def store(tile, unit, words):
        at = arith.addi(arith.addi(c32(tile * 64 * 128), arith.muli(r, c32(128))),
                        arith.muli(arith.xori(unit, swizzle), c32(16)))
        llvm.store(vector.from_elements(v4, words), mgpu_utils.getelementptr(base, [at], i8),
                   alignment=16)

      for d in range(8):
        scale = arith.bitcast(f32, word(loads[8], d // 2))
        out = []
        for w in (word(loads[d], e) for e in range(4)):
          for half in range(2):
            f16x2 = asm(i32, [arith.trunci(i16, arith.shrui(w, c32(16 * half)))],
                        "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
            lo, hi = (asm(f32, [asm(i16, [f16x2], f"mov.b32 {part}, $1;", "=h,r")],
                          "cvt.f32.f16 $0, $1;", "=f,h")
                      for part in ("{$0, _}", "{_, $0}"))
            out.append(asm(i32, [arith.mulf(hi, scale), arith.mulf(lo, scale)],
                           "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"))
        store(d, arith.muli(g, c32(2)), out[:4])
        store(d, arith.addi(arith.muli(g, c32(2)), c32(1)), out[4:])
      for j in range(2):
        store(8, arith.addi(c32(4 * j), g), [word(loads[9 + j], e) for e in range(4)])

  body(raw, slot)


def _kernel(idx_ref, nope_ref, rope_ref, scales_ref, out_ref, kv, idx_smem, idx_bar, *, regs,
            steps):
  del out_ref  # the stores go to shared memory only
  wg, program = lax.axis_index("wg"), lax.axis_index("p")

  @pl.when(wg == 0)
  def _():
    plgpu.set_max_registers(216, action="increase")

  @pl.when(wg == 1)
  def _():
    # Below the launch's 168 (65536 / 384 rounded down to 8): a decrease, or the GPU faults.
    plgpu.set_max_registers(160, action="decrease")

  @pl.when(wg == 2)
  def _():
    plgpu.set_max_registers(regs, action="decrease")
    # All the program's indices up front: the design's ring has them 3 steps ahead.
    plgpu.copy_gmem_to_smem(idx_ref.at[program], idx_smem, idx_bar)
    plgpu.barrier_wait(idx_bar)
    rows = lambda i: idx_smem.at[i]

    def step(i, raw):
      widen(raw, kv.at[lax.rem(i, 2)])
      plgpu.commit_smem()
      # The next step's loads, in flight until the next widening (the design: through the wait
      # on its slot's consumers; here nothing waits, so a step takes the widening plus the loads).
      return fetch(rows(jnp.minimum(i + 1, steps - 1)), nope_ref, rope_ref, scales_ref)

    lax.fori_loop(0, steps, step, fetch(rows(0), nope_ref, rope_ref, scales_ref))


def _call(regs, programs, steps):
  return plgpu.kernel(
      functools.partial(_kernel, regs=regs, steps=steps),
      out_type=jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
      scratch_types=[plgpu.SMEM((2, 9, 64, 64), jnp.bfloat16, transforms=SWIZZLED),
                     plgpu.SMEM((steps, 64), jnp.int32), plgpu.Barrier()],
      grid=(programs,), grid_names=("p",), num_threads=3, thread_name="wg")


def _args(programs, steps):
  return (jax.ShapeDtypeStruct((programs, steps, 64), jnp.int32),
          jax.ShapeDtypeStruct((SLOTS, 512), jnp.uint8),
          jax.ShapeDtypeStruct((SLOTS, 128), jnp.uint8),
          jax.ShapeDtypeStruct((SLOTS, 16), jnp.uint8))


def traced(regs, programs=1, steps=32):
  return jax.jit(_call(regs, programs, steps)).trace(*_args(programs, steps))


def time_steps(regs, programs, steps, span):
  """Microseconds a step of the memory warpgroup alone (widening + its loads' latency: the
  design's L + W), programs x steps of 64 rows drawn from the first `span` of the cache."""
  from benchmarks.common import require_gpu, time_ms
  from pallas_kernels.common import sm_count
  require_gpu("benchmarks.sparse_direct_probe")
  keys = jax.random.split(jax.random.key(0), 4)
  idx = jax.random.randint(keys[0], (programs, steps, 64), 0, span, jnp.int32)
  cache = [jax.random.bits(k, s.shape, jnp.uint8)
           for k, s in zip(keys[1:], _args(programs, steps)[1:])]
  ms = time_ms(jax.jit(_call(regs, programs, steps)), [(idx, *cache)], iters=20, repeats=3)
  return ms * 1e3 / (-(-programs // sm_count()) * steps)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--regs", type=int, nargs="+", default=[120, 128])
  parser.add_argument("--sass", action="store_true")
  parser.add_argument("--dump")
  parser.add_argument("--site", default=str(ptxas_report.SITE))
  parser.add_argument("--time", action="store_true",
                      help="on a GPU: us a step at T=128 N=128's 256 programs x 32 steps, rows "
                           "over the 1M-token cache and over its first 32K")
  args = parser.parse_args()
  for regs in args.regs:
    if args.time:
      for span in (SLOTS, 1 << 15):
        us = time_steps(regs, 256, 32, span)
        print(f"direct memory warpgroup at {regs}, rows over {span}: {us:.2f} us a step",
              flush=True)
    else:
      ptxas_report.report(f"direct memory warpgroup at {regs}", traced(regs), args)


if __name__ == "__main__":
  main()
