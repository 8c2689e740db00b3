"""rljax.sampling: exact token sampling ops and the jitted KV-cache sampler.

- :class:`SamplingParams` and the ops in :mod:`rljax.sampling.ops` (temperature, top-k,
  top-p, greedy, exact inverse-CDF sampling, log-probs of chosen tokens).
"""

from rljax.sampling.ops import (
    SamplingParams,
    filter_logits,
    greedy,
    inverse_cdf_sample,
    sample_tokens,
    token_logprobs,
)

__all__ = [
    "SamplingParams",
    "filter_logits",
    "greedy",
    "inverse_cdf_sample",
    "sample_tokens",
    "token_logprobs",
]
