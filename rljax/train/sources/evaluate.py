"""The one held-out evaluator: greedy results of any rollout source on held-out prompts,
used by training (before, during and after RL), the SFT warm-up's validation, and
``rljax eval``."""

from __future__ import annotations

from typing import Sequence

import jax

__all__ = ["evaluate", "evaluate_seeds"]


def _means(sums: dict, n: int) -> dict:
    """``{"reward_mean", "n", "accuracy" (with a verifier), every other sum's mean}``."""
    out = {"reward_mean": sums.get("reward", 0.0) / max(n, 1), "n": n}
    out.update({k: v / max(n, 1) for k, v in sums.items() if k != "reward"})
    return out


def evaluate(source, params, prompts: Sequence[str], metadata: Sequence[dict], *,
             batch_size: int = 256, k: int = 0, seed: int = 0,
             threshold: float | None = None) -> dict:
    """Greedy results of ``source`` (``rljax.train.sources.RolloutSource``) with the
    policy ``params`` on held-out ``prompts`` in batches of ``batch_size``: every process
    passes the same lists and scores its own rows; ``{"reward_mean", "n"}``, with
    ``"accuracy"`` where the source has a verifier, and the means of any further
    per-row metric it reports (an episode source's ``env/...``).

    ``k >= 1``: also ``"pass@k"`` and the mean over samples from ``k`` completions per
    prompt at the sampling temperature (a source with ``eval_samples``), the batch at
    offset ``i`` drawn with ``jax.random.key(seed + 1 + i)``: with a verifier
    ``"sample_accuracy"``; a reward without one passes ``threshold`` on (a completion
    passes when its reward is ``>= threshold``: ``"sample_pass"``,
    ``"sample_reward_mean"``; ``Rollouts.eval_samples``)."""
    prompts, metadata = list(prompts), list(metadata)
    if len(prompts) != len(metadata):
        raise ValueError(f"evaluate: {len(prompts)} prompts but {len(metadata)} metadata "
                         "entries; give one per prompt")
    sums: dict = {}
    passing = {} if threshold is None else {"threshold": threshold}
    for i in range(0, len(prompts), batch_size):
        batch = (prompts[i:i + batch_size], metadata[i:i + batch_size], i)
        part = source.eval_batch(params, *batch)
        if k:
            part.update(source.eval_samples(params, *batch, k, jax.random.key(seed + 1 + i),
                                            **passing))
        for name, v in part.items():
            sums[name] = sums.get(name, 0.0) + v
    return _means(sums, len(prompts))


def evaluate_seeds(source, params_S, prompts_S: Sequence[Sequence[str]],
                   metadata_S: Sequence[Sequence[dict]], *, batch_size: int = 256) -> list[dict]:
    """:func:`evaluate` of ``S`` seeds at once (a source with ``eval_seeds``: the device
    reward's, one device): seed ``i``'s parameters are ``params_S``'s slice ``i``, its
    prompts ``prompts_S[i]`` (equally many per seed); one dict per seed."""
    s, n = len(prompts_S), len(prompts_S[0]) if prompts_S else 0
    if any(len(p) != n for p in prompts_S) or len(metadata_S) != s:
        raise ValueError("evaluate_seeds: give every seed the same number of prompts and "
                         "one metadata list per seed")
    sums = [{} for _ in range(s)]
    for i in range(0, n, batch_size):
        parts = source.eval_seeds(params_S, [list(p[i:i + batch_size]) for p in prompts_S],
                                  [list(m[i:i + batch_size]) for m in metadata_S])
        for acc, part in zip(sums, parts):
            for k, v in part.items():
                acc[k] = acc.get(k, 0.0) + v
    return [_means(x, n) for x in sums]
