"""Generation on the device: sampling filters against numpy, device-advanced decode metadata
against build_metadata, several steps per dispatch against one, greedy tokens against the
host-loop `generate` this replaced, and no retrace between dispatches."""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mla_jax.decoding import DecodeState, advance, decode_metadata, decode_steps
from mla_jax.metadata import RequestState, build_metadata
from mla_jax import model as model_module
from mla_jax.model import (DecoderConfig, DeepseekForCausalLM, _prefill_groups, decode, forward,
                           generate, prefill)
from mla_jax.sampling import GREEDY, SamplingParams, sample
from mla_jax.tiny_checkpoint import tiny_config, write_tiny_checkpoint
from sharding_worker import run_with_host_devices

PROMPTS = [[5, 6, 7], list(range(2, 15)), [9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW_TOKENS = 10
POOL = dict(block_size=32, num_blocks=8)
# What `generate` returned for PROMPTS, NEW_TOKENS and POOL on the tiny checkpoints (index_topk=8)
# before it moved to the device: a host loop copying every step's logits, argmax in numpy,
# metadata rebuilt by build_metadata each step. STOP[v] is request 1's fourth token.
HOST_LOOP = {
    "v3": [[98, 66, 188, 98, 66, 188, 89, 245, 272, 245], [14] * 10,
           [42, 24, 256, 55, 285, 221, 205, 104, 62, 81],
           [290, 105, 87, 106, 100, 27, 162, 197, 221, 0]],
    "v3.2": [[147, 103, 110, 147, 103, 110, 147, 103, 72, 171],
             [31, 81, 135, 131, 64, 211, 275, 276, 40, 233],
             [82, 54, 36, 206, 209, 36, 206, 164, 116, 240],
             [259, 5, 238, 249, 251, 63, 91, 200, 148, 110]],
}
STOP = {"v3": 14, "v3.2": 131}
SAMPLED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9)

pytest.importorskip("safetensors")


@pytest.fixture(scope="module", params=["v3", "v3.2"])
def tiny(request, tmp_path_factory):
  """(variant, float32 model); V3.2 keeps top-8, shorter than most windows here."""
  path = tmp_path_factory.mktemp(request.param)
  write_tiny_checkpoint(path, request.param, index_topk=8)
  return request.param, DeepseekForCausalLM.from_checkpoint(path, backend="reference",
                                                            dtype=jnp.float32)


# --- sampling -------------------------------------------------------------------------------

def allowed_numpy(logits, params: SamplingParams):
  """Per row, the token ids temperature, top-k then top-p keep (float64), and the smallest gap
  between a cumulative probability and top_p (how close a row is to the boundary)."""
  out, gap = [], np.inf
  for row in np.asarray(logits, np.float64) / params.temperature:
    order = np.argsort(-row, kind="stable")[:params.top_k]
    p = np.exp(row[order] - row[order].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    if params.top_p < 1:
      gap = min(gap, np.abs(before - params.top_p).min())
    out.append(set(order[before < params.top_p].tolist()))
  return out, gap


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.5, top_k=12, top_p=0.5),
    SamplingParams(temperature=1.0),
])
def test_sampled_ids_stay_in_the_numpy_filtered_set(params):
  logits = jax.random.normal(jax.random.key(7), (6, 64)) * 2.5
  allowed, gap = allowed_numpy(logits, params)
  assert gap > 1e-4  # no row sits on the top-p boundary, where float32 and float64 may disagree
  draws = jax.jit(jax.vmap(lambda step: sample(logits, params, jax.random.key(3), step)))(
      jnp.arange(2000))
  draws = np.asarray(draws)
  for row, keep in enumerate(allowed):
    seen = set(draws[:, row].tolist())
    assert seen <= keep, (row, seen - keep)
    # and the filter is not narrower than numpy's: every kept token with >= 2% of the kept mass
    # turns up in 2000 draws
    z = np.asarray(logits[row], np.float64) / params.temperature
    ids = np.array(sorted(keep))
    p = np.exp(z[ids] - z[ids].max())
    p /= p.sum()
    assert set(ids[p >= 0.02].tolist()) <= seen, row


def test_greedy_is_argmax_and_bad_params_raise():
  logits = jax.random.normal(jax.random.key(0), (5, 33))
  np.testing.assert_array_equal(np.asarray(sample(logits, SamplingParams())),
                                np.asarray(logits).argmax(-1))
  for bad in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
    with pytest.raises(ValueError):
      SamplingParams(**bad)
  with pytest.raises(ValueError, match="key"):
    sample(logits, SamplingParams(temperature=1.0))


# --- decode metadata on the device ----------------------------------------------------------

def test_decode_metadata_equals_build_metadata_step_after_step():
  bs, nb, mb = 4, 16, 4
  tables = [[3, 7, 1], [0, 2, 4], [5, 6, 8, 9]]
  ctx = [5, 7, 9]
  padded = np.full((8, mb), -1, np.int32)
  for i, t in enumerate(tables):
    padded[i, :len(t)] = t
  state = DecodeState(
      tokens=jnp.arange(8, dtype=jnp.int32), positions=jnp.array(ctx + [0] * 5, jnp.int32),
      active=jnp.array([True] * 3 + [False] * 5), remaining=jnp.array([5] * 3 + [0] * 5, jnp.int32),
      block_tables=jnp.asarray(padded), step=jnp.int32(1), stop_token=jnp.int32(-1), key=None)
  fields = ("positions", "slot_mapping", "seq_lens", "row_request", "block_tables",
            "prefill_query_start_loc", "context_slots", "context_cu_seqlens")
  for step in range(3):  # each step's metadata follows from the last on the device
    got = decode_metadata(state, block_size=bs)
    want, _ = build_metadata([RequestState(c + step, 1, t) for c, t in zip(ctx, tables)],
                             block_size=bs, num_blocks=nb, max_blocks_per_seq=mb)
    for f in fields:
      np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), f)
    assert (got.num_decode_rows, got.max_prefill_query_len) == (want.num_decode_rows, 0)
    state = advance(state, jnp.full(8, 11, jnp.int32))
  # A finished row is padding: no slot, nothing seen, no request.
  state = dataclasses.replace(state, active=state.active.at[1].set(False))
  md = decode_metadata(state, block_size=bs)
  assert [int(a[1]) for a in (md.slot_mapping, md.seq_lens, md.row_request)] == [-1, 0, -1]
  assert int(md.slot_mapping[2]) == 9 * bs + (9 + 3) % bs  # position 12: its fourth block


def test_advance_stops_on_the_stop_token_and_the_length_limit():
  state = DecodeState(
      tokens=jnp.zeros(4, jnp.int32), positions=jnp.array([3, 4, 5, 0], jnp.int32),
      active=jnp.array([True, True, True, False]), remaining=jnp.array([4, 1, 4, 0], jnp.int32),
      block_tables=jnp.zeros((4, 1), jnp.int32), step=jnp.int32(2), stop_token=jnp.int32(9),
      key=None)
  after = advance(state, jnp.array([9, 5, 6, -1], jnp.int32))
  assert np.asarray(after.active).tolist() == [False, False, True, False]
  assert np.asarray(after.positions).tolist() == [4, 5, 6, 0]  # the finished rows fed their last
  assert np.asarray(after.tokens).tolist() == [9, 5, 6, 0] and int(after.step) == 3


def test_finished_rows_write_nothing_and_emit_nothing(tiny):
  _, model = tiny
  batch = prefill(model, PROMPTS, 6, **POOL)
  state = dataclasses.replace(batch.state, active=batch.state.active.at[1].set(False))
  before = [np.asarray(x) for x in jax.tree.leaves(batch.caches)]
  graphdef, params = nnx.split(model)
  tokens, _, caches, after = decode_steps(graphdef, params, batch.caches, state, 3, max_steps=4,
                                          block_size=POOL["block_size"], sampling=GREEDY)
  tokens = np.asarray(tokens)
  assert (tokens[3:] == -1).all() and (tokens[:3, 1] == -1).all() and (tokens[:3, 0] >= 0).all()
  assert int(after.positions[1]) == len(PROMPTS[1]) and int(after.positions[0]) == 3 + 3
  blocks = batch.paging.tables
  for old, new in zip(before, jax.tree.leaves(caches)):
    if old.ndim < 2:  # a scale
      continue
    new = np.asarray(new)
    np.testing.assert_array_equal(new[blocks[1]], old[blocks[1]])  # the finished row's blocks
    assert not np.array_equal(new[blocks[0]], old[blocks[0]])


# --- generate on the tiny checkpoints -------------------------------------------------------

def test_greedy_tokens_equal_the_host_loop_generate(tiny):
  variant, model = tiny
  assert generate(model, PROMPTS, NEW_TOKENS, **POOL) == HOST_LOOP[variant]
  stopped = generate(model, PROMPTS, NEW_TOKENS, stop_token_id=STOP[variant], **POOL)
  want = [t[:t.index(STOP[variant]) + 1] if STOP[variant] in t else t for t in HOST_LOOP[variant]]
  assert stopped == want and len(stopped[1]) == (1 if variant == "v3" else 4)


def test_prefill_in_several_steps_equals_one_step(tiny):
  """Requests grouped into prefill steps of at most 12 prompt tokens ([0], [1] alone though
  longer, [2, 3]): the same first logits and the same generation."""
  variant, model = tiny
  assert _prefill_groups([len(p) for p in PROMPTS], 12) == [range(0, 1), range(1, 2), range(2, 4)]
  one = prefill(model, PROMPTS, NEW_TOKENS, return_logits=True, **POOL)
  split = prefill(model, PROMPTS, NEW_TOKENS, return_logits=True, max_prefill_tokens=12, **POOL)
  n = len(PROMPTS)
  np.testing.assert_allclose(split.first_logits[:n], one.first_logits[:n], rtol=1e-5, atol=1e-5)
  assert split.first_logits.shape == one.first_logits.shape
  assert decode(model, split)[0] == HOST_LOOP[variant]
  with pytest.raises(ValueError, match="max_prefill_tokens"):
    prefill(model, PROMPTS, 2, max_prefill_tokens=0, **POOL)


def test_full_dispatches_take_the_fixed_trip_loop(tiny, monkeypatch):
  """Without a stop token every dispatch but a shorter last one runs a fixed number of steps
  (num_steps None), which compiles to a loop of known trip count; with one, every dispatch may end
  early."""
  _, model = tiny
  calls = []
  spy = lambda *args, **kw: calls.append(args[4]) or decode_steps(*args, **kw)
  monkeypatch.setattr(model_module, "decode_steps", spy)
  generate(model, PROMPTS, NEW_TOKENS, steps_per_dispatch=4, **POOL)  # 9 decode steps
  assert calls == [None, None, 1]
  calls.clear()
  generate(model, PROMPTS, NEW_TOKENS, steps_per_dispatch=4, stop_token_id=1000, **POOL)
  assert calls == [4, 4, 1]
  batch = prefill(model, PROMPTS, NEW_TOKENS, **POOL)
  graphdef, params = nnx.split(model)
  hlo = lambda n: decode_steps.lower(graphdef, params, batch.caches, batch.state, n, max_steps=4,
                                     block_size=POOL["block_size"],
                                     sampling=GREEDY).compile().as_text()
  assert '"known_trip_count":{"n":"4"}' in hlo(None)
  assert "known_trip_count" not in hlo(4)


@pytest.mark.parametrize("num_steps", [None, 4])
def test_decode_loop_writes_the_caches_in_place(tiny, num_steps):
  """In the compiled decode loop (fixed-trip and early-exit), every cache array is donated and
  aliased to its output, and no cache-shaped buffer is copied: each step writes its rows into the
  caches in place instead of copying every request's cache per step or per dispatch."""
  _, model = tiny
  batch = prefill(model, PROMPTS, NEW_TOKENS, **POOL)
  graphdef, params = nnx.split(model)
  hlo = decode_steps.lower(graphdef, params, batch.caches, batch.state, num_steps, max_steps=4,
                           block_size=POOL["block_size"], sampling=GREEDY).compile().as_text()
  dims = lambda text: tuple(int(d) for d in text.split(",") if d)
  # The header: input_output_alias={ {out}: (param, {}, may-alias), ... } and
  # entry_computation_layout={(param shapes)->(...)}; jit drops unused parameters, so the cache
  # parameters are found by shape, not by their place among the arguments' leaves.
  header = hlo.splitlines()[0]
  inputs = re.search(r"entry_computation_layout=\{\((.*?)\)->", header).group(1)
  param_dims = [dims(d) for d in re.findall(r"\w+\[([\d,]*)\]", inputs)]
  aliased = collections.Counter(
      param_dims[int(p)] for p in re.findall(r"\{\d+\}: \((\d+), \{\}, m(?:ay|ust)-alias\)",
                                             header))
  caches = jax.tree.leaves(batch.caches)
  assert not collections.Counter(c.shape for c in caches) - aliased  # all donated and aliased
  copied = {dims(d) for d in re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} copy(?:-start)?\(", hlo)}
  assert not copied & {c.shape for c in caches if c.ndim >= 2}


@pytest.mark.parametrize("steps", [3, 16])
def test_several_steps_per_dispatch_equal_one_step_per_dispatch(tiny, steps):
  variant, model = tiny
  run = lambda k, **kw: generate(model, PROMPTS, NEW_TOKENS, steps_per_dispatch=k, **POOL, **kw)
  one_tokens, one_logits = run(1, return_logits=True)
  tokens, logits = run(steps, return_logits=True)
  assert tokens == one_tokens == HOST_LOOP[variant]  # one step per dispatch: the fixed-trip loop
  for a, b in zip(logits, one_logits):
    np.testing.assert_array_equal(a, b)
  stop = STOP[variant]
  assert run(steps, stop_token_id=stop) == run(1, stop_token_id=stop)
  key = jax.random.key(5)
  assert run(steps, sampling=SAMPLED, key=key) == run(1, sampling=SAMPLED, key=key)


def test_within_topk_switch_keeps_step_by_step_logits():
  """V3.2 with prompts shorter than top-k: the first steps see whole windows (dense path), later
  ones select; dispatches never straddle the switch, and every step agrees with a full forward."""
  model = DeepseekForCausalLM(DecoderConfig.from_hf(tiny_config("v3.2", index_topk=8)),
                              backend="reference", dtype=jnp.float32, param_dtype=jnp.float32,
                              rngs=nnx.Rngs(1))
  prompts = [[5, 6, 7], [9, 10, 11, 12]]  # the longest sees 8 tokens after 4 steps
  tokens, logits = generate(model, prompts, 9, steps_per_dispatch=16, return_logits=True, **POOL)
  assert tokens == generate(model, prompts, 9, steps_per_dispatch=1, **POOL)
  full = forward(model, [p + t[:-1] for p, t in zip(prompts, tokens)])
  for prompt, got, ref in zip(prompts, logits, full):
    np.testing.assert_allclose(got, ref[len(prompt) - 1:], rtol=1e-5, atol=1e-5)


def test_sampling_is_reproducible_per_key_and_differs_across_keys(tiny):
  _, model = tiny
  run = lambda key, sampling=SAMPLED, **kw: generate(model, PROMPTS, NEW_TOKENS, sampling=sampling,
                                                     key=key, **POOL, **kw)
  a = run(jax.random.key(1))
  assert a == run(jax.random.key(1), steps_per_dispatch=4)
  assert a != run(jax.random.key(2))
  assert a != generate(model, PROMPTS, NEW_TOKENS, **POOL)  # not greedy
  # Only the allowed set is ever drawn: top-1 everywhere is greedy.
  top1 = SamplingParams(temperature=1.0, top_k=1)
  assert run(jax.random.key(3), sampling=top1) == generate(model, PROMPTS, NEW_TOKENS, **POOL)
  with pytest.raises(ValueError, match="needs a key"):
    generate(model, PROMPTS, 2, sampling=SAMPLED, **POOL)
  with pytest.raises(ValueError, match="steps_per_dispatch"):
    generate(model, PROMPTS, 2, steps_per_dispatch=0, **POOL)


def test_no_retrace_between_dispatches_of_the_same_shapes(tiny):
  _, model = tiny
  generate(model, PROMPTS, NEW_TOKENS, steps_per_dispatch=4, **POOL)  # 9 steps: 4, 4, then 1
  compiled = decode_steps._cache_size()
  # Other prompts in the same buckets, other lengths and a stop token: fixed-trip dispatches of
  # 4 and shorter or stoppable ones, all through the two loops compiled above.
  others = [[p % 300 + 3 for p in range(20 + i, 30 + 2 * i)] for i in range(3)]
  generate(model, others, 15, steps_per_dispatch=4, stop_token_id=7, **POOL)
  generate(model, PROMPTS[:1] + others[:1], 6, steps_per_dispatch=4, **POOL)
  assert decode_steps._cache_size() == compiled


# --- on a mesh ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh_report():
  return run_with_host_devices("generate_mesh_worker.py")


@pytest.mark.parametrize("case", ["v3-2x2", "v3.2-2x1", "v3.2-2x2"])
def test_generation_on_a_mesh_equals_one_device(mesh_report, case):
  """TP x DCP (V3 and V3.2, every request's blocks spread over the dcp devices) and TP (V3.2),
  4 steps per dispatch: the same greedy, stopped and sampled tokens; generate's and forward's
  logits differ only by o_proj's summation order and the LSE merge."""
  r = mesh_report[case]
  assert r["tokens"] and r["stopped"] and r["sampled"], r
  for k in ("logits", "forward"):
    assert r[f"max_{k}_diff"] <= 1e-6 * r[f"max_abs_{k}"] + 1e-5, r
