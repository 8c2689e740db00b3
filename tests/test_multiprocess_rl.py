"""Issue 16's acceptance on two processes x 4 CPU devices through the CLI (`rljax train
--distributed --coordinator ...`), against one process x 8 devices, for GRPO, PPO (value
model, GAE, KL in the reward, 2 epochs x 2 minibatches with the in-graph permutation, one
step off: ``rl.max_staleness=1``, its checkpoints holding the in-flight batch) and
DAPO (dynamic sampling with refill rounds of different prompt widths; its per-term reward
means, over every process's rows and every round, equal too), DAPO's policy with LoRA
adapters (split over the mesh by the logical rules, the base frozen). GRPO is scored by a
device reward (the whole step one program, `rljax.train.programs.device`); PPO and DAPO by host
rewards (rollout, scoring on the host, learning program):

- steps 1..3 equal (loss and gradient norms 1e-5 at step 1, 1e-4 later; equal tokens);
- PPO's SFT warm-up steps equal too (loss and gradient norm 1e-5);
- GRPO and PPO save, exit and resume on 2x4 for steps 4..5, and the 2x4 checkpoint
  restores on 1x8 with equal steps and tokens;
- only process 0 writes the run directory;
- LoRA (DAPO's run): steps 1..3 equal, the step-3 checkpoints hold equal adapters, and
  each holds the fingerprint of the seed's initial base (the base never moved).

The runs are described in tests/_multiprocess.py: one pair of processes runs all three
algorithms and both resumes. Packed rows (`rl.tokens_per_micro_batch`, GRPO with a host
reward) of a Qwen3-MoE policy (experts over fsdp, router replay): 2x4 equals 1x8, router
metrics too, and step 1 equals the padded program's on 1x8."""

import _multiprocess as mp
import numpy as np
import pytest

from rljax.run.artifacts import restore_policy

pytestmark = pytest.mark.slow
GRPO = ("loss", "grad_norm")
PPO = ("loss", "grad_norm", "grad_norm_policy", "grad_norm_value")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    scenarios = {
        # A device reward: each step one program, sample -> score -> learn
        "grpo": mp.Scenario(root, "mp_grpo", 'name="grpo", group_size=4', prompts=4,
                            plots=True, reward="rljax_experiment_mp_grpo:even_reward"),
        # 4 prompts x 4 samples, as GRPO: the same sampler programs; one step off
        # (asynchronous): its checkpoints hold the in-flight batch, resumed on both
        "ppo": mp.Scenario(root, "mp_ppo", 'name="ppo", group_size=4, kl_coef=0.02, '
                           'num_epochs=2, num_minibatches=2', prompts=4,
                           sft="SFTConfig(steps=2, batch_size=8)",
                           sets=("rl.max_staleness=1",)),
        # With LoRA adapters on every projection (the update trains them alone): what it
        # checks of the refills is independent of which weights train, and GRPO and PPO
        # compare full-parameter updates; a scenario of its own cost the fixture ~45%.
        "dapo": mp.Scenario(root, "mp_dapo", 'name="dapo", group_size=4, max_refill_rounds=3',
                            prompts=4, resume=False, widths=True,
                            sets=("lora.rank=4", "lora.alpha=8")),
        # Packed rows (a host reward): 12-slot rows, one a micro-batch per batch shard; an
        # MoE policy (experts over fsdp) replaying the sampler's routing
        "packed": mp.Scenario(root, "mp_packed", 'name="grpo", group_size=4', prompts=4,
                              resume=False, sets=("rl.tokens_per_micro_batch=12",), moe=True),
    }
    mp.run_all(root, list(scenarios.values()))
    return scenarios


def test_grpo_steps_equal_one_process(runs):
    """The one-program step over 2 processes x 4 devices: the same tokens, rewards and
    updates as on 1 x 8."""
    s = runs["grpo"]
    mp.check_steps_equal_one_process(s, GRPO, later=("kl_ref",))
    assert mp.rl_rows(s.dir("ref"))[1]["reward_std"] > 0  # the updates are real
    for run in ("ref", "mp"):  # one program a step: no separate rollout / learn phases
        first = next(r for r in mp.read_metrics(s.dir(run)) if r["phase"] == "rl")
        assert "time_step" in first and "time_learn" not in first, run


def test_ppo_steps_equal_one_process(runs):
    """PPO one step off: 2 x 4 equals 1 x 8 (the learned batch was sampled a step
    earlier from step 2 on, on both)."""
    mp.check_steps_equal_one_process(runs["ppo"], PPO, later=("kl_ref", "value_loss"))
    rows = mp.rl_rows(runs["ppo"].dir("mp"))
    assert [rows[k]["async/staleness"] for k in (1, 2, 3)] == [0.0, 1.0, 1.0]


def test_sft_warm_up_steps_equal_one_process(runs):
    """PPO's run starts with 2 SFT steps (the value model then copies the warmed policy)."""
    s = runs["ppo"]
    ref, two = (mp.read_metrics(s.dir(r)) for r in ("ref", "mp"))
    ref, two = ([r for r in rows if r["phase"] == "sft"] for rows in (ref, two))
    assert [r["step"] for r in ref] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(two, ref):
        mp.assert_close(a, b, ("sft/loss", "sft/grad_norm"), mp.FIRST_RTOL, f"SFT step {b['step']}")


@pytest.mark.parametrize("name, numeric", [("grpo", GRPO + ("kl_ref",)), ("ppo", PPO)])
def test_checkpoint_restores_on_both_topologies(runs, name, numeric):
    mp.check_restore_on_both_topologies(runs[name], numeric)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_only_process_zero_writes_the_run_directory(runs, name):
    mp.check_single_writer(runs[name])


def test_dapo_refills_prompts_of_other_widths_equally_on_both_topologies(runs):
    s = runs["dapo"]
    mp.check_steps_equal_one_process(s, GRPO, later=())
    ref, two = mp.rl_rows(s.dir("ref")), mp.rl_rows(s.dir("mp"))
    dyn = ("zero_var_frac", "dyn_refill_rounds", "dyn_dropped_groups", "dyn_short_groups")
    for step in (1, 2, 3):
        assert {k: two[step][k] for k in dyn} == {k: ref[step][k] for k in dyn}, step
    # Step 1 draws 4 short prompts (the 16-token bucket; outcomes never differ: dropped),
    # then 4 long ones (the 32 bucket; kept): rounds of two widths in one batch. Step 2
    # draws only short prompts: every round dropped, the batch is all zero-weight padding.
    assert {k: ref[1][k] for k in dyn} == {"zero_var_frac": 1.0, "dyn_refill_rounds": 1.0,
                                          "dyn_dropped_groups": 4.0, "dyn_short_groups": 0.0}
    assert {k: ref[2][k] for k in dyn} == {"zero_var_frac": 1.0, "dyn_refill_rounds": 3.0,
                                          "dyn_dropped_groups": 16.0, "dyn_short_groups": 4.0}
    assert ref[2]["grad_norm"] == 0.0 and ref[1]["grad_norm"] > 0
    # reward/<term> means over every process's rows and every round: equal to 1 x 8's;
    # step 1's width term averages its all-short round (1.0) and its long round (0.5).
    for step in (1, 2, 3):
        mp.assert_close(two[step], ref[step], ("reward/width", "reward/digits"),
                        mp.TOKEN_RTOL, f"reward terms of step {step}")
    assert ref[1]["reward/width"] == two[1]["reward/width"] == 0.75


def _leaves(tree, path=()) -> dict:
    """Nested dicts' leaves by path."""
    if not isinstance(tree, dict):
        return {path: np.asarray(tree)}
    return {p: v for k, sub in tree.items() for p, v in _leaves(sub, (*path, k)).items()}


def test_lora_adapters_equal_one_process(runs):
    """DAPO's adapters split over 2 processes x 4 devices (fsdp 8 by the logical rules;
    its steps equal 1 x 8's above): the step-3 checkpoints hold the same adapters, and
    both restore onto the seed's rebuilt initial base (`restore_policy` checks the
    fingerprint each saved of its base: the base did not move)."""
    s = runs["dapo"]
    policies = {}
    for run in ("ref", "mp"):
        _, config, policy, _ = restore_policy(s.dir(run), 3)
        assert config.lora is not None and config.lora.rank == 4
        policies[run] = _leaves(policy)
    ref, two = policies["ref"], policies["mp"]
    assert ref.keys() == two.keys()
    adapters = [p for p in ref if any(k.endswith("_lora") for k in p)]
    assert len(adapters) == 2 * 7  # A and B of the one layer's seven projections
    for p in adapters:  # the adapters trained (B starts at zero) and equal across topologies
        assert np.abs(ref[p]).max() > 0, p
        np.testing.assert_allclose(two[p], ref[p], rtol=0, atol=mp.ADAPTER_ATOL,
                                   err_msg=str(p))


MOE = ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean")


def test_packed_moe_steps_equal_one_process_and_the_padded_program(runs):
    """An MoE policy with router replay, on packed rows: the packing plan (made in the
    program from the masks) and the expert ids the sampler recorded are the same on both
    processes, so 2x4 equals 1x8, router metrics too; and step 1 (the same rollout, the
    same routing) equals the padded program's (router metrics aside: statistics of
    micro-batches that packing groups otherwise)."""
    s = runs["packed"]
    mp.check_steps_equal_one_process(s, GRPO + MOE, later=("kl_ref",))
    ref = mp.rl_rows(s.dir("ref"))[1]
    assert ref["moe/kl_sampler_learner"] <= 1e-10 and ref["sampler_gap"] <= 1e-5, ref
    # one step: step 1 (its loss and gradient at the initial weights) is all it compares
    s.in_process("padded", "rl.tokens_per_micro_batch=0", "rl.steps=1")
    packed, padded = ref, mp.rl_rows(s.dir("padded"))[1]
    assert 0 < packed.pop("useful_token_frac") <= 1 and "useful_token_frac" not in padded
    mp.assert_close(packed, padded, GRPO, mp.FIRST_RTOL, "packed vs padded")
