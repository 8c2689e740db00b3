import _multiprocess as mp
import pytest
import test_multiprocess_rl as t


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    s = {"packed": mp.Scenario(root, "mp_packed", 'name="grpo", group_size=4', prompts=4,
                               resume=False, sets=("rl.tokens_per_micro_batch=12",))}
    mp.run_all(root, list(s.values()))
    return s


def test_packed(runs):
    t.test_packed_steps_equal_one_process_and_the_padded_program(runs)
