"""SIGTERM during the SFT warm-up on several processes (issue 46: "signals in every phase"):
every process stops at the same warm-up step and saves it, like an RL step on a pod.

Two processes (`jax.distributed`, one CPU device each) run the warm-up's stop handling
(`StopSignal`, `WarmupStop.after` after each of 30 steps, with a state sharded over both
processes), as `run_experiment` does around its SFT steps; process 1 alone is sent SIGTERM
after its step 2. Both must stop (`Preempted`, SFT phase) at one step, with that step's
checkpoint written by both (orbax's collective save). The RL steps' agreed stop runs end
to end in tests/test_preemption.py; the one-process warm-up stop and its resume in
tests/test_run_safety.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import _multiprocess as mp
import pytest

pytestmark = pytest.mark.slow
TIMEOUT_S = 180  # a guard against a hung collective, not a speed assertion

SCRIPT = textwrap.dedent('''
    import os, pathlib, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from rljax.run.preemption import Preempted, StopSignal
    from rljax.run.warmup_stop import WarmupStop

    class RunDir:  # what WarmupStop.after reads of a run directory
        path = pathlib.Path(sys.argv[3])

    class Held:
        hit = False

    mesh = jax.make_mesh((2,), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = {"w": jax.make_array_from_process_local_data(
        rows, np.full((2,), jax.process_index(), np.float32))}
    with StopSignal() as stop:
        stop.reached(0)  # as run_experiment does before its first step
        warm = WarmupStop(RunDir(), stop, False, sys.stdout)
        try:
            for step in range(1, 31):
                time.sleep(0.15)  # a warm-up step
                if jax.process_index() == 1 and step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)
                warm.after(step, state, {"k": step}, Held())
            print("NOT STOPPED", flush=True)
        except Preempted as e:
            print(f"STOPPED phase={e.phase} step={e.step}", flush=True)
        finally:
            warm.close()
''')


def test_sigterm_to_one_process_stops_every_process_at_one_warm_up_step(tmp_path):
    script = tmp_path / "warm.py"
    script.write_text(SCRIPT)
    port, env = mp.free_port(), mp._env(1)
    procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i),
                               str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = mp.outputs(procs, TIMEOUT_S)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    stops = [next((ln for ln in o.splitlines() if ln.startswith(("STOPPED", "NOT"))), o[-2000:])
             for o in outs]
    assert stops[0] == stops[1] and stops[0].startswith("STOPPED phase=sft step="), stops
    step = int(stops[0].rsplit("=", 1)[1])
    assert 2 <= step < 30, step
    assert "SIGTERM received" not in outs[0]  # JAX's handler on several processes, not ours
    saved = tmp_path / "run" / "sft_checkpoints" / str(step)
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (saved / "state").iterdir()}
