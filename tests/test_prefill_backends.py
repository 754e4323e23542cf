import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_prefill import mla_prefill
from prefill_contract import DK, DV, SCALE, PrefillContract, assert_close, cumulative
from oracles import varlen_attention_np


class TestReferencePrefill(PrefillContract):
  backend = "reference"


class TestPallasTritonPrefill(PrefillContract):
  backend = "pallas_triton"


class TestPallasPrefillSmallBlocks(PrefillContract):
  """The kernel itself with 16-row blocks, so that the test lengths span several query and key
  blocks (unmasked, diagonal and ragged-tail key blocks, partial query blocks)."""

  def prefill(self, *args, **kwargs):
    return mla_prefill(*args, **kwargs, block_q=16, block_k=16, interpret=True)


def test_request_longer_than_max_seqlen_q_is_still_covered():
  rng = np.random.default_rng(7)
  cu = cumulative([50, 21])
  q, k = (jnp.asarray(rng.standard_normal((71, 2, DK)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((71, 2, DV)), jnp.float32)
  o, lse = mla_prefill(q, k, v, jnp.asarray(cu), jnp.asarray(cu), scale=SCALE, causal=True,
                       max_seqlen_q=16, block_q=16, block_k=16, interpret=True)
  ref_o, ref_lse = varlen_attention_np(q, k, v, cu, cu, SCALE, True)
  assert_close(o, ref_o, jnp.float32)
  assert_close(lse, ref_lse, jnp.float32)


@pytest.mark.parametrize("change, message", [
    (dict(k=jnp.zeros((8, 2, 96))), "Dk"),
    (dict(v=jnp.zeros((8, 2, 96))), "Dv"),
    (dict(q=jnp.zeros((8, 2, DK), jnp.float16)), "dtype"),
    (dict(cu_seqlens_q=jnp.array([0.0, 8.0])), "int32"),
    (dict(cu_seqlens_k=jnp.array([0, 4, 8], jnp.int32)), "differ in length"),
    (dict(block_q=48), "block_q"),
])
def test_bad_arguments_raise(change, message):
  args = dict(q=jnp.zeros((8, 2, DK)), k=jnp.zeros((8, 2, DK)), v=jnp.zeros((8, 2, DV)),
              cu_seqlens_q=jnp.array([0, 8], jnp.int32), cu_seqlens_k=jnp.array([0, 8], jnp.int32))
  args.update(change)
  call = functools.partial(mla_prefill, scale=SCALE, causal=True, max_seqlen_q=8, interpret=True)
  with pytest.raises(ValueError, match=message):
    call(**args)
