"""Issue 16's acceptance for PPO (value model, GAE, KL in the reward, 2 epochs x 2
minibatches with the in-graph permutation): two processes x 4 CPU devices through the CLI
equal one process x 8 devices; the 2x4 checkpoint resumes on 2x4 and restores on 1x8 with
equal steps and tokens; only process 0 writes the run directory. The runs are described
in tests/_multiprocess.py."""

import _multiprocess as mp
import pytest

pytestmark = pytest.mark.slow
NUMERIC = ("loss", "grad_norm", "grad_norm_policy", "grad_norm_value")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    algorithm = 'name="ppo", group_size=1, kl_coef=0.02, num_epochs=2, num_minibatches=2'
    return mp.Scenario(tmp_path_factory.mktemp("mp_ppo"), "mp_ppo", algorithm,
                       prompts=16).run()


def test_steps_equal_one_process(runs):
    mp.check_steps_equal_one_process(runs, NUMERIC, later=("kl_ref", "value_loss"))


def test_checkpoint_restores_on_both_topologies(runs):
    mp.check_restore_on_both_topologies(runs, NUMERIC)


def test_only_process_zero_writes_the_run_directory(runs):
    mp.check_single_writer(runs)
