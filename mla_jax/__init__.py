"""mla-jax: DeepSeek's multi-head latent attention (MLA) and sparse attention (DSA) for JAX.

Everything a user needs imports from here: the config, the layer and its jitted step, caches,
the metadata builder, checkpoint loading, the small model with `generate` (and its `prefill` /
`decode` phases, `SamplingParams`), backends, sharding.
"""

from mla_jax import backends, sharding
from mla_jax.backends import BACKENDS, get_backend
from mla_jax.cache import DSACache, DSMLACache, IndexerKCache, LatentCache
from mla_jax.checkpoint import Checkpoint, load_attention_layer
from mla_jax.config import MLAConfig
from mla_jax.metadata import AttentionMetadata, BatchLayout, RequestState, build_metadata
from mla_jax.model import DecoderConfig, DeepseekForCausalLM, decode, forward, generate, prefill
from mla_jax.modules import DeepseekV2MLAAttention, jitted_step
from mla_jax.sampling import SamplingParams
from mla_jax.tiny_checkpoint import write_tiny_checkpoint

__all__ = [
    "AttentionMetadata", "BACKENDS", "BatchLayout", "Checkpoint", "DSACache", "DSMLACache",
    "DecoderConfig", "DeepseekForCausalLM", "DeepseekV2MLAAttention", "IndexerKCache",
    "LatentCache", "MLAConfig", "RequestState", "SamplingParams", "backends", "build_metadata",
    "decode", "forward", "generate", "get_backend", "jitted_step", "load_attention_layer",
    "prefill", "sharding", "write_tiny_checkpoint",
]
