"""LoRA (issue 42): adapters owned by the layers, a frozen base, a reference that copies
only the adapters.

Tiny models throughout; every check is exact or at a stated float32 tolerance:
- pairs = layers x matched projections, scanned and unscanned; the base equals the same
  model's without adapters, leaf by leaf; B starts at zero; adapters are float32 and
  split over the mesh by their weight's logical axes;
- with A and B random and nonzero, the adapters' gradients equal autodiff of the dense
  reference W + (alpha / r) A B (1e-5);
- checkpoints hold the adapters, their optimiser state and the step, resume bitwise, and
  refuse another base; `rljax export` writes merged weights transformers loads and, with
  `--adapters`, a PEFT folder peft loads onto the base: both give rljax's logits to 1e-4;
- an RL step changes the adapters and leaves every base weight bitwise unchanged; the
  optimiser holds state for the adapters only; the reference (and a PPO critic) is the
  policy at the start of RL, warmed-up adapters included, so the first step's KL is 0;
  sampler and trainer log-probs agree to 1e-4 with nonzero adapters.

Several seeds in one program with LoRA: tests/test_lora_seeds.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from _lora_common import LORA, randomise_adapters
from _train_common import CharTok, random_seqs, tiny_config
from rljax.cli import main
from rljax.models import Decoder, ModelConfig, ValueModel
from rljax.models.lora import (ADAPTERS, PROJECTIONS, LoraConfig, count_pairs, merged_weight,
                               set_adapters, split_trainable)
from rljax.models.tokenizer import build_char_tokenizer
from rljax.run.builders import build_model
from rljax.run.experiment import ExperimentConfig, RunConfig
from rljax.run.lora_runs import AdapterCheckpoints
from rljax.run.overrides import apply_overrides
from rljax.run.run_dir import RunDir
from rljax.sharding import state_shardings
from rljax.train.batching import encode_pairs
from rljax.train.checkpoint import Checkpointer
from rljax.train.config import AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig, SFTConfig
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.reference import reference_model
from rljax.train.learn.update import new_train_state
from rljax.train.rl import RLTrainer
from rljax.train.sft import SFTTrainer

TOL_GRAD = 1e-5  # adapters' gradients vs the dense reference, float32
TOL_GAP = 1e-4  # sampler vs learner log-probs, float32
TOL_PARITY = 1e-4  # exported folders' logits in transformers / peft vs rljax's, float32


def _model(scan: bool = False, lora: LoraConfig | None = LORA, seed: int = 0, **kw):
    return Decoder(tiny_config(scan_layers=scan, lora=lora, **kw), rngs=nnx.Rngs(seed))


def test_config_validates_and_the_cli_sets_it():
    with pytest.raises(ValueError, match=r"match no projection; the projections are \('q'"):
        LoraConfig(rank=2, targets=("q", "qkv"))
    for bad in (dict(rank=-1), dict(rank=True), dict(alpha=0.0), dict(alpha=float("nan")),
                dict(targets=()), dict(targets=("q", "q_proj"))):
        with pytest.raises(ValueError, match="LoraConfig"):
            LoraConfig(**bad)
    assert LoraConfig(targets=("down_proj", "q_proj")).targets == ("q", "down")
    assert LoraConfig(rank=8, alpha=16).scale == 2.0
    assert tiny_config(lora=LoraConfig(rank=0)).lora is None  # rank 0: no adapters
    exp = ExperimentConfig(model=tiny_config())
    exp = apply_overrides(exp, ["lora.rank=32", "lora.alpha=64", "lora.targets=q,v"])
    assert exp.lora == LoraConfig(rank=32, alpha=64.0, targets=("q", "v"))
    with pytest.raises(ValueError, match="model.lora"):
        ExperimentConfig(model=tiny_config(lora=LORA))
    warm = ["sft.steps=2", "sft.full_parameters=true"]
    assert apply_overrides(exp, warm).warms_up_base  # the warm-up trains the base
    with pytest.raises(ValueError, match="sft.full_parameters.*without LoRA adapters"):
        apply_overrides(ExperimentConfig(model=tiny_config()), warm)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_pairs_per_layer_and_projection_and_an_unchanged_base(scan):
    targets = ("q", "o", "up", "down")
    state = nnx.split(_model(scan, LoraConfig(rank=3, targets=targets), num_layers=2))[1]
    plain_state = nnx.split(_model(scan, None, num_layers=2))[1]
    assert count_pairs(state) == 2 * len(targets)  # layers x matched projections
    abstract = lambda **kw: nnx.split(nnx.eval_shape(lambda: _model(scan, **kw)))[1]
    assert count_pairs(abstract(num_layers=3)) == 3 * len(PROJECTIONS)
    adapters, base = split_trainable(state)
    assert jax.tree.structure(base) == jax.tree.structure(plain_state)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(plain_state)):
        np.testing.assert_array_equal(a, b)  # the adapters draw from their own stream
    for path, var in nnx.to_flat_state(adapters):
        assert var.get_value().dtype == jnp.float32
        if path[-1] == "b":
            assert not np.any(var.get_value())  # B starts at zero (PEFT's init)
    assert all(v.get_value().dtype == jnp.float32 for _, v in
               nnx.to_flat_state(split_trainable(abstract(compute_dtype="bfloat16"))[0]))


def test_adapters_are_placed_by_the_logical_rules(mesh8):
    """Each adapter carries its weight's logical axes (the rank axis replicated), so
    `rljax.sharding` splits it as the weight: q's A over fsdp (embed), its B over tensor
    (heads); down's A over tensor (mlp), its B over fsdp; stacked layers keep L whole."""
    abstract = nnx.split(nnx.eval_shape(lambda: _model(True)))[1]
    sh = {p: v.get_value().spec for p, v in
          nnx.to_flat_state(state_shardings(split_trainable(abstract)[0], mesh8))}
    assert sh[("layers", "attn", "q_lora", "a")] == P(None, "fsdp", None)
    assert sh[("layers", "attn", "q_lora", "b")] == P(None, None, "tensor", None)
    assert sh[("layers", "mlp", "down_lora", "a")] == P(None, "tensor", None)
    assert sh[("layers", "mlp", "down_lora", "b")] == P(None, None, "fsdp")


def _merged_base(config: ModelConfig, base, adapters):
    """The base state with each targeted weight replaced by W + (alpha / r) A B."""
    flat, ad = dict(nnx.to_flat_state(base)), dict(nnx.to_flat_state(adapters))
    for path, var in list(flat.items()):
        a = ad.get(path[:-1] + (f"{path[-1]}_lora", "a"))
        if a is None:
            continue
        b = ad[path[:-1] + (f"{path[-1]}_lora", "b")]
        flat[path] = var.replace(merged_weight(var.get_value(), a.get_value(), b.get_value(),
                                               config.lora.scale))
    return nnx.from_flat_state(sorted(flat.items()))


def test_adapter_gradients_match_the_dense_reference(scan=True):
    """d/dA, d/dB of the adapted model == autodiff of the loss of the plain model whose
    weights are W + (alpha / r) A B (A, B random and nonzero), float32, to 1e-5. Stacked
    layers (the adapters' `[L, ...]` layout; the unrolled one shares `dense`)."""
    # q (one contracted axis, split output), o (two contracted axes), down (the MLP).
    model = _model(scan, LoraConfig(rank=3, alpha=5.0, targets=("q", "o", "down")),
                   num_layers=1)
    gd, state = nnx.split(model)
    adapters, base = split_trainable(randomise_adapters(state, scale=0.05))
    plain_gd = nnx.graphdef(nnx.eval_shape(lambda: _model(scan, None, num_layers=1)))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(2, 19, (2, 6)), jnp.int32)
    w_BxTxV = jnp.asarray(rng.normal(size=(2, 6, model.config.vocab_size)), jnp.float32)
    loss = lambda logits: jnp.mean(jax.nn.log_softmax(logits) * w_BxTxV)
    lora_loss = lambda ad: loss(nnx.merge(gd, base, ad)(ids))
    dense_loss = lambda ad: loss(nnx.merge(plain_gd, _merged_base(model.config, base, ad))(ids))
    (l_got, got), (l_want, want) = (jax.jit(jax.value_and_grad(f))(adapters)
                                    for f in (lora_loss, dense_loss))
    np.testing.assert_allclose(l_got, l_want, rtol=TOL_GRAD)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
    for (path, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
        assert float(jnp.max(jnp.abs(w.get_value()))) > 0, path
        np.testing.assert_allclose(g.get_value(), w.get_value(), atol=TOL_GRAD * scale,
                                   rtol=TOL_GRAD, err_msg=str(path))


TOK = CharTok()


def _reward(completions, metadata):  # varied, so the groups' advantages are not all 0
    return np.array([float(len(c) > 0 and ord(c[0]) % 2) for c in completions], np.float32)


def _source(start, n):
    return ["1+2=", "3+4=", "5+6=", "7+8="][:n], [{}] * n


@pytest.fixture(scope="module")
def rl_run():
    """One GRPO step (KL in the loss) of a LoRA policy with nonzero adapters, after an
    SFT warm-up step that trained them (the adapters only)."""
    gd, state = nnx.split(_model(False, num_layers=1))
    state = randomise_adapters(state, scale=0.1)
    sft = SFTTrainer(gd, SFTConfig(batch_size=4, optim=OptimConfig(lr=1e-2)))
    batch = encode_pairs(TOK, ["1+2=", "3+4=", "5+6=", "7+8="], ["3", "7", "11", "15"], 6, 3)
    start = jax.tree.map(np.asarray, split_trainable(state)[0])
    state = sft.step(sft.init_state(state), batch)[0].params["policy"]
    keep = jax.tree.map(np.asarray, state)
    assert not any(np.array_equal(a, b) for a, b in zip(  # the warm-up moved every adapter
        jax.tree.leaves(start), jax.tree.leaves(split_trainable(keep)[0])))
    tr = RLTrainer(gd, TOK, _reward, algorithm=AlgorithmConfig(name="grpo", group_size=2),
                   optim=OptimConfig(lr=1e-2, warmup_steps=1),
                   sampling=SamplingConfig(max_new_tokens=3),
                   rl=RLConfig(steps=2, prompts_per_step=4, logp_chunk=2), prompt_len=6)
    bf16_ref = RLTrainer(gd, TOK, _reward, algorithm=tr.alg, optim=tr.optim,
                         sampling=tr.sampling, prompt_len=6,
                         rl=dataclasses.replace(tr.rl, ref_dtype="bfloat16"))
    with pytest.raises(ValueError, match="copies only its adapters, in the compute dtype"):
        bf16_ref.init_state(state, seed=0)  # not ignored
    ts = tr.init_state(state, seed=0)
    opt_leaves = len(jax.tree.leaves(ts.opt_state))
    new, metrics = tr.step(ts, _source)
    return tr, keep, new, metrics, opt_leaves


def test_an_rl_step_trains_the_adapters_only(rl_run):
    tr, keep, new, metrics, opt_leaves = rl_run
    # The reference holds a copy of the adapters only (the base is the policy's own).
    assert tr.uses_ref and jax.tree.structure(new.ref_params) == jax.tree.structure(
        split_trainable(keep)[0])
    before_ad, before_base = split_trainable(keep)
    after_ad, after_base = split_trainable(new.params["policy"])
    for a, b in zip(jax.tree.leaves(before_base), jax.tree.leaves(after_base)):
        np.testing.assert_array_equal(a, b)  # bitwise: the base never moves
    moved = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(before_ad), jax.tree.leaves(after_ad))]
    assert all(moved), moved
    # Adam's two moments per adapter leaf, its step count and the schedule's.
    n_ad = len(jax.tree.leaves(after_ad))
    assert opt_leaves == len(jax.tree.leaves(new.opt_state)) == 2 * n_ad + 2
    assert metrics["sampler_gap"] < TOL_GAP  # nonzero adapters, float32 both sides
    # The first RL step's KL is 0, as in a full-parameter run: the reference is the
    # policy at the start of RL, warmed-up adapters included (k3 of float32 rounding).
    assert metrics["kl_ref"] < 1e-10


def test_the_reference_is_the_policy_at_the_start_of_rl(rl_run):
    """The reference's log-probs are those of the warmed-up policy (bitwise), not of the
    base with adapters off nor of the policy after the step."""
    tr, keep, new, _, _ = rl_run
    seqs = {k: jnp.asarray(v) for k, v in random_seqs(np.random.default_rng(1), 4, 5, 3).items()}
    gd, params = tr.gd, new.params["policy"]
    logp = jax.jit(lambda g, p: policy_logprobs(g, p, seqs, chunk=2)[0], static_argnums=0)
    ref = jax.jit(lambda p, r: policy_logprobs(*reference_model(gd, p, r, ADAPTERS), seqs,
                                               chunk=2)[0])
    ref = ref(params, new.ref_params)
    np.testing.assert_array_equal(ref, logp(gd, jax.tree.map(jnp.asarray, keep)))
    assert float(jnp.max(jnp.abs(logp(gd, params) - ref))) > 1e-4  # the step moved the policy
    plain_gd = nnx.graphdef(nnx.eval_shape(lambda: _model(False, None, num_layers=1)))
    off = logp(plain_gd, split_trainable(params)[1])  # the base alone: before the warm-up
    assert float(jnp.max(jnp.abs(off - ref))) > 1e-3
    model = nnx.merge(gd, params)
    set_adapters(model, False)  # what computes the base's function inside a model
    assert all(not p.enabled for _, p in nnx.iter_graph(model) if hasattr(p, "enabled"))


def test_a_critic_starts_from_the_warmed_up_policy(rl_run):
    """PPO's critic built from a LoRA policy (``ValueModel.from_policy``): its backbone's
    hidden states are the policy's, adapters included (float32, to 1e-5), and the policy's
    base is untouched."""
    tr, keep, _, _, _ = rl_run
    policy = nnx.merge(tr.gd, jax.tree.map(jnp.asarray, keep))
    critic = ValueModel.from_policy(policy, rngs=nnx.Rngs(3))
    s = random_seqs(np.random.default_rng(2), 4, 5, 3)
    ids = jnp.asarray(np.concatenate([s["prompt_BxP"], s["completion_BxT"]], 1))
    mask = jnp.asarray(np.concatenate([s["prompt_mask_BxP"], s["completion_mask_BxT"]], 1))
    hidden = jax.jit(lambda gd, st: nnx.merge(gd, st).hidden_states(ids, mask_BxT=mask),
                     static_argnums=0)
    want, got = hidden(*nnx.split(policy)), hidden(*nnx.split(critic))
    plain_gd = nnx.graphdef(nnx.eval_shape(lambda: _model(False, None, num_layers=1)))
    off = hidden(plain_gd, split_trainable(keep)[1])  # the base alone
    assert float(jnp.max(jnp.abs(want - off))) > 1e-3  # the adapters matter here
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(split_trainable(nnx.state(policy))[1]),
                    jax.tree.leaves(split_trainable(keep)[1])):
        np.testing.assert_array_equal(a, b)


# --- checkpoints: the adapters, their optimiser state and the step; the base checked ----------

def test_checkpoints_hold_the_adapters_and_resume_exactly(rl_run, tmp_path):
    tr, _, new, _, _ = rl_run
    with Checkpointer(tmp_path / "ck") as raw_ck:
        ck = AdapterCheckpoints(raw_ck)
        ck.save(1, new, {"phase": "rl"}, force=True)
        ck.wait_until_finished()
        saved, meta = raw_ck.restore_raw()
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(saved["params"]["policy"])[0]]
        assert paths and all("_lora'" in p for p in paths), paths  # no base weight saved
        assert meta["phase"] == "rl" and len(meta["lora_base"]) == 8
        # A resumed run rebuilds its base (the same seed) and fresh adapters.
        fresh = tr.init_state(nnx.split(_model(False, num_layers=1))[1], seed=5)
        back, _ = ck.restore(fresh)
        assert jax.tree.structure(back) == jax.tree.structure(new)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(new)):
            np.testing.assert_array_equal(a, b)  # bitwise: the run continues as it was
        other = tr.init_state(nnx.split(_model(False, seed=1, num_layers=1))[1], seed=5)
        with pytest.raises(ValueError, match="refusing to put them on another base"):
            ck.restore(other)


# --- export: merged Hugging Face weights, and a PEFT folder peft loads ------------------------

def test_export_merged_and_peft_folder_match_rljax(tmp_path):
    """A LoRA run on an HF base, its checkpoint exported by `rljax export` (merged) and
    `rljax export --adapters` (PEFT): transformers (merged) and peft on the base model give
    rljax's logits to 1e-4 (float32)."""
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).float().eval()
    hf.save_pretrained(tmp_path / "base")
    run_dir = tmp_path / "run"
    exp = ExperimentConfig(name="lora", hf_path=str(tmp_path / "base"), tokenizer="char",
                           lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "down")),
                           scan_layers=True, run=RunConfig(dir=str(run_dir)))
    RunDir(run_dir, exp).close()
    tok.save_pretrained(str(run_dir / "tokenizer"))
    gd, state = nnx.split(build_model(exp, tok))
    state = randomise_adapters(state, scale=0.2)  # stands for trained adapters
    with Checkpointer(run_dir / "checkpoints") as ck:
        AdapterCheckpoints(ck).save(2, new_train_state({"policy": state}, {}, 0), {}, force=True)
    assert main(["export", str(run_dir), str(tmp_path / "merged")]) == 0
    assert main(["export", str(run_dir), str(tmp_path / "peft"), "--adapters"]) == 0
    ids = np.random.default_rng(0).integers(2, len(tok), (2, 7))
    ours = np.asarray(jax.jit(lambda s: nnx.merge(gd, s)(jnp.asarray(ids)))(state))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float()
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float()
        plain = base(torch.tensor(ids)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
        got = {"merged": merged.eval()(torch.tensor(ids)).logits.numpy(),
               "peft": adapted(torch.tensor(ids)).logits.numpy()}
    assert np.abs(ours - plain).max() > 1e-2  # the adapters matter
    for name, logits in got.items():
        assert np.abs(ours - logits).max() <= TOL_PARITY, name
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (
        4, 8.0, ["down_proj", "o_proj", "q_proj", "v_proj"])
