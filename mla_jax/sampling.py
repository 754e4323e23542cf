"""Choosing the next token on the device: greedy, or sampled with temperature, top-k and top-p.

Filters follow vLLM's order: logits / temperature, then top-k, then top-p over what top-k left
(the smallest set of most likely tokens whose probability reaches p; the most likely token always
stays). A sampled token is a Gumbel-max draw over the kept logits, with a key per (step, row)
folded from the caller's key, so a request's tokens depend only on the key, its row and the step,
not on how many steps one dispatch runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One batch's sampling settings (hashable: a static argument of the jitted steps).

  temperature 0 is greedy (argmax; top_k and top_p then change nothing); top_k None keeps every
  token; top_p 1.0 keeps every token.
  """
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float = 1.0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
    if self.top_k is not None and self.top_k < 1:
      raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


GREEDY = SamplingParams()


def candidates(logits: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """logits [B, V] float32 -> (scaled logits [B, C], -inf where filtered out; their token ids
  [B, C]). C is top_k when set, else V (sorted descending when top_p needs the order)."""
  logits = logits / params.temperature
  b, v = logits.shape
  if params.top_k is not None and params.top_k < v:
    values, ids = lax.top_k(logits, params.top_k)
  elif params.top_p < 1:
    values, ids = lax.top_k(logits, v)  # a full descending sort with the ids alongside
  else:
    return logits, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (b, v))
  if params.top_p < 1:
    probs = jax.nn.softmax(values, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely candidates
    values = jnp.where(before < params.top_p, values, -jnp.inf)
  return values, ids.astype(jnp.int32)


def row_keys(key: jax.Array, step: jax.Array | int, num_rows: int) -> jax.Array:
  """The key of each row [B] at decode step `step` (a traced scalar)."""
  step_key = jax.random.fold_in(key, step)
  return jax.vmap(lambda r: jax.random.fold_in(step_key, r))(jnp.arange(num_rows))


def sample(logits: jax.Array, params: SamplingParams, key: jax.Array | None = None,
           step: jax.Array | int = 0) -> jax.Array:
  """logits [B, V] -> token ids [B] int32. `key` (a jax.random key) is needed unless greedy;
  `step` (may be traced) says which token of the requests this is."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if key is None:
    raise ValueError(f"sampling with {params} needs a jax.random key")
  values, ids = candidates(logits.astype(jnp.float32), params)
  keys = row_keys(key, step, logits.shape[0])
  pick = jax.vmap(jax.random.categorical)(keys, values)
  return jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]
