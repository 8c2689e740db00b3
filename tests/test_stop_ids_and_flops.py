"""Issue 40's papercuts and MFU on one device: every stop id of generation_config.json ends
a completion (sampler, truncation flag, loss mask, decoded text), the accuracy verifier
runs under the rewards' time limit, and the step's model FLOPs count every pass the
algorithm needs. (Per-term reward means over processes and DAPO rounds:
tests/test_multiprocess_rl.py.)"""

import json
import logging
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _train_common import CharTok, tiny_config
from _verifiers import MetaVerdict
from rljax.models import Decoder, ModelConfig, ValueModel
from rljax.models.tokenizer import build_char_tokenizer, generation_eos_ids, load_tokenizer
from rljax.rewards import RewardPool
from rljax.run.builders import build_tokenizer
from rljax.train.batching import (completion_mask_from_tokens, decode_completions,
                                  encode_text, pad_left, stop_ids)
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.rl import RLTrainer, PhaseTimes
from rljax.train.sources.evaluate import evaluate
from rljax.train.sources.host import Rollouts


def _with_generation_config(folder, eos_ids):
    build_char_tokenizer(path=folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return load_tokenizer(folder)


def test_stop_ids_come_from_generation_config_and_survive_a_save(tmp_path):
    tok = _with_generation_config(tmp_path / "a", [2, 7])  # <eos> and "d"
    assert stop_ids(tok) == (2, 7)
    tok.save_pretrained(str(tmp_path / "b"))  # a run's tokenizer folder: no generation_config
    assert not (tmp_path / "b" / "generation_config.json").exists()
    assert stop_ids(load_tokenizer(tmp_path / "b")) == (2, 7)
    plain = build_char_tokenizer(path=tmp_path / "c")
    assert generation_eos_ids(tmp_path / "c") == () and stop_ids(plain) == (2,)
    (tmp_path / "c" / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_ids(load_tokenizer(tmp_path / "c")) == (2, 5)
    # A tokenizer folder apart from the checkpoint: the checkpoint's stop ids count too.
    cfg = types.SimpleNamespace(tokenizer=str(tmp_path / "b"), hf_path=str(tmp_path / "c"))
    assert stop_ids(build_tokenizer(cfg)) == (2, 7, 5)
    (tmp_path / "c" / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id=\['x'\]"):
        load_tokenizer(tmp_path / "c")


def test_loss_mask_and_text_end_at_any_stop_id():
    tok = CharTok()  # ids: pad 0, eos 1, "0".."9" 2..11
    tokens = np.array([[3, 4, 1, 5], [3, 11, 4, 1], [3, 4, 5, 6]])
    np.testing.assert_array_equal(completion_mask_from_tokens(tokens, (1, 11)),
                                  [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(completion_mask_from_tokens(tokens, 1),
                                  [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    mask = completion_mask_from_tokens(tokens, (1, 11))
    assert decode_completions(tok, tokens, mask, (1, 11)) == ["12", "1", "1234"]


def zero_reward(completions, metadata):
    return np.zeros(len(completions), np.float32)


def test_rollouts_stop_at_each_stop_id_and_verify_under_the_time_limit(tmp_path, caplog):
    """Greedy decoding stops at generation_config's second EOS (not truncated, left out of
    the text); a verifier that hangs is cut at the reward time limit and counts wrong."""
    tok = build_char_tokenizer()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1)
    gd, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    prompts = ["1+2=", "3+4=", "5+6="]
    ids = [encode_text(tok, p) for p in prompts]
    first = int(jnp.argmax(nnx.merge(gd, params)(jnp.asarray([ids[0]]))[0, -1]))
    assert first not in (0, 2), first  # a real token, not pad or <eos>
    tok = _with_generation_config(tmp_path, [2, first])
    meta = [{"ok": True}, {"ok": True, "sleep": 60.0}, {"ok": False}]
    with RewardPool(1) as pool:
        ro = Rollouts(gd, tok, zero_reward, sampling=SamplingConfig(max_new_tokens=4),
                      prompt_len=8, group_size=1, accuracy_fn=MetaVerdict(),
                      reward_pool=pool, reward_timeout_s=1.0)
        ids_BxP, mask_BxP = pad_left(ids, 8, ro.pad_id)
        out = ro.generate(params, ids_BxP, mask_BxP, jax.random.key(0), greedy=True)
        assert int(out.tokens[0, 0]) == first and int(out.lengths[0]) == 1
        assert not bool(out.truncated[0])
        assert ro.own_texts(out, 0, 3)[0] == ""
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rljax.train.sources.host"):
            res = evaluate(ro, params, prompts, meta, batch_size=3)
    assert time.monotonic() - t0 < 30  # a guard against the hang, not a speed assertion
    assert res["accuracy"] == pytest.approx(1 / 3)
    assert "accuracy verifier 'meta_verdict' timed out" in caplog.text
    assert "prompt index 1" in caplog.text


def _flops(name, value=False, **alg):
    """The trainer's model FLOPs of a step with 100 completion and 40 prompt tokens (no
    prompt sharing), and the parameter counts (policy, value)."""
    policy = Decoder(tiny_config(), rngs=nnx.Rngs(0))
    vm = ValueModel.from_policy(policy, rngs=nnx.Rngs(1)) if value else None
    gd, p = nnx.split(policy)
    params = {"policy": p}
    if vm is not None:
        vgd, params["value"] = nnx.split(vm)
    tr = RLTrainer(gd, CharTok(), zero_reward, algorithm=algorithm_preset(name, **alg),
                   optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=4),
                   rl=RLConfig(steps=1, prompts_per_step=4, share_prompts=False),
                   prompt_len=8, value_graphdef=vgd if value else None)
    tr.num_params = n = sum(x.size for x in jax.tree.leaves(p))
    nv = sum(x.size for x in jax.tree.leaves(params.get("value", {})))
    m = {"completion_tokens": 100.0, "prompt_tokens": 40.0}
    tr.add_throughput(m, PhaseTimes({"rollout": 1.5, "learn": 0.5}), params)
    return m["model_flops_s"] * 2.0, n, nv


def test_model_flops_count_every_pass():
    seq = 140.0
    # PPO, one update: reference and the self-mode old-policy forward; the value model's
    # forward before the updates and its forward + backward; G = 1: every prompt prefilled.
    got, n, nv = _flops("ppo", value=True, num_epochs=1, num_minibatches=1)
    assert nv > 0
    assert got == pytest.approx(2 * n * (100 + 40) + 2 * n * seq * 2 + 6 * n * seq
                                + 2 * nv * seq + 6 * nv * seq)
    # Clip-Cov, 2 epochs: the old-policy recompute and one selection forward per epoch;
    # G = 4: each prompt prefilled once.
    got, n, _ = _flops("clip_cov", group_size=4, num_epochs=2)
    assert got == pytest.approx(2 * n * (100 + 10) + 2 * n * seq * 3 + 6 * n * seq * 2)
    # GRPO, one update with k3 in the loss: the reference forward only.
    got, n, _ = _flops("grpo", group_size=4)
    assert got == pytest.approx(2 * n * (100 + 10) + 2 * n * seq + 6 * n * seq)
