"""Ctrl-C during an RL step is held until the step ends (the step donates the state's
buffers, so a KeyboardInterrupt inside it would leave nothing to save); a second Ctrl-C
stops at once; a state a cut step had donated is not saved over the checkpoints."""

import io
import os
import signal

import jax
import jax.numpy as jnp
import pytest

from rljax.run.preemption import (DeferredInterrupt, Preempted, StopSignal, save_interrupted,
                                  save_step)
from rljax.train.checkpoint import Checkpointer


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own Ctrl-C handler (a pytest-xdist worker ignores SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_inside_the_block_is_held_until_it_ends():
    before = signal.getsignal(signal.SIGINT)
    with DeferredInterrupt() as held:
        _sigint()
        x = jnp.arange(3) + 1  # the block goes on to its end
    assert held.hit and x.tolist() == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_a_second_ctrl_c_stops_at_once():
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt() as held:
            _sigint()
            _sigint()
            raise AssertionError("the second Ctrl-C did not stop the block")
    assert held.hit


def test_no_ctrl_c_no_hit():
    with DeferredInterrupt() as held:
        pass
    assert not held.hit


def test_a_process_that_ignores_ctrl_c_keeps_ignoring_it():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with DeferredInterrupt() as held:
        _sigint()
    assert not held.hit and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_dropped_ctrl_c_still_stops_the_run_after_its_next_step():
    """Outside a step, Ctrl-C raises at once; when a library drops that KeyboardInterrupt
    (Python does, inside a garbage-collection callback), the next step's block starts
    with `hit` set, so the run stops after it; after the last step, the `StopSignal` block
    raises it as it ends."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # dropped after the last step: raised at the end
        with StopSignal() as stop:
            with stop.guard() as held:
                pass
            assert not held.hit
            try:
                _sigint()
                raise AssertionError("Ctrl-C outside a step did not raise")
            except KeyboardInterrupt:
                pass  # dropped, as a garbage-collection callback drops it
            with stop.guard() as held:
                x = jnp.arange(2) + 1  # the step runs to its end
            assert held.hit and x.tolist() == [1, 2]
    assert signal.getsignal(signal.SIGINT) is before
    with StopSignal():  # no Ctrl-C: the block ends quietly
        pass


def _donated_state():
    state = {"w": jnp.ones(4)}
    jax.jit(lambda s: s, donate_argnums=0)(state)  # the program took the buffers
    return state


def test_a_donated_state_is_not_saved_over_the_checkpoints(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": jnp.zeros(4)}, {"phase": "rl"}, force=True)
        ck.wait_until_finished()
        out = io.StringIO()
        state = _donated_state()
        assert state["w"].is_deleted()  # XLA:CPU donates
        save_interrupted(ck, 2, state, {"phase": "interrupted"}, out)
        assert ck.latest_step() == 1 and "nothing new saved" in out.getvalue()
        save_interrupted(ck, 2, {"w": jnp.ones(4)}, {"phase": "interrupted"}, out)
        assert ck.latest_step() == 2 and "checkpoint saved" in out.getvalue()


class _CtrlCInSave(Checkpointer):
    """A checkpointer whose first save gets a Ctrl-C as orbax's call returns (its write
    goes on in the background)."""

    def save(self, step, state, meta=None, *, force=False):
        started = super().save(step, state, meta, force=force)
        if not getattr(self, "signalled", False):
            self.signalled = True
            _sigint()
        return started


def test_ctrl_c_during_a_save_waits_for_it_and_saves_the_step_once(tmp_path):
    """A Ctrl-C that cut orbax's save of the last step half-way left its temporary
    directory, which the interrupt's own save of that step then failed to replace (an
    OSError, and a hang in orbax's shutdown): the campaign's lost run."""
    out = io.StringIO()
    with Checkpointer(tmp_path / "ck") as plain, StopSignal() as stop:
        plain.save(1, {"w": jnp.zeros(4)}, {"phase": "rl"}, force=True)  # still writing:
        save_interrupted(plain, 1, {"w": jnp.zeros(4)}, {"phase": "interrupted"}, out)
        assert plain.all_steps() == [1] and "interrupted at step 1" in out.getvalue()
    with _CtrlCInSave(tmp_path / "ck") as ck, StopSignal() as stop:
        with pytest.raises(KeyboardInterrupt) as e:
            save_step(ck, 2, 2, {"w": jnp.ones(4)}, lambda phase: {"phase": phase}, stop,
                      stop.guard())
        assert e.traceback[-1].name == "save_step"  # held: raised once the call returned
        save_interrupted(ck, 2, {"w": jnp.ones(4)}, {"phase": "interrupted"}, out)
        assert ck.all_steps() == [1, 2] and ck.read_meta(2)["phase"] == "done"


def test_ctrl_c_between_a_step_and_its_metric_line_keeps_the_line(tmp_path):
    """The campaign's run whose step 10 was saved without its line: a Ctrl-C in the
    evaluation after step 2 writes step 2's line before its checkpoint."""
    from types import SimpleNamespace as NS

    from rljax.run.loop import Seeds, rl_loop

    lines, saved = [], []
    rd = NS(path=tmp_path, log=lambda step, m: lines.append(step))
    ck = NS(directory=tmp_path, wait_until_finished=lambda: None,
            save=lambda step, *a, **k: saved.append(step) or True)

    def evaluate(params):  # Ctrl-C while the held-out prompts are scored
        _sigint()

    cfg = NS(rl=NS(steps=4, eval_due=lambda d: d == 2), run=NS(log_every=1, profile_steps=""))
    run = Seeds(step=lambda s: (s, [{"loss": 1.0}]), evaluate=evaluate)
    with pytest.raises(KeyboardInterrupt), StopSignal() as stop:
        rl_loop(cfg, rd, ck, NS(params={"policy": None}), 0, run, lambda *a: {}, stop,
                io.StringIO(), ("loss",))
    assert lines == [1, 2] and saved == [1, 2]


def test_a_ctrl_c_while_waiting_for_a_save_lets_the_save_finish(tmp_path):
    """The campaign's run that lost 13 steps: a Ctrl-C cut the wait for the last step's
    write, and the process exited before orbax finalised it."""
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with Checkpointer(tmp_path / "ck") as ck:
            ck.save(1, {"w": jnp.ones(4)}, {"phase": "done"}, force=True)
            wait = ck._mgr.wait_until_finished

            def cut():  # Ctrl-C as the wait begins
                _sigint()
                wait()
                finished.append(1)

            ck._mgr.wait_until_finished = cut
    assert finished == [1]  # the wait ran to its end; then KeyboardInterrupt
    with Checkpointer(tmp_path / "ck") as ck:
        assert ck.all_steps() == [1]


def _as_two_processes(monkeypatch):
    """This process seen as one of two, with JAX's preemption service."""
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert jax.config.jax_enable_preemption_service  # JAX's default


@pytest.fixture
def sigterm_notices():
    """JAX's C++ SIGTERM handler (which tells the other processes) stood in for by a
    Python one that counts the notices."""
    notices = []
    previous = signal.signal(signal.SIGTERM, lambda *_: notices.append(1))
    yield notices
    signal.signal(signal.SIGTERM, previous)


def test_several_processes_turn_the_first_ctrl_c_into_an_agreed_stop(monkeypatch,
                                                                     sigterm_notices):
    _as_two_processes(monkeypatch)
    with StopSignal() as stop:
        assert stop.cause == "SIGTERM"
        with stop.guard() as held:  # no lone save to protect: nothing held
            _sigint()
            x = jnp.arange(3) + 1
        assert sigterm_notices == [1] and not held.hit and x.tolist() == [1, 2, 3]
        # This process's stop message names the Ctrl-C (the others' name SIGTERM).
        assert stop.cause == "Ctrl-C (forwarded as SIGTERM)"
        assert "stopped by Ctrl-C (forwarded as SIGTERM) at step 3;" in str(
            Preempted(3, "ck", stop.cause))
        with pytest.raises(KeyboardInterrupt):  # the second: at once
            _sigint()
    assert sigterm_notices == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_one_process_guard_holds_ctrl_c():
    with StopSignal() as stop, stop.guard() as held:
        _sigint()
    assert held.hit


def test_several_processes_save_nothing_alone_after_ctrl_c(monkeypatch, tmp_path):
    with Checkpointer(tmp_path / "ck") as ck:
        _as_two_processes(monkeypatch)
        out = io.StringIO()
        save_interrupted(ck, 2, {"w": jnp.ones(4)}, {"phase": "interrupted"}, out)
        assert ck.latest_step() is None and "nothing new saved" in out.getvalue()
        monkeypatch.undo()  # orbax closes the manager as one process
