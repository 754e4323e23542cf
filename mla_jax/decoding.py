"""Decode steps that stay on the device: several per dispatch, metadata advanced in the program.

For a decode-only batch (one new token per request), step t+1's metadata follows from step t's:
each active row's position moves one on, its slot comes from its block table (allocated up front
for the requested lengths), and the token it feeds is the one just sampled. `decode_steps` runs up
to `max_steps` such steps in one loop: rows that emit the stop token or reach their length limit
turn inactive (no cache writes, nothing seen, their outputs masked). A loop that may end early
(once every row is inactive) reads its condition back to the host every step on a GPU, which
idles the device while the next step is launched; when the caller knows every step is needed (no
stop token, no length limit inside the dispatch) it asks for a fixed trip count instead, which
XLA runs as a known-trip-count loop without that read-back. Only the chosen token ids (and the
logits when asked for) come back.

Rows are requests in order, padded to the same power-of-two bucket as `build_metadata`'s, so the
metadata equals what it would build for the active rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from mla_jax.metadata import AttentionMetadata, dcp_seq_lens
from mla_jax.sampling import SamplingParams, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Where every row of a decode batch stands before the next step (device arrays)."""
  tokens: jax.Array  # [R] int32, the token each row feeds next
  positions: jax.Array  # [R] int32, its position (tokens already in the cache)
  active: jax.Array  # [R] bool, still generating (false for padding rows)
  remaining: jax.Array  # [R] int32, tokens the row may still emit
  block_tables: jax.Array  # [R, MB] int32, -1 padded, enough blocks for the row's whole length
  step: jax.Array  # int32 scalar, which token of the requests the next step emits (sampling keys)
  stop_token: jax.Array  # int32 scalar, the id that ends a request (-1: none)
  key: jax.Array | None  # the sampling key (None for greedy)
  # [dcp, R, MB] int32: each device's tables under decode context parallelism (metadata.dcp_tables,
  # built on the host once); None without.
  dcp_block_tables: jax.Array | None = None


def decode_metadata(state: DecodeState, *, block_size: int, within_topk: bool = False,
                    num_blocks: int | None = None) -> AttentionMetadata:
  """The `AttentionMetadata` of the next step, computed from `state` (traceable). Inactive rows
  are padding: slot -1 (nothing written) and 0 tokens seen. Under dcp (`state.dcp_block_tables`)
  `num_blocks`, the cache's, places the blocks."""
  live = state.active
  pos = state.positions
  block = jnp.take_along_axis(state.block_tables, (pos // block_size)[:, None], axis=1,
                              mode="clip")[:, 0]
  r = pos.shape[0]
  zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
  seq_lens = jnp.where(live, pos + 1, 0)
  dcp_tables = state.dcp_block_tables
  return AttentionMetadata(
      positions=jnp.where(live, pos, 0),
      slot_mapping=jnp.where(live, block * block_size + pos % block_size, -1),
      seq_lens=seq_lens,
      row_request=jnp.where(live, jnp.arange(r, dtype=jnp.int32), -1),
      block_tables=state.block_tables, prefill_query_start_loc=zeros(1),
      context_slots=zeros(0, 0), context_cu_seqlens=zeros(0, 1),
      dcp_block_tables=dcp_tables,
      dcp_seq_lens=None if dcp_tables is None else dcp_seq_lens(
          state.block_tables, seq_lens, dcp=dcp_tables.shape[0], num_blocks=num_blocks,
          block_size=block_size),
      num_decode_rows=r, within_topk=within_topk)


def advance(state: DecodeState, new_tokens: jax.Array) -> DecodeState:
  """The state after the active rows emitted `new_tokens` [R]."""
  live = state.active
  finished = (new_tokens == state.stop_token) | (state.remaining <= 1)
  return dataclasses.replace(
      state, tokens=jnp.where(live, new_tokens, state.tokens), positions=state.positions + live,
      active=live & ~finished, remaining=state.remaining - live, step=state.step + 1)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2,
                   static_argnames=("max_steps", "block_size", "sampling", "within_topk",
                                    "return_logits", "num_blocks"))
def decode_steps(graphdef: nnx.GraphDef, params: nnx.State, caches: tuple, state: DecodeState,
                 num_steps: jax.Array | int | None = None, *, max_steps: int, block_size: int,
                 sampling: SamplingParams, within_topk: bool = False, return_logits: bool = False,
                 num_blocks: int | None = None
                 ) -> tuple[jax.Array, jax.Array | None, tuple, DecodeState]:
  """Decode steps of the model `nnx.merge(graphdef, params)`: exactly `max_steps` when `num_steps`
  is None (a fixed trip count), else up to `num_steps` (traced, <= max_steps), fewer when every
  row finishes. Returns (tokens [max_steps, R] int32, -1 where a row emitted nothing; float32
  logits [max_steps, R, vocab] or None; the caches; the state). `num_blocks`: the caches' block
  count, needed under dcp (see `decode_metadata`)."""
  model = nnx.merge(graphdef, params)
  r = state.tokens.shape[0]

  def step(i, carry):
    caches, state, tokens, logits = carry
    md = decode_metadata(state, block_size=block_size, within_topk=within_topk,
                         num_blocks=num_blocks)
    step_logits, caches = model(state.tokens, caches, md)
    new = jnp.where(state.active, sample(step_logits, sampling, state.key, state.step), -1)
    tokens = tokens.at[i].set(new)
    if return_logits:
      logits = logits.at[i].set(step_logits)
    return caches, advance(state, new), tokens, logits

  logits = (jnp.zeros((max_steps, r, model.config.vocab_size), jnp.float32) if return_logits
            else None)
  init = (caches, state, jnp.full((max_steps, r), -1, jnp.int32), logits)
  if num_steps is None:
    caches, state, tokens, logits = lax.fori_loop(0, max_steps, step, init)
  else:
    more = lambda carry: (carry[0] < num_steps) & jnp.any(carry[1][1].active)
    body = lambda carry: (carry[0] + 1, step(*carry))
    _, (caches, state, tokens, logits) = lax.while_loop(more, body, (jnp.int32(0), init))
  return tokens, logits, caches, state
