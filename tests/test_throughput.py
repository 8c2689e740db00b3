"""Throughput metrics (`rljax.train.throughput`: per-chip rates, the peak table, MFU) and
the step profiler (`rljax.run.profiling`). `rljax train --profile-steps` end to end:
tests/test_cli_train.py; its options: tests/test_profile_steps.py."""

import jax
import jax.numpy as jnp
import pytest

from rljax.run.profiling import StepProfiler, parse_profile_steps
from rljax.train.throughput import (chips_and_kind, peak_flops_per_chip, step_model_flops,
                                    step_throughput)


@pytest.mark.parametrize("kind, peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
    ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
    ("TPU7x", 1153.5e12),  # per device: a TPU7x chip is two devices
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12),
    ("cpu", None), ("TPU v4 lite", None), ("TPU v3", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_table(kind, peak):
    assert peak_flops_per_chip(kind) == peak


def test_step_throughput_per_chip_and_mfu():
    times = {"rollout": 2.0, "reward": 0.5, "learn": 1.5}
    flops = step_model_flops(1000, gen_tokens=400, seq_tokens=600, extra_forwards=2,
                             epochs=2, teacher_params=10)
    assert flops == 2 * 1000 * 400 + 2 * 1000 * 600 * 2 + 6 * 1000 * 600 * 2 + 2 * 10 * 600
    # LoRA: only the adapters' (here 10) weight gradients are formed.
    lora = step_model_flops(1000, gen_tokens=400, seq_tokens=600, extra_forwards=2, epochs=2,
                            teacher_params=10, trainable_params=10)
    assert flops - lora == 2 * (1000 - 10) * 600 * 2
    m = step_throughput(gen_tokens=400, seq_tokens=600, epochs=2, times=times, flops=flops,
                        num_chips=8, peak_per_chip=1e6)
    assert m["rollout_tok_s"] == 200.0 and m["rollout_tok_s_per_chip"] == 25.0
    assert m["train_tok_s"] == 800.0 and m["train_tok_s_per_chip"] == 100.0
    assert m["model_flops_s"] == pytest.approx(flops / 4.0)
    assert m["model_flops_s_per_chip"] == pytest.approx(flops / 4.0 / 8)
    assert m["mfu"] == pytest.approx(flops / 4.0 / 8 / 1e6)
    assert (m["time_rollout"], m["time_reward"], m["time_learn"]) == (2.0, 0.5, 1.5)
    # CPU or an unknown chip: FLOP/s only; no time measured: rates 0, never a division error.
    m = step_throughput(gen_tokens=400, seq_tokens=600, epochs=1, times={}, flops=flops,
                        num_chips=1, peak_per_chip=None)
    assert "mfu" not in m and m["rollout_tok_s"] == m["train_tok_s"] == m["model_flops_s"] == 0
    with pytest.raises(ValueError, match="num_chips must be >= 1"):
        step_throughput(gen_tokens=1, seq_tokens=1, epochs=1, times={}, flops=1.0,
                        num_chips=0, peak_per_chip=None)


def test_chips_and_kind(mesh8):
    assert chips_and_kind(mesh8) == (8, jax.devices()[0].device_kind)
    assert chips_and_kind(None) == (1, jax.devices()[0].device_kind)
    assert peak_flops_per_chip(chips_and_kind(mesh8)[1]) is None  # CPU: no MFU


def test_parse_profile_steps():
    assert parse_profile_steps("3,5") == {3, 5}
    assert parse_profile_steps(" 3-5, 8 ") == {3, 4, 5, 8}
    assert parse_profile_steps("") == frozenset()
    for bad in ("0", "x", "3-", "-3", "5-3", "1-2-3", "3,,5", "1-5000", "²"):
        with pytest.raises(ValueError, match=r"allowed: step numbers from 1 .* '3-5,8'"):
            parse_profile_steps(bad)


def _traces(path):
    return sorted(path.glob("**/*.xplane.pb"))


def test_step_profiler_traces_chosen_runs(tmp_path):
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((8, 8))
    # 2-3 is one trace; 6 is beyond `last`; the trace of 4-5 stops at `last` = 4.
    prof = StepProfiler(parse_profile_steps("2-4,6"), tmp_path / "p", last=4)
    starts = []
    with prof:
        for n in range(1, 5):
            with prof.step(n):
                f(x).block_until_ready()
                starts.append(prof.active)
    assert prof.traced == [2, 3, 4] and starts == [False, True, True, True]
    assert not prof.active and len(_traces(tmp_path / "p")) == 1
    # A failing step stops the trace, so a later trace can start.
    prof = StepProfiler({1, 2}, tmp_path / "q")
    with pytest.raises(RuntimeError, match="boom"):
        with prof.step(1):
            raise RuntimeError("boom")
    assert not prof.active
    with prof.step(2):
        f(x).block_until_ready()
    assert prof.traced == [2] and not prof.active

