"""A small DeepSeek-shaped decoder built from the library's layers, and generation with it.

Embedding, then per layer `x += attn(rmsnorm(x))`, `x += mlp(rmsnorm(x))` with MLA attention
(V3) or MLA with the lightning indexer and sparse attention (V3.2) and a dense SwiGLU MLP, then a
final norm and the LM head. DeepSeek's mixture-of-experts layers are not modelled: checkpoints
whose config asks for them are refused. Every layer has its own paged cache; all layers share one
block table, so one `AttentionMetadata` serves the whole step.

Generation is a prefill step on the host-built metadata, then decode steps that run on the device
(`mla_jax.decoding`): sampling, metadata and stop checks inside the jitted program, several steps
per dispatch.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike

from mla_jax.cache import DSACache, LatentCache
from mla_jax.checkpoint import Checkpoint
from mla_jax.config import MLAConfig, hf_int
from mla_jax.decoding import DecodeState, decode_steps
from mla_jax.metadata import (MIN_BUCKET, AttentionMetadata, BatchLayout, RequestState,
                              bucket, build_metadata, dcp_tables)
from mla_jax.modules import DeepseekV2MLAAttention
from mla_jax.nn import linear
from mla_jax.sampling import GREEDY, SamplingParams, sample
from mla_jax.sharded_backend import dcp_size
from mla_jax.sharding import place, place_metadata, shard_cache
from mla_jax.weights import (Target, assign, attention_targets, check_tensors, linear_target,
                             param_target)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  attention: MLAConfig
  vocab_size: int
  num_layers: int
  intermediate_size: int

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "intermediate_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "DecoderConfig":
    """Reads a DeepSeek V2/V3/V3.2 `config.json` whose layers all have dense MLPs."""
    missing = [k for k in ("vocab_size", "num_hidden_layers", "intermediate_size") if k not in hf]
    if missing:
      raise ValueError(f"config.json lacks the decoder keys {missing}")
    layers = hf_int(hf, "num_hidden_layers")
    experts, dense = hf_int(hf, "n_routed_experts", 0), hf_int(hf, "first_k_dense_replace", 0)
    if experts and dense < layers:
      raise ValueError(f"layers {dense}..{layers - 1} are mixture-of-experts "
                       f"(n_routed_experts={experts}); this decoder has dense MLPs only")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; supported: silu")
    if hf.get("tie_word_embeddings"):
      raise ValueError("tied embeddings are not supported (DeepSeek checkpoints keep lm_head "
                       "apart)")
    return cls(MLAConfig.from_hf(hf), hf_int(hf, "vocab_size"), layers,
               hf_int(hf, "intermediate_size"))


class MLP(nnx.Module):
  """DeepSeek's dense feed-forward: `down(silu(gate(x)) * up(x))`."""

  def __init__(self, hidden: int, intermediate: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.gate_proj = linear(hidden, intermediate, dtype, param_dtype, rngs)
    self.up_proj = linear(hidden, intermediate, dtype, param_dtype, rngs)
    self.down_proj = linear(intermediate, hidden, dtype, param_dtype, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm attention and MLP blocks, each added to the residual stream."""

  def __init__(self, config: DecoderConfig, *, backend, dtype, param_dtype, indexer_fp8,
               batch_invariant, rngs):
    c = config.attention
    norm = lambda: nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.input_layernorm = norm()
    self.self_attn = DeepseekV2MLAAttention(c, backend=backend, dtype=dtype,
                                            param_dtype=param_dtype, indexer_fp8=indexer_fp8,
                                            batch_invariant=batch_invariant, rngs=rngs)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(c.hidden_size, config.intermediate_size, dtype=dtype, param_dtype=param_dtype,
                   rngs=rngs)

  def __call__(self, x: jax.Array, cache: LatentCache | DSACache,
               md: AttentionMetadata) -> tuple[jax.Array, LatentCache | DSACache]:
    h, cache = self.self_attn(self.input_layernorm(x), cache, md)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), cache

  def targets(self) -> dict[str, Target]:
    """HF name under `model.layers.{i}.` -> the parameter it fills."""
    out = {"input_layernorm.weight": param_target(self.input_layernorm.scale),
           "post_attention_layernorm.weight": param_target(self.post_attention_layernorm.scale)}
    out |= {f"self_attn.{k}": t for k, t in attention_targets(self.self_attn).items()}
    out |= {f"mlp.{k}.weight": linear_target(getattr(self.mlp, k))
            for k in ("gate_proj", "up_proj", "down_proj")}
    return out


class DeepseekForCausalLM(nnx.Module):
  """tokens -> logits over the vocabulary, one step of paged attention per layer.

  `batch_invariant`: every layer's decode gives a row the same bits whatever else is in the batch
  (`MLAAttention`'s mode; costs a few percent, off by default).
  """

  def __init__(self, config: DecoderConfig, *, backend: str | None = None, dtype=jnp.bfloat16,
               param_dtype=jnp.bfloat16, indexer_fp8: bool = True, batch_invariant: bool = False,
               rngs: nnx.Rngs):
    c = config.attention
    self.config = config
    self.dtype = dtype
    self.embed_tokens = nnx.Embed(config.vocab_size, c.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
    self.layers = nnx.List([
        DecoderLayer(config, backend=backend, dtype=dtype, param_dtype=param_dtype,
                     indexer_fp8=indexer_fp8, batch_invariant=batch_invariant, rngs=rngs)
        for _ in range(config.num_layers)])
    self.norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)
    self.lm_head = linear(c.hidden_size, config.vocab_size, dtype, param_dtype, rngs)

  def __call__(self, tokens: jax.Array, caches: Sequence, md: AttentionMetadata,
               logit_rows: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """tokens [T] (the rows of `md`), one cache per layer -> (float32 logits [T, vocab], or only
    at `logit_rows` [K]; the new caches, a tuple)."""
    if len(caches) != len(self.layers):
      raise ValueError(f"{len(caches)} caches for {len(self.layers)} layers")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):  # values are checked by generate / forward
      raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
    x = self.embed_tokens(tokens)
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      x, cache = layer(x, cache, md)
      new_caches.append(cache)
    if logit_rows is not None:  # the LM head is a [hidden, vocab] matmul: skip the unread rows
      x = x[logit_rows]
    return self.lm_head(self.norm(x)).astype(jnp.float32), tuple(new_caches)

  def allocate_caches(self, num_blocks: int, block_size: int, dtype: DTypeLike | None = None,
                      **kwargs) -> tuple:
    """One cache per layer (a tuple), as each layer's `allocate_cache` makes it (V3.2: the indexer
    cache in the dtype of the model's indexers); `dtype` defaults to the model's. On the model's
    mesh when `sharding.shard_layer` has placed it on one."""
    dtype = self.dtype if dtype is None else dtype
    caches = tuple(layer.self_attn.allocate_cache(num_blocks, block_size, dtype, **kwargs)
                   for layer in self.layers)
    return caches if self.mesh is None else tuple(shard_cache(c, self.mesh) for c in caches)

  @property
  def mesh(self) -> Mesh | None:
    """The jax.sharding.Mesh that `sharding.shard_layer` placed the model on (None: one device)."""
    return self.layers[0].self_attn.mla_attn.mesh

  def load_checkpoint(self, checkpoint: Checkpoint) -> None:
    """Fills every parameter from a checkpoint, all or nothing: each layer's tensors are read
    (one layer's in host memory at a time), checked and converted to device arrays first; the
    parameters change only once every tensor of the model has passed, so a bad tensor anywhere
    leaves the model as it was. The staged arrays make the peak device memory twice the model's."""
    staged = []
    for i, layer in enumerate(self.layers):
      prefix = f"model.layers.{i}."
      staged += check_tensors(layer.targets(), checkpoint.tensors(prefix), prefix, "decoder layer")
    top = {"model.embed_tokens.weight": param_target(self.embed_tokens.embedding),
           "model.norm.weight": param_target(self.norm.scale),
           "lm_head.weight": linear_target(self.lm_head)}
    staged += check_tensors(top, checkpoint.load(list(top)), "", "model")
    assign(staged)
    for layer in self.layers:
      layer.self_attn.process_weights_after_loading()

  @classmethod
  def from_checkpoint(cls, path: str | pathlib.Path, *, backend: str | None = None,
                      dtype: DTypeLike = jnp.bfloat16,
                      indexer_fp8: bool = True,
                      batch_invariant: bool = False) -> "DeepseekForCausalLM":
    """The model of a checkpoint directory's `config.json`, with its weights loaded."""
    checkpoint = Checkpoint(path)
    model = cls(DecoderConfig.from_hf(checkpoint.config), backend=backend, dtype=dtype,
                param_dtype=dtype, indexer_fp8=indexer_fp8, batch_invariant=batch_invariant,
                rngs=nnx.Rngs(0))
    model.load_checkpoint(checkpoint)
    return model


# The graph definition is static and hashable, so every model of one structure shares the
# compiled programs (one per padded step shape) across `generate` and `forward` calls.
@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(graphdef, state, tokens, caches, md, logit_rows):
  return nnx.merge(graphdef, state)(tokens, caches, md, logit_rows)


class _TextBar:
  """A one-line progress bar on stderr, for when tqdm is not installed."""

  def __init__(self, total: int, width: int = 30):
    self.total, self.width, self.done = total, width, 0

  def update(self, n: int = 1):
    self.done += n
    filled = self.width * self.done // self.total
    print(f"\rgenerate [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}",
          end="", file=sys.stderr, flush=True)

  def close(self):
    print(file=sys.stderr)


def _progress_bar(total: int):
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return _TextBar(total)
  return tqdm(total=total, desc="generate", unit="step")


@dataclasses.dataclass
class _Paging:
  """Blocks per request, enough for `capacity[i]` tokens, in a pool of `num_blocks`; builds each
  step's metadata over them. Under dcp (the model's mesh) the pool is split into dcp ranges and a
  request's consecutive blocks go to the ranges in turn, so every device holds its share of it."""
  tables: list[list[int]]
  num_blocks: int
  max_blocks: int
  block_size: int
  index_topk: int | None
  cache_kind: str | None = None  # the caches' dtype_name, once allocated
  mesh: Mesh | None = None

  @property
  def dcp(self) -> int:
    return dcp_size(self.mesh)

  @classmethod
  def for_lengths(cls, model: DeepseekForCausalLM, capacity: Sequence[int], block_size: int,
                  num_blocks: int | None = None) -> "_Paging":
    mesh = model.mesh
    dcp = dcp_size(mesh)
    blocks = [-(-n // block_size) for n in capacity]
    starts = np.cumsum([0] + blocks)
    if num_blocks is not None and num_blocks < starts[-1]:
      raise ValueError(f"a pool of {num_blocks} blocks cannot hold these requests: they need "
                       f"{starts[-1]} blocks of {block_size} tokens")
    pool = -(-int(starts[-1]) // dcp) * dcp if num_blocks is None else num_blocks
    # Logical block j of the pool -> range j % dcp, j // dcp-th block there.
    spread = lambda j: (j % dcp) * (pool // dcp) + j // dcp
    # The pool size and a power-of-two table width are shapes of the compiled step: fixing
    # them lets runs of different batches share compilations.
    return cls([[spread(j) for j in range(starts[i], starts[i + 1])] for i in range(len(blocks))],
               pool, bucket(max(blocks), 1), block_size, model.config.attention.index_topk,
               mesh=mesh)

  def metadata(self, requests: Sequence[RequestState]
               ) -> tuple[AttentionMetadata, BatchLayout]:
    """The step's metadata, on the mesh when there is one (`sharding.place_metadata`)."""
    md, layout = build_metadata(requests, block_size=self.block_size, num_blocks=self.num_blocks,
                                max_blocks_per_seq=self.max_blocks, index_topk=self.index_topk,
                                cache_kind=self.cache_kind, dcp=self.dcp)
    return place_metadata(md, self.mesh), layout

  def allocate_caches(self, model: DeepseekForCausalLM, cache_dtype) -> tuple:
    """The model's caches over this pool; later metadata records their kind."""
    caches = model.allocate_caches(self.num_blocks, self.block_size, cache_dtype)
    self.cache_kind = caches[0].dtype_name
    return caches

  def place(self, tree: Any) -> Any:
    """Arrays of `tree` (inputs, a decode state) on every device of the mesh, if any."""
    return tree if self.mesh is None else place(tree, self.mesh)


def check_token_ids(config: DecoderConfig, sequences: Sequence[Sequence[int]], *, what: str,
                    new_tokens: int = 0) -> list[np.ndarray]:
  """`sequences` of token ids as int32 arrays, each checked on the host: a 1-D, non-empty run of
  integers (Python or numpy, not bool) in [0, vocab_size), whose positions, with `new_tokens`
  more to be generated (the last one never fed back), stay below max_position_embeddings.
  A ValueError names the `what` ("prompt", "sequence"), its index and the position."""
  if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or not sequences:
    raise ValueError(f"need a non-empty list of {what}s (token id lists), got {sequences!r:.80}")
  vocab, max_pos = config.vocab_size, config.attention.max_position_embeddings
  out = []
  for i, seq in enumerate(sequences):
    if hasattr(seq, "dtype"):  # a numpy or jax array: its dtype says it all
      if seq.dtype.kind not in "iu":
        raise ValueError(f"{what} {i} has dtype {seq.dtype}, expected integer token ids")
    else:
      bad = next((k for k, t in enumerate(seq) if isinstance(t, (bool, np.bool_))
                  or not isinstance(t, (int, np.integer))), None)
      if bad is not None:
        raise ValueError(f"{what} {i}, position {bad}: token id {seq[bad]!r} is not an integer")
    ids = np.asarray(seq)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"{what} {i} must be a non-empty 1-D list of token ids, got shape "
                       f"{ids.shape}")
    outside = np.flatnonzero((ids < 0) | (ids >= vocab))
    if outside.size:
      k = int(outside[0])
      raise ValueError(f"{what} {i}, position {k}: token id {ids[k]} is outside the vocabulary "
                       f"[0, {vocab})")
    needed = len(ids) + max(new_tokens - 1, 0)
    if needed > max_pos:
      raise ValueError(f"{what} {i} needs {needed} positions ({len(ids)} tokens, {new_tokens} "
                       f"new), more than max_position_embeddings={max_pos}")
    out.append(ids.astype(np.int32))
  return out


def forward(model: DeepseekForCausalLM, sequences: Sequence[Sequence[int]], *,
            block_size: int = 16, cache_dtype: DTypeLike | None = None) -> list[np.ndarray]:
  """Logits [len_i, vocab] at every position of each sequence: one prefill step over whole
  sequences with fresh caches, the path that step-by-step generation must agree with."""
  sequences = check_token_ids(model.config, sequences, what="sequence")
  paging = _Paging.for_lengths(model, [len(s) for s in sequences], block_size)
  caches = paging.allocate_caches(model, cache_dtype)
  md, layout = paging.metadata([RequestState(0, len(s), paging.tables[i])
                                for i, s in enumerate(sequences)])
  tokens = layout.pack(sequences)
  graphdef, state = nnx.split(model)
  logits, _ = _step(graphdef, state, paging.place(jnp.asarray(tokens)), caches, md,
                    paging.place(jnp.arange(layout.num_rows)))
  return layout.unpack(logits)


# Decode steps per dispatch unless the caller says: enough that the host's per-dispatch work (one
# token copy, the next call) hides behind the device's, few enough that a batch whose requests all
# stop early wastes little.
DEFAULT_STEPS_PER_DISPATCH = 16

_sample = jax.jit(sample, static_argnames="params")


# Prompt tokens per prefill step: the prefill kernels index their [tokens, heads, 192] operands
# with int32 offsets, which V3's 128 heads overflow past 87,381 tokens (B=256 prompts of 1024).
MAX_PREFILL_TOKENS = 1 << 16


def _prefill_groups(lengths: Sequence[int], max_tokens: int) -> list[range]:
  """Consecutive runs of requests whose lengths add up to at most `max_tokens` (a longer request
  alone): the requests of each prefill step."""
  groups, start, total = [], 0, 0
  for i, n in enumerate(lengths):
    if i > start and total + n > max_tokens:
      groups.append(range(start, i))
      start, total = i, 0
    total += n
  return groups + [range(start, len(lengths))]


@dataclasses.dataclass
class PrefilledBatch:
  """Requests after their prefill step, ready for `decode`: the caches hold the prompts and each
  request's first new token was chosen on the device (`state.tokens`)."""
  caches: tuple
  state: DecodeState  # rows: the requests in order, padded to a power-of-two bucket
  paging: _Paging
  prompt_lens: list[int]
  max_new_tokens: int
  sampling: SamplingParams
  stop_token_id: int | None
  first_logits: jax.Array | None  # [rows, vocab] float32 when logits were asked for

  @property
  def num_requests(self) -> int:
    return len(self.prompt_lens)


def prefill(model: DeepseekForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
            block_size: int = 16, num_blocks: int | None = None,
            cache_dtype: DTypeLike | None = None, stop_token_id: int | None = None,
            sampling: SamplingParams | None = None, key: jax.Array | None = None,
            return_logits: bool = False,
            max_prefill_tokens: int = MAX_PREFILL_TOKENS) -> PrefilledBatch:
  """Prefill steps over every prompt (as many requests per step as fit in `max_prefill_tokens`
  prompt tokens; a longer prompt gets a step alone), with fresh caches sized for `max_new_tokens`
  more tokens per request, and the first new token chosen. Other arguments as in `generate`."""
  sampling = GREEDY if sampling is None else sampling
  if (isinstance(max_new_tokens, (bool, np.bool_))
      or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1):
    raise ValueError(f"generate needs an integer max_new_tokens >= 1, got {max_new_tokens!r}")
  max_new_tokens = int(max_new_tokens)
  if (isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int)
      or max_prefill_tokens < 1):
    raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
  prompts = check_token_ids(model.config, prompts, what="prompt", new_tokens=max_new_tokens)
  if not sampling.greedy and key is None:
    raise ValueError(f"sampling with {sampling} needs a key (jax.random.key(seed))")
  key = None if sampling.greedy else key
  paging = _Paging.for_lengths(model, [len(p) + max_new_tokens for p in prompts], block_size,
                               num_blocks)
  caches = paging.allocate_caches(model, cache_dtype)
  graphdef, state = nnx.split(model)
  n = len(prompts)
  rows = bucket(n, MIN_BUCKET)  # decode rows: the requests in order, padded as build_metadata pads
  step_logits = []
  for group in _prefill_groups([len(p) for p in prompts], max_prefill_tokens):
    md, layout = paging.metadata([RequestState(0, len(prompts[i]), paging.tables[i])
                                  for i in group])
    # The LM head reads each request's last row; padded as the block tables are, so that a
    # step's shapes depend only on its buckets.
    last = np.zeros(md.block_tables.shape[0], np.int32)
    last[:len(group)] = [r[-1] for r in layout.rows]
    tokens = layout.pack([prompts[i] for i in group])
    out, caches = _step(graphdef, state, paging.place(jnp.asarray(tokens)), caches, md,
                        paging.place(jnp.asarray(last)))
    step_logits.append(out[:len(group)])
  logits = jnp.pad(jnp.concatenate(step_logits), ((0, rows - n), (0, 0)))
  first = _sample(logits, sampling, key, 0)
  tables = np.full((rows, paging.max_blocks), -1, np.int32)
  for i, table in enumerate(paging.tables):
    tables[i, :len(table)] = table
  prompt_lens = np.zeros(rows, np.int32)
  prompt_lens[:n] = [len(p) for p in prompts]
  remaining = np.where(np.arange(rows) < n, max_new_tokens - 1, 0).astype(np.int32)
  stop = jnp.int32(-1 if stop_token_id is None else stop_token_id)
  dcp = paging.dcp
  decode_state = paging.place(DecodeState(
      tokens=first, positions=jnp.asarray(prompt_lens), active=(first != stop) & (remaining > 0),
      remaining=jnp.asarray(remaining), block_tables=jnp.asarray(tables), step=jnp.int32(1),
      stop_token=stop, key=key,
      dcp_block_tables=None if dcp == 1 else jnp.asarray(dcp_tables(tables, paging.num_blocks,
                                                                    dcp))))
  return PrefilledBatch(caches, decode_state, paging, prompt_lens[:n].tolist(), max_new_tokens,
                        sampling, stop_token_id, logits if return_logits else None)


def decode(model: DeepseekForCausalLM, batch: PrefilledBatch, *,
           steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH, progress: bool = False
           ) -> list[list[int]] | tuple[list[list[int]], list[np.ndarray]]:
  """Generates a prefilled batch to the end (consuming its caches): `steps_per_dispatch` decode
  steps per jitted call, their metadata advanced on the device, the host reading the chosen ids
  of one call while the device runs the next. Without a stop token a dispatch runs all its steps
  (a fixed trip count, no condition read back per step on a GPU); with one, a dispatch ends once
  every request has stopped. Returns as `generate` does."""
  if steps_per_dispatch < 1:
    raise ValueError(f"steps_per_dispatch must be >= 1, got {steps_per_dispatch}")
  n, max_new = batch.num_requests, batch.max_new_tokens
  graphdef, params = nnx.split(model)
  tokens = [[] for _ in range(n)]
  logits = None if batch.first_logits is None else [[] for _ in range(n)]
  stop = batch.stop_token_id
  finished = lambda i: len(tokens[i]) == max_new or (tokens[i] and tokens[i][-1] == stop)
  bar = _progress_bar(max_new) if progress else None

  def collect(step_tokens, step_logits) -> bool:
    """Appends one dispatch's emitted tokens; True while some request is unfinished."""
    step_tokens = np.asarray(step_tokens)[:, :n]  # the one host sync per dispatch
    step_logits = None if step_logits is None else np.asarray(step_logits)[:, :n]
    # One conversion to Python ints per dispatch, not one numpy call per row: at B=256 the
    # per-row form took ~1.4 ms of host time a dispatch.
    for i, row in enumerate(step_tokens.T.tolist()):
      tokens[i].extend(tok for tok in row if tok >= 0)
      if logits is not None:
        logits[i].extend(step_logits[np.flatnonzero(step_tokens[:, i] >= 0), i])
    if bar is not None:
      bar.update(int(np.any(step_tokens >= 0, axis=1).sum()))
    return not all(finished(i) for i in range(n))

  # V3.2: a dispatch's steps share `within_topk` (static), so none straddles the step after
  # which the longest request's window outgrows top-k; the step-by-step rule is kept exactly.
  topk = model.config.attention.index_topk
  longest = max(batch.prompt_lens)
  caches, state = batch.caches, batch.state
  # Device results not read yet, oldest first: the prefill's first tokens [1, R], then one
  # [steps_per_dispatch, R] per dispatch.
  first_logits = None if logits is None else batch.first_logits[None]
  pending = [(state.tokens[None], first_logits)]
  t, live = 1, True  # t: the token the next step emits
  while live and t < max_new:
    num_steps = min(steps_per_dispatch, max_new - t)
    within = topk is not None and longest + t <= topk
    if within:
      num_steps = min(num_steps, topk - longest - t + 1)
    # A dispatch that must run all its steps (no stop token; the length limit not inside it)
    # takes the fixed-trip loop, which a GPU runs without reading a condition back each step.
    fixed = stop is None and num_steps == steps_per_dispatch
    *out, caches, state = decode_steps(
        graphdef, params, caches, state, None if fixed else num_steps,
        max_steps=steps_per_dispatch,
        block_size=batch.paging.block_size, sampling=batch.sampling, within_topk=within,
        return_logits=logits is not None, num_blocks=batch.paging.num_blocks)
    t += num_steps
    # Queue the ids' copy to the host now, behind this dispatch only: read later, they are not
    # then waiting for the next dispatch, which the device is running by then.
    for a in out:
      if a is not None:
        a.copy_to_host_async()
    pending.append(out)
    if len(pending) > 1:  # read the previous dispatch while this one runs
      live = collect(*pending.pop(0))
  for out in pending:
    collect(*out)
  if bar is not None:
    bar.close()
  if logits is not None:
    return tokens, [np.stack(l) for l in logits]
  return tokens


def generate(model: DeepseekForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             block_size: int = 16, num_blocks: int | None = None,
             cache_dtype: DTypeLike | None = None, stop_token_id: int | None = None,
             progress: bool = False, return_logits: bool = False,
             sampling: SamplingParams | None = None, key: jax.Array | None = None,
             steps_per_dispatch: int = DEFAULT_STEPS_PER_DISPATCH
             ) -> list[list[int]] | tuple[list[list[int]], list[np.ndarray]]:
  """Generates from a batch of prompts (token id lists, any lengths): `prefill`, then `decode`.

  One prefill step for every prompt, then decode steps that run on the device,
  `steps_per_dispatch` per jitted call, each choosing its tokens there (greedy by default, else by
  `sampling` with the jax.random `key`: the same key gives the same tokens). A request stops
  after `max_new_tokens` or after emitting `stop_token_id`. The caches hold `num_blocks` blocks
  of `block_size` tokens (default: just enough for these requests), placed on the model's mesh
  when it is sharded; `cache_dtype` as in `allocate_caches`. Returns the new token ids per
  prompt; with `return_logits`, also the float32 logits [new tokens, vocab] that chose them.
  """
  batch = prefill(model, prompts, max_new_tokens, block_size=block_size, num_blocks=num_blocks,
                  cache_dtype=cache_dtype, stop_token_id=stop_token_id, sampling=sampling, key=key,
                  return_logits=return_logits)
  return decode(model, batch, steps_per_dispatch=steps_per_dispatch, progress=progress)
