"""Which objectives are token-separable: the loss's derivative by a token's log-prob and
entropy depends on that token's values alone (data, masks and stop-gradient weights
aside), so the trainer may form each chunk's gradient in the same pass as its log-probs
(``rljax.train.learn.onepass``).

Separable: ``reinforce`` (RLOO), ``grpo`` (DAPO, Dr.GRPO), ``ppo``, ``cispo``, ``sapo``,
``clip_cov``, ``kl_cov``: per-token surrogates, KL and entropy terms, summed with weights
that depend on the masks only (every aggregation mode). Not separable: ``gspo`` and
``gmpo`` (a sequence's ratio on every token), ``distill`` with a discount (reward-to-go
from the other tokens), and any objective with the sequence-level sampler correction
(``is_level="sequence"``: a weight from the whole sequence's log-probs).
"""

from __future__ import annotations

import functools
from typing import Callable

from rljax.objectives.library import grpo, ppo, reinforce
from rljax.objectives.recent import cispo, clip_cov, kl_cov, sapo

__all__ = ["token_separable"]

_SEPARABLE = (reinforce, grpo, ppo, cispo, sapo, clip_cov, kl_cov)


def token_separable(objective: Callable) -> bool:
    """Whether ``objective`` (a library objective, a ``functools.partial`` of one, or any
    function) is token-separable.

    An attribute ``token_separable`` on the function (or on a partial) decides first: set
    it to True on an objective of your own that is a sum of per-token terms with
    logit-independent weights to let the trainer use the one-pass head. Otherwise the
    library's separable objectives count, unless bound with ``is_level="sequence"``.
    """
    keywords: dict = {}
    fn = objective
    while True:
        flag = getattr(fn, "token_separable", None)
        if flag is not None:
            return bool(flag)
        if not isinstance(fn, functools.partial):
            break
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return any(fn is s for s in _SEPARABLE) and keywords.get("is_level", "token") == "token"
