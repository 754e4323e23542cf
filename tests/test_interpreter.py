"""The harness the kernel tests run on: Mosaic GPU's interpreter with its race detector, and
conftest's host values for the interpreter's callbacks (what `check_no_races` and its kin rely
on: a detector that finds nothing only counts if it finds a race when there is one)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

races = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")


def _hand_over(synced: bool):
  """Warpgroup 0 writes a shared-memory tile that warpgroup 1 reads, behind a barrier or not."""
  def kernel(x_ref, o_ref, tile, written):
    # x_ref, o_ref [128] f32; tile [128] f32 (shared memory); written: a barrier of 1 arrival
    wg = jax.lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      tile[...] = x_ref[...] * 2.0
      if synced:
        plgpu.barrier_arrive(written)

    @pl.when(wg == 1)
    def _():
      if synced:
        plgpu.barrier_wait(written)
      o_ref[...] = tile[...] + 1.0

  x = jnp.arange(128, dtype=jnp.float32)
  o = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                   scratch_types=[plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_arrivals=1)],
                   num_threads=2, thread_name="wg",
                   interpret=plgpu.InterpretGPUParams(detect_races=True))(x)
  return np.asarray(jax.block_until_ready(o)), np.asarray(x)


def test_race_detector_finds_an_unsynchronized_hand_over():
  try:
    _hand_over(synced=False)
  except jax.errors.JaxRuntimeError as e:  # jax 0.12 raises at the racing access
    assert "RACE DETECTED" in str(e)
  else:  # jax 0.11 records it
    assert races.get_races().races_found


def test_race_detector_passes_a_barrier_hand_over():
  o, x = _hand_over(synced=True)
  assert not races.get_races().races_found
  np.testing.assert_array_equal(o, x * 2.0 + 1.0)


def test_other_io_callbacks_keep_jax_arrays():
  seen = []

  def record(a, b):
    seen.append((type(a), type(b)))
    return a + b

  @jax.jit
  def f(a, b):
    return io_callback(record, jax.ShapeDtypeStruct((), jnp.int32), a, b)

  assert int(f(jnp.int32(3), jnp.int32(4))) == 7
  assert all(issubclass(t, jax.Array) for t in seen[0])
