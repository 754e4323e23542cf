"""The one layer constructor the modules share."""

from flax import nnx
from jax.typing import DTypeLike


def linear(n_in: int, n_out: int, dtype: DTypeLike, param_dtype: DTypeLike,
           rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free projection (DeepSeek's are all bias-free), fan-in scaled normal init."""
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                    kernel_init=nnx.initializers.normal(n_in ** -0.5))
