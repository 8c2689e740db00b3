"""`rljax train`'s launch flags: --distributed alone, or with --coordinator HOST:PORT
--num-processes N --process-id I together, and --heartbeat-timeout S; bad combinations
name the flags (status 2) before anything starts. The multi-process runs themselves: tests/test_multiprocess_*.py."""

import pytest

from rljax import cli


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:1234"], "--coordinator: only with --distributed"),
    (["--process-id", "0", "--num-processes", "2"],
     "--num-processes, --process-id: only with --distributed"),
    (["--distributed", "--coordinator", "127.0.0.1:1234", "--num-processes", "2"],
     "also needs --process-id"),
    (["--distributed", "--process-id", "1"], "also needs --coordinator, --num-processes"),
    (["--distributed", "--coordinator", "localhost", "--num-processes", "2",
      "--process-id", "0"], "--coordinator must be HOST:PORT"),
    (["--distributed", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1"),
    (["--distributed", "--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be >= 1"),
    (["--distributed", "--heartbeat-timeout", "0"], "--heartbeat-timeout must be >= 1"),
])
def test_bad_launch_flags_name_the_flags(flags, message, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(cli.jax.distributed, "initialize", lambda **kw: started.append(kw))
    assert cli.main(["train", "no_such_experiment", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("rljax train: error:"), err
    assert not started


def test_launch_flags_reach_jax_distributed(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.jax.distributed, "initialize", lambda **kw: seen.append(kw))
    monkeypatch.setattr(cli.jax.config, "update", lambda *a: seen.append(a))
    monkeypatch.setattr(cli, "load_experiment", lambda *a: (_ for _ in ()).throw(
        FileNotFoundError("stop here")))
    assert cli.main(["train", "x", "--distributed", "--coordinator", "10.0.0.1:8476",
                     "--num-processes", "4", "--process-id", "3"]) == 2
    beat = {"heartbeat_timeout_seconds": cli.HEARTBEAT_TIMEOUT_S}  # a dead peer ends the run
    assert cli.HEARTBEAT_TIMEOUT_S < 60  # issue 17: the survivors exit within 60 s
    assert seen == [("jax_cpu_collectives_implementation", "gloo"),
                    {"coordinator_address": "10.0.0.1:8476", "num_processes": 4,
                     "process_id": 3, **beat}]
    seen.clear()
    assert cli.main(["train", "x", "--distributed"]) == 2  # TPU VMs: peers auto-detected
    assert seen[-1] == beat
    assert cli.main(["train", "x", "--distributed", "--heartbeat-timeout", "7"]) == 2
    assert seen[-1] == {"heartbeat_timeout_seconds": 7}
