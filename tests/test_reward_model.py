"""Learned reward model: Bradley-Terry loss, training on a synthetic preference set,
held-out ranking, save/load, and the batch scorer."""

import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import ModelConfig
from rljax.train.reward_model import (
    RewardModelConfig,
    RewardModelScorer,
    bradley_terry_loss,
    encode_preferences,
    init_reward_model,
    load_reward_model,
    preference_accuracy,
    save_reward_model,
    sequence_scores,
    train_reward_model,
)

PAD, EOS, GOOD = 0, 1, 3
CFG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=64)


class ToyTokenizer:
    """Characters 'a'..'n' -> ids 2..15; pad 0, EOS 1."""

    pad_token_id, eos_token_id = PAD, EOS

    def encode(self, text, add_special_tokens=False):
        return [2 + ord(ch) - ord("a") for ch in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + i - 2) for i in ids if i >= 2)


def _pairs(n, seed):
    """Preferred completions hold more GOOD tokens ('b') than rejected ones."""
    rng = np.random.default_rng(seed)
    tok = ToyTokenizer()
    prompts, chosen, rejected = [], [], []
    others = [c for c in "acdefghijklmn"]
    for _ in range(n):
        prompts.append("".join(rng.choice(others, 3)))
        n_good = rng.integers(1, 4)
        n_bad = rng.integers(0, n_good)
        for n_b, out in ((n_good, chosen), (n_bad, rejected)):
            text = list(rng.choice(others, 7 - n_b)) + ["b"] * n_b
            rng.shuffle(text)
            out.append("".join(text))
    return encode_preferences(tok, prompts, chosen, rejected, max_len=12)


def test_bradley_terry_formula():
    rc, rr = jnp.array([2.0, 0.0, -1.0]), jnp.array([0.0, 0.0, 1.0])
    loss, acc = bradley_terry_loss(rc, rr)
    expected = np.mean([np.log1p(np.exp(-d)) for d in (2.0, 0.0, -2.0)])
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert float(acc) == pytest.approx(1 / 3)


def test_score_is_value_at_last_real_token():
    model = init_reward_model(CFG, seed=1)
    ids = jnp.array([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7]], jnp.int32)
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], jnp.float32)
    values = model(ids, mask_BxT=mask > 0)
    scores = sequence_scores(model, ids, mask)
    np.testing.assert_allclose(np.asarray(scores), [values[0, 2], values[1, 4]], rtol=1e-6)
    # Padding side does not change the score of the same sequence.
    np.testing.assert_allclose(float(scores[0]), float(scores[1]), rtol=1e-4, atol=1e-5)


def test_training_lowers_loss_and_ranks_held_out_pairs(tmp_path):
    train, held_out = _pairs(256, seed=0), _pairs(128, seed=1)
    model = init_reward_model(CFG, seed=0)
    loss0, acc0 = preference_accuracy(model, held_out)
    model, hist = train_reward_model(
        model, train, RewardModelConfig(lr=3e-3, warmup_steps=10, steps=80, batch_size=32))
    first = np.mean([h["loss"] for h in hist[:10]])
    last = np.mean([h["loss"] for h in hist[-10:]])
    loss1, acc1 = preference_accuracy(model, held_out)
    # Stated margins: training loss falls by >= 0.2 nats from ~log 2, and held-out pairs
    # are ranked correctly >= 80% of the time (chance is 50%; 128 pairs, so a model at
    # chance reaches 0.8 with probability < 1e-11).
    assert last < first - 0.2, (first, last)
    print(f"held-out loss {loss0:.3f}->{loss1:.3f} acc {acc0:.3f}->{acc1:.3f}; train {first:.3f}->{last:.3f}")
    assert loss1 < loss0 and acc1 >= 0.8, (loss0, acc0, loss1, acc1)

    # Save, load, and score through the reward-function interface.
    save_reward_model(model, tmp_path / "rm")
    loaded, tok = load_reward_model(tmp_path / "rm")
    assert tok is None  # the toy tokenizer has no save_pretrained
    assert preference_accuracy(loaded, held_out) == pytest.approx((loss1, acc1), rel=1e-5)
    scorer = RewardModelScorer(loaded, ToyTokenizer(), max_len=12)
    scores = scorer(["bbbacd", "acdefg"], [{"prompt": "ace"}, {"prompt": "ace"}])
    assert scores.dtype == np.float32 and scores.shape == (2,) and scores[0] > scores[1]
    with pytest.raises(FileExistsError):
        save_reward_model(model, tmp_path / "rm")


def test_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        encode_preferences(ToyTokenizer(), ["a"], ["b"], [], max_len=8)
    with pytest.raises(ValueError, match="pair 0: chosen .* > max_len=4"):
        encode_preferences(ToyTokenizer(), ["abc"], ["defg"], ["d"], max_len=4)
    with pytest.raises(ValueError, match="RewardModelConfig.steps"):
        RewardModelConfig(steps=0)
    with pytest.raises(ValueError, match="lack"):
        train_reward_model(None, {"chosen_BxT": np.zeros((2, 3))}, RewardModelConfig())
    with pytest.raises(FileNotFoundError, match="not a saved reward model"):
        load_reward_model("/nonexistent")


def test_reward_model_as_the_runs_reward(tmp_path):
    """RewardConfig(kind="reward_model") loads a saved model + tokenizer as a batch reward."""
    from rljax.models.tokenizer import build_char_tokenizer
    from rljax.run.builders import build_reward
    from rljax.run.experiment import ExperimentConfig, RewardConfig

    tok = build_char_tokenizer()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=64)
    model = init_reward_model(cfg, seed=3)
    save_reward_model(model, tmp_path / "rm", tokenizer=tok)
    exp = ExperimentConfig(model=cfg, reward=RewardConfig(kind="reward_model",
                                                          model_path=str(tmp_path / "rm")))
    fn, _ = build_reward(exp)
    assert getattr(fn, "is_batch_reward", False)
    texts, meta = ["12", "345"], [{"prompt": "1+1="}, {"prompt": "2+2="}]
    direct = RewardModelScorer(model, tok, max_len=64)(texts, meta)
    np.testing.assert_allclose(fn(texts, meta), direct, rtol=1e-6)
    assert direct[0] != direct[1]
