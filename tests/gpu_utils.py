"""Helpers shared by the GPU test files."""

import jax
import jax.numpy as jnp


def poison_allocator():
  """Fills and frees a 4 GiB buffer so that the next allocations (a kernel's outputs) start out as
  NaN: an output element the kernel never writes shows up as NaN."""
  jax.block_until_ready(jnp.full((1 << 30,), jnp.nan, jnp.float32)).delete()
