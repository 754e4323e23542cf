"""Feasibility probe (session 12, issue 15): an e4m3 cache tile as wgmma's register A operand.

With heads in wgmma's N (mosaic_decode heads_in="n"), S^T = K Q^T and O^T = V^T P^T take the page
as A, and Hopper's wgmma reads A from registers: the e4m3 tile can be loaded from the stage slot,
converted in registers and fed to wgmma without the bf16 slot the fp8 path widens into today.
This pins the recipe that lowers with jax 0.11.2 (benchmarks/RESULTS.md, "Latent decode
(pallas_mosaic)", "Session 12: fp8 keys as wgmma's register A operand"):
- keys, [64 tokens, 64 columns] of the stage: a plain load in the WGMMA layout, `astype(f16)`
  (one cvt.rn.f16x2.e4m3x2 a pair; e4m3 -> bf16 has no conversion that lowers, so B is f16);
- values, V^T [64 columns, 64 tokens]: the transposed view loaded in WGMMA_TRANSPOSED (a WGMMA
  load of it does not lower: 8-bit has no transposed relayout), converted, then cast to WGMMA
  (a 16-bit relayout: a shuffle and a prmt a register).
Lowering for CUDA runs on this CPU. Mosaic GPU's interpreter (jax 0.11.2) runs wgmma with
shared-memory operands only, so there the converted tile goes through shared memory: that checks
the loads, views and conversion against numpy, not the register operand; the `-m gpu` test runs
the register form.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gpu_utils import poison_allocator
from pallas_kernels import e4m3_operands, mosaic_decode
from pallas_kernels.common import swizzled

F8 = jnp.float8_e4m3fn
HEADS = 16  # wgmma's N: a 16-head tile of mosaic_decode's heads_in="n"
TILE = 64  # tokens x columns of one A tile: 64 e4m3 bytes (the stage's 64-byte swizzle)


def register_a_kernel(side, interpret):
  """out [64, HEADS] f32: side "k": K @ Q^T (K the [64 tokens, 64] tile); "v": V^T @ P^T (the same
  tile as V, P [HEADS, 64 tokens]). b is Q or P, f16 [HEADS, 64]."""
  def kernel(x_ref, b_ref, o_ref, x_smem, b_smem, a_smem, o_smem, bars):
    plgpu.copy_gmem_to_smem(x_ref, x_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(b_ref, b_smem, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    if side == "k":
      x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
    else:
      x = plgpu.load(x_smem.transpose((1, 0)), layout=plgpu.Layout.WGMMA_TRANSPOSED)
    a = plgpu.layout_cast(x.astype(jnp.float16), plgpu.Layout.WGMMA)

    def product(acc_ref):
      if interpret:  # the interpreter's wgmma reads shared-memory operands only
        a_smem[...] = a
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
      else:
        plgpu.wgmma(acc_ref, a, b_smem.transpose((1, 0)))
      return acc_ref[...]

    o_smem[...] = pl.run_scoped(product, plgpu.ACC((TILE, HEADS), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return jax.jit(plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((TILE, HEADS), jnp.float32),
      scratch_types=(swizzled((TILE, TILE), F8, TILE), swizzled((HEADS, TILE), jnp.float16),
                     swizzled((TILE, TILE), jnp.float16), plgpu.SMEM((TILE, HEADS), jnp.float32),
                     plgpu.Barrier(num_barriers=2)),
      interpret=plgpu.InterpretGPUParams() if interpret else None))


def tile_and_b(seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((TILE, TILE)) * 8
  # e4m3's extremes and subnormals convert exactly to f16 (bf16 through f32 lost them on XLA:CPU,
  # which flushes subnormals)
  x[3, :6] = [448, -448, 2.0 ** -9, -3 * 2.0 ** -9, 0, 1.875 * 2.0 ** -7]
  return (jnp.asarray(x, jnp.float32).astype(F8),
          jnp.asarray(rng.standard_normal((HEADS, TILE)), jnp.float16))


@pytest.mark.parametrize("side", ["k", "v"])
def test_register_a_lowers_for_hopper(side):
  x, b = tile_and_b(0)
  text = register_a_kernel(side, interpret=False).trace(x, b).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def check_against_numpy(side, interpret):
  x, b = tile_and_b(1)
  out = np.asarray(register_a_kernel(side, interpret=interpret)(x, b))
  xf, bf = np.asarray(x.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
  want = (xf if side == "k" else xf.T) @ bf.T
  # exact f16 products; only the f32 sums' order differs (sums reach ~2000): a misplaced element
  # would be off by tens
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-2)


@pytest.mark.parametrize("side", ["k", "v"])
def test_register_a_interpreter_form_matches_numpy(side):
  check_against_numpy(side, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["k", "v"])
def test_register_a_on_gpu_matches_numpy(side):
  poison_allocator()  # the output starts as NaN: an element the kernel never stores fails
  check_against_numpy(side, interpret=False)


# mosaic_decode's wide_keys: `_wide_key_tile` (lane-level 16-byte loads of a ring slot's e4m3 key
# tile into the f16 WGMMA fragment) against `wide_key_order`, tile by tile: its swizzled
# addresses (9 column tiles, two 8-row tiles a warp, slot 1 of a ring of 2) and register order,
# which only the GPU runs.
D = 576  # a cache row: kv_lora_rank + rope


def slot_probe(fill, out_shape):
  """A kernel that bulk-copies one e4m3 slot [TILE, D] into a 64-byte-swizzled ring slot, lets
  fill(slot, o_smem) write the f16 output tile from it, and stores that."""
  def kernel(x_ref, o_ref, ring, o_smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, ring.at[1], bar)
    plgpu.barrier_wait(bar)
    fill(ring.at[1], o_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return jax.jit(plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, jnp.float16),
      scratch_types=(swizzled((2, TILE, D), F8, TILE), swizzled(out_shape, jnp.float16),
                     plgpu.Barrier())))


def wide_key_kernel():
  def fill(slot, o_smem):
    for c in range(D // TILE):
      o_smem[:, pl.ds(c * TILE, TILE)] = mosaic_decode._wide_key_tile(slot, c)
  return slot_probe(fill, (TILE, D))


def wide_key_rows(seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((TILE, D)) * 8
  x[5, :6] = [448, -448, 2.0 ** -9, -3 * 2.0 ** -9, 0, 1.875 * 2.0 ** -7]
  return jnp.asarray(x, jnp.float32).astype(F8)


def test_wide_key_tile_lowers_for_hopper():
  text = wide_key_kernel().trace(wide_key_rows(0)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
def test_wide_key_tile_on_gpu_is_the_permuted_tile():
  x = wide_key_rows(2)
  poison_allocator()
  out = np.asarray(wide_key_kernel()(x))
  # e4m3 -> f16 is exact: any misplaced byte differs
  want = mosaic_decode.wide_key_order(x.astype(jnp.float16))
  np.testing.assert_array_equal(out, np.asarray(want))


# mosaic_decode's wide_values: `wide_value_tiles` (lane-level loads of a token row's value unit,
# the token pairs interleaved bytewise, into the f16 WGMMA fragments of V^T's 8 tiles) against
# `wide_value_order`, for both pass sizes (16-byte loads, 8 tiles a pass; 8-byte, 4), which only
# the GPU runs.
L = e4m3_operands.WIDE_VALUE_COLS


def wide_value_kernel(group):
  def fill(slot, o_smem):
    for first in range(0, L // TILE, group):
      for c, tile in enumerate(e4m3_operands.wide_value_tiles(slot, first, group), first):
        o_smem[pl.ds(c * TILE, TILE), :] = tile
  return slot_probe(fill, (L, TILE))


@pytest.mark.parametrize("group", sorted(set(e4m3_operands.WIDE_VALUE_GROUP.values())))
def test_wide_value_tiles_lower_for_hopper(group):
  text = wide_value_kernel(group).trace(wide_key_rows(0)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("group", sorted(set(e4m3_operands.WIDE_VALUE_GROUP.values())))
def test_wide_value_tiles_on_gpu_are_the_permuted_tiles(group):
  x = wide_key_rows(3)
  poison_allocator()
  out = np.asarray(wide_value_kernel(group)(x))
  # V^T's tiles stacked [512 value columns in wide_value_order, 64 tokens]; e4m3 -> f16 is exact
  want = e4m3_operands.wide_value_order(x[:, :L].astype(jnp.float16), group).T
  np.testing.assert_array_equal(out, np.asarray(want))
