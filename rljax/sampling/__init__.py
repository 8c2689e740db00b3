"""rljax.sampling: exact token sampling ops and the jitted KV-cache sampler.

- :class:`SamplingParams` and the ops in :mod:`rljax.sampling.ops` (temperature, top-k,
  top-p, greedy, exact inverse-CDF sampling, log-probs of chosen tokens).
- :func:`sample_tokens_sharded`: the same draws with the vocabulary split over the mesh's
  "tensor" axis (per-slice summaries exchanged, never the logits); prefill and decode use it.
- :func:`generate`: prefill once, decode in jitted ``lax.while_loop`` phases with the KV
  cache updated in place; returns a :class:`SampleResult`.
- :func:`compiled_count`: programs compiled by the sampler so far (to check bucketing).
- :func:`vocab_major_head`: the decode loop's output projection, ``h_RxD -> logits_VxR``;
  :func:`vocab_major_weight` its ``[V, D]`` weight, and :func:`state_vocab_major_weight`
  that weight built from a model state (once per sampling call).
"""

from rljax.sampling.generate import generate
from rljax.sampling.prompts import PackedPrompts, bucket_length, pack_prompts
from rljax.sampling.result import SampleResult
from rljax.sampling.head import (
    state_vocab_major_weight,
    vocab_major_head,
    vocab_major_weight,
)
from rljax.sampling.sampler import DecodeSpec, DecodeState, compiled_count, plan_phases

from rljax.sampling.ops import (
    SamplingParams,
    filter_logits,
    greedy,
    inverse_cdf_sample,
    sample_tokens,
    sample_tokens_VxR,
    token_logprobs,
)
from rljax.sampling.vocab_shards import sample_tokens_sharded, vocab_shards

__all__ = [
    "DecodeSpec",
    "DecodeState",
    "PackedPrompts",
    "SampleResult",
    "bucket_length",
    "compiled_count",
    "generate",
    "pack_prompts",
    "plan_phases",
    "vocab_major_head",
    "vocab_major_weight",
    "SamplingParams",
    "filter_logits",
    "greedy",
    "inverse_cdf_sample",
    "sample_tokens",
    "sample_tokens_VxR",
    "token_logprobs",
    "sample_tokens_sharded",
    "state_vocab_major_weight",
    "vocab_shards",
]
