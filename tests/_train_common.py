"""Shared tiny fixtures for the trainer tests (tests/test_train_*.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models import Decoder, ModelConfig
from rljax.rewards.device import DeviceReward


class CharTok:
    """A 17-symbol character tokenizer: pad 0, eos 1, then the characters."""

    chars = "0123456789+=-* ab"
    pad_token_id = 0
    eos_token_id = 1

    def encode(self, s):
        return [self.chars.index(c) + 2 for c in s]

    def decode(self, ids):
        return "".join(self.chars[i - 2] for i in ids if i >= 2)


VOCAB = len(CharTok.chars) + 2


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                num_heads=4, num_kv_heads=2)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed=0, mesh=None, **kw):
    """(graphdef, state) of a tiny decoder, sharded over ``mesh`` when given: initialised
    on one device (the same programs as without a mesh, compiled once per worker) and then
    placed per its logical annotations."""
    gd, st = nnx.split(Decoder(tiny_config(**kw), rngs=nnx.Rngs(seed)))
    if mesh is None:
        return gd, st
    from rljax.sharding import shard_params

    return gd, shard_params(st, mesh)


def random_seqs(rng: np.random.Generator, b: int, p: int, t: int) -> dict:
    """Random left-padded prompts and right-padded completions of varying lengths."""
    p_len = rng.integers(1, p + 1, size=b)
    c_len = rng.integers(1, t + 1, size=b)
    prompt = rng.integers(2, VOCAB, size=(b, p)).astype(np.int32)
    comp = rng.integers(2, VOCAB, size=(b, t)).astype(np.int32)
    pm = (np.arange(p)[None, :] >= (p - p_len)[:, None]).astype(np.float32)
    cm = (np.arange(t)[None, :] < c_len[:, None]).astype(np.float32)
    return {"prompt_BxP": np.where(pm > 0, prompt, 0).astype(np.int32), "prompt_mask_BxP": pm,
            "completion_BxT": np.where(cm > 0, comp, 0).astype(np.int32),
            "completion_mask_BxT": cm}


def ctrl_c_at_step(monkeypatch, argv, step: int = 2) -> int:
    """``rljax``'s ``main(argv)`` with Ctrl-C (a KeyboardInterrupt) raised as RL step
    ``step`` starts; its exit code (130 when the run saved and stopped)."""
    from rljax.cli import main
    from rljax.train.rl import RLTrainer

    real_step, calls = RLTrainer.step, []

    def interrupted(self, state, source):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return real_step(self, state, source)

    with monkeypatch.context() as patch:
        patch.setattr(RLTrainer, "step", interrupted)
        return main(argv)


def check_run_files(run_dir) -> None:
    """A finished run's directory holds its config, metrics, evaluations, tokenizer and
    TensorBoard events."""
    for name in ("config.json", "metrics.jsonl", "eval_before.json", "eval_after.json",
                 "tokenizer"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def digit_share(completions, metadata):
    """Host reward: the share of digits in the text, times the prompt's weight."""
    return np.array([m["weight"] * sum(c.isdigit() for c in t) / 3
                     for t, m in zip(completions, metadata)], np.float32)


class DigitShare(DeviceReward):
    """The same reward on token ids (digits are ids 2..11 of CharTok)."""

    def task_arrays(self, metadata):
        return {"weight": np.array([m["weight"] for m in metadata], np.float32)}

    def __call__(self, tokens_BxT, mask_BxT, task):
        digit = (tokens_BxT >= 2) & (tokens_BxT <= 11) & (mask_BxT > 0)
        return task["weight"] * jnp.sum(digit, axis=1) / 3
