"""A learned reward model: a scalar-head LM trained on preference pairs (Bradley-Terry).

The model is `rljax.models.ValueModel` (the decoder backbone with a scalar head giving
`value_BxT`); the reward of a sequence is the head's output at its last real token:

    r(x, y) = value_BxT[b, last(b)],   last(b) = max{t : mask_BxT[b, t] = 1}

Trained on pairs (x, y_w preferred over y_l) with the Bradley-Terry loss of InstructGPT
(Ouyang et al. 2022, Eq. 1; the 1/C(K,2) pair weighting is a plain mean here):

    loss = -E[ log sigmoid( r(x, y_w) - r(x, y_l) ) ]

`RewardModelScorer` turns a trained model into a batch reward function
`(completions, metadata) -> float32[B]` (it scores `metadata[i]["prompt"] + completion`)
that `rljax.rewards.score_batch` calls once per batch (`is_batch_reward = True`): PPO's
reward model when no verifier exists.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from rljax.models import ModelConfig, ValueModel, load_tokenizer
from rljax.train.batching import encode_text, pad_right, special_ids
from rljax.train.checkpoint import pure_params
from rljax.train.config.checks import check_num
from rljax.train.config.dicts import config_from_dict, config_to_dict

__all__ = [
    "RewardModelConfig", "RewardModelScorer", "bradley_terry_loss", "encode_preferences",
    "init_reward_model", "load_reward_model", "preference_accuracy", "save_reward_model",
    "sequence_scores", "train_reward_model",
]


def init_reward_model(config: ModelConfig, seed: int = 0):
    """A fresh `rljax.models.ValueModel` (scalar head on the decoder backbone)."""
    return ValueModel(config, rngs=nnx.Rngs(seed))


def sequence_scores(model, ids_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Scalar score per row: the value head's output at the last real token, float32[B]."""
    values_BxT = model(ids_BxT, mask_BxT=mask_BxT > 0)
    t = mask_BxT.shape[1]
    last_B = (t - 1) - jnp.argmax(mask_BxT[:, ::-1] > 0, axis=1)  # works for any padding side
    return jnp.take_along_axis(values_BxT, last_B[:, None], axis=1)[:, 0].astype(jnp.float32)


def bradley_terry_loss(r_chosen_B: jax.Array, r_rejected_B: jax.Array):
    """`(loss, accuracy)`: mean of -log sigmoid(r_w - r_l) (Ouyang et al. 2022, Eq. 1) and the
    fraction of pairs ranked correctly (r_w > r_l)."""
    diff = r_chosen_B - r_rejected_B
    return -jnp.mean(jax.nn.log_sigmoid(diff)), jnp.mean((diff > 0).astype(jnp.float32))


def encode_preferences(tokenizer: Any, prompts: Sequence[str], chosen: Sequence[str],
                       rejected: Sequence[str], max_len: int) -> dict[str, np.ndarray]:
    """Right-padded `prompt + completion + EOS` token arrays for both sides of each pair.

    Returns `{"chosen_BxT", "chosen_mask_BxT", "rejected_BxT", "rejected_mask_BxT"}`.
    Sequences longer than `max_len` are an error naming the pair (a truncated pair would
    compare text the labeller never judged).
    """
    if not len(prompts) == len(chosen) == len(rejected):
        raise ValueError(f"encode_preferences: {len(prompts)} prompts, {len(chosen)} chosen, "
                         f"{len(rejected)} rejected; the three lists must have equal length")
    pad, eos = special_ids(tokenizer)
    out = {}
    for side, texts in (("chosen", chosen), ("rejected", rejected)):
        seqs = [encode_text(tokenizer, p) + encode_text(tokenizer, c) + [eos]
                for p, c in zip(prompts, texts)]
        for i, s in enumerate(seqs):
            if len(s) > max_len:
                raise ValueError(f"pair {i}: {side} sequence has {len(s)} tokens > max_len={max_len}")
        out[f"{side}_BxT"], out[f"{side}_mask_BxT"] = pad_right(seqs, max_len, pad)
    return out


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Reward-model training settings (AdamW, constant learning rate after warm-up)."""

    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    steps: int = 200
    batch_size: int = 16
    clip_norm: float = 1.0
    seed: int = 0

    def __post_init__(self):
        c = "RewardModelConfig"
        for name in ("steps", "batch_size", "warmup_steps", "seed"):
            check_num(c, name, getattr(self, name), lo=int(name in ("steps", "batch_size")),
                      integer=True)
        check_num(c, "lr", self.lr, lo=0.0, lo_open=True)
        check_num(c, "weight_decay", self.weight_decay, lo=0.0)
        check_num(c, "clip_norm", self.clip_norm, lo=0.0, finite=False)


def _pair_loss(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    rc = sequence_scores(model, batch["chosen_BxT"], batch["chosen_mask_BxT"])
    rr = sequence_scores(model, batch["rejected_BxT"], batch["rejected_mask_BxT"])
    return bradley_terry_loss(rc, rr)


def _check_pairs(pairs: Mapping[str, np.ndarray]) -> int:
    keys = ("chosen_BxT", "chosen_mask_BxT", "rejected_BxT", "rejected_mask_BxT")
    missing = [k for k in keys if k not in pairs]
    if missing:
        raise ValueError(f"preference pairs lack {missing}; build them with encode_preferences")
    n = {np.shape(pairs[k])[0] for k in keys}
    if len(n) != 1:
        raise ValueError(f"preference arrays disagree on the number of pairs: {sorted(n)}")
    return n.pop()


def preference_accuracy(model, pairs: Mapping[str, np.ndarray], batch_size: int = 64):
    """`(loss, accuracy)` of `model` on `pairs` (accuracy: fraction with r_w > r_l)."""
    n = _check_pairs(pairs)
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, b: _pair_loss(graphdef, p, b))
    tot_loss = tot_acc = 0.0
    for i in range(0, n, batch_size):
        b = {k: jnp.asarray(v[i:i + batch_size]) for k, v in pairs.items()}
        loss, acc = fn(params, b)
        m = next(iter(b.values())).shape[0]
        tot_loss, tot_acc = tot_loss + float(loss) * m, tot_acc + float(acc) * m
    return tot_loss / n, tot_acc / n


def train_reward_model(model, pairs: Mapping[str, np.ndarray], cfg: RewardModelConfig):
    """Fit `model` to `pairs` with the Bradley-Terry loss; returns `(model, history)`.

    Minibatches of `cfg.batch_size` pairs are drawn without replacement per epoch from a
    generator seeded by `cfg.seed`. `history` holds `{"step", "loss", "accuracy"}` per step.
    """
    n = _check_pairs(pairs)
    if cfg.batch_size > n:
        raise ValueError(f"RewardModelConfig.batch_size={cfg.batch_size} exceeds the {n} pairs")
    sched = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity(),
                     optax.adamw(sched, weight_decay=cfg.weight_decay))
    graphdef, params = nnx.split(model)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, acc), grads = jax.value_and_grad(
            lambda p: _pair_loss(graphdef, p, batch), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    rng = np.random.default_rng(cfg.seed)
    order, pos, history = rng.permutation(n), 0, []
    for s in range(cfg.steps):
        if pos + cfg.batch_size > n:
            order, pos = rng.permutation(n), 0
        idx = order[pos:pos + cfg.batch_size]
        pos += cfg.batch_size
        batch = {k: jnp.asarray(np.asarray(v)[idx]) for k, v in pairs.items()}
        params, opt_state, loss, acc = step(params, opt_state, batch)
        history.append({"step": s, "loss": float(loss), "accuracy": float(acc)})
    nnx.update(model, params)
    return model, history


def save_reward_model(model, path: str | pathlib.Path, tokenizer: Any | None = None) -> pathlib.Path:
    """Write `reward_model.json` (the ModelConfig), `params/` (orbax) and `tokenizer/`."""
    path = pathlib.Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; choose a new directory")
    path.mkdir(parents=True, exist_ok=True)
    (path / "reward_model.json").write_text(json.dumps({"model": config_to_dict(model.config)}, indent=2))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", nnx.to_pure_dict(nnx.state(model)))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(path / "tokenizer"))
    return path


def load_reward_model(path: str | pathlib.Path):
    """`(model, tokenizer or None)` saved by `save_reward_model`."""
    path = pathlib.Path(path).absolute()
    meta = path / "reward_model.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a saved reward model (no reward_model.json)")
    config = config_from_dict(ModelConfig, json.loads(meta.read_text())["model"])
    model = init_reward_model(config)
    with ocp.StandardCheckpointer() as ckptr:
        raw = ckptr.restore(path / "params")
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, pure_params(raw))
    nnx.update(model, state)
    tok = path / "tokenizer"
    return model, (load_tokenizer(tok) if tok.is_dir() else None)


class RewardModelScorer:
    """A batch reward function `(completions, metadata) -> float32[B]` from a reward model.

    Scores `metadata[i][prompt_key] + completions[i] + EOS` (no prompt when the key is
    absent), in batches of `batch_size` padded to `max_len` (longer sequences keep their
    last `max_len` tokens, so the scored last token is always the real one).
    """

    is_batch_reward = True

    def __init__(self, model, tokenizer: Any, *, max_len: int = 512, batch_size: int = 32,
                 prompt_key: str = "prompt", name: str = "reward_model"):
        self.tokenizer, self.max_len, self.batch_size = tokenizer, max_len, batch_size
        self.prompt_key, self.name = prompt_key, name
        self._pad, self._eos = special_ids(tokenizer)
        graphdef, self._params = nnx.split(model)
        self._fn = jax.jit(lambda p, ids, m: sequence_scores(nnx.merge(graphdef, p), ids, m))

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, **kwargs) -> RewardModelScorer:
        """A scorer for a directory written by `save_reward_model` (with its tokenizer)."""
        model, tokenizer = load_reward_model(path)
        if tokenizer is None:
            raise FileNotFoundError(f"{path} has no tokenizer/ folder; pass the model instead")
        return cls(model, tokenizer, **kwargs)

    def __call__(self, completions: Sequence[str],
                 metadata: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
        metadata = metadata if metadata is not None else [{}] * len(completions)
        if len(metadata) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(metadata)} metadata")
        seqs = []
        for c, m in zip(completions, metadata):
            prompt = m.get(self.prompt_key, "") if isinstance(m, Mapping) else ""
            ids = encode_text(self.tokenizer, prompt) + encode_text(self.tokenizer, c) + [self._eos]
            seqs.append(ids[-self.max_len:])
        out = np.zeros(len(seqs), np.float32)
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i:i + self.batch_size]
            # Round widths up to a multiple of 16: few distinct shapes, few compiles.
            width = min(self.max_len, -(-max(len(s) for s in chunk) // 16) * 16)
            ids, mask = pad_right(chunk, width, self._pad)
            out[i:i + len(chunk)] = np.asarray(self._fn(self._params, ids, mask))
        return out
