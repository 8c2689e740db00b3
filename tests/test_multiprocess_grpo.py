"""Issue 16's acceptance for GRPO: two processes x 4 CPU devices through the CLI
(`rljax train --distributed --coordinator ...`) equal one process x 8 devices; the 2x4
checkpoint resumes on 2x4 and restores on 1x8 with equal steps and tokens; only process 0
writes the run directory. The runs are described in tests/_multiprocess.py."""

import _multiprocess as mp
import pytest

pytestmark = pytest.mark.slow
NUMERIC = ("loss", "grad_norm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return mp.Scenario(tmp_path_factory.mktemp("mp_grpo"), "mp_grpo",
                       'name="grpo", group_size=4', prompts=4, plots=True).run()


def test_steps_equal_one_process(runs):
    mp.check_steps_equal_one_process(runs, NUMERIC, later=("kl_ref",))


def test_checkpoint_restores_on_both_topologies(runs):
    mp.check_restore_on_both_topologies(runs, NUMERIC + ("kl_ref",))


def test_only_process_zero_writes_the_run_directory(runs):
    mp.check_single_writer(runs)
