"""Smoke tests of experiments/bench_grpo_step.py and bench_train_step.py at tiny sizes, so
they don't rot (no timing asserts; TRL's side only where the bench extra is installed)."""

import importlib.util
import math
import sys

import numpy as np
import pytest

from _experiments import load_experiment
from rljax.models import ModelConfig, from_pretrained

grpo = load_experiment("bench_grpo_step")
train = load_experiment("bench_train_step")
moe = load_experiment("bench_moe")
bench = sys.modules["_bench"]
HAS_TRL = importlib.util.find_spec("trl") is not None


def _result(line: str) -> dict:
    assert line.startswith("RESULT "), line
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def test_forward_flops_counts_projections_causal_attention_and_the_head():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=2, num_kv_heads=1)
    h, n, k, d, f, v, s = 8, 2, 1, 16, 24, 64, 5
    per_token = d * (2 * n * h + 2 * k * h) + 3 * d * f
    per_row = 2 * (s * per_token + 2 * n * h * s * (s + 1) // 2) + 3 * d * v
    assert bench.forward_flops(cfg, 3, s, 3) == 2 * 3 * per_row
    # Sampling 1 token is the prefill alone (its head on the last position).
    assert bench.decode_flops(cfg, 3, s, 1) == bench.forward_flops(cfg, 3, s, 1)


def test_grouped_forward_flops_count_each_prompt_once():
    """One row per group is a causal forward of P + T - 1 tokens (the last completion token
    predicts nothing); G rows save (G - 1) prompt forwards per group, nothing else."""
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=2, num_kv_heads=1)
    p, t, n = 5, 4, 3
    assert bench.grouped_forward_flops(cfg, n, 1, p, t) == bench.forward_flops(cfg, n, p + t - 1, t)
    saved = (bench.grouped_forward_flops(cfg, n * 4, 1, p, t)
             - bench.grouped_forward_flops(cfg, n, 4, p, t))
    assert saved == 3 * bench.forward_flops(cfg, n, p, 0)
    lb = train.LearnBench(bench.TINY, train.QUICK, steps=2)
    sh = train.QUICK
    assert lb.tr.share_group == sh.group
    assert lb.flops() == 4 * bench.grouped_forward_flops(lb.config, sh.prompts, sh.group,
                                                         sh.prompt_len, sh.new_tokens)


def test_build_checkpoint_writes_a_qwen2_initialised_as_transformers_does(tmp_path):
    config = bench.build_checkpoint(tmp_path, bench.TINY, seed=3)
    model = from_pretrained(tmp_path)
    assert model.config == config and config.architecture == "qwen2" and config.qkv_bias
    layer = model.layers[0]
    embed = np.asarray(model.embed[...])
    assert embed.shape == (512, 32) and abs(embed.std() - 0.02) < 1e-3
    assert abs(np.asarray(layer.mlp.up[...]).std() - 0.02) < 2e-3
    assert not np.asarray(layer.attn.q_bias[...]).any()
    np.testing.assert_array_equal(np.asarray(layer.attn_norm.scale[...]), 1.0)
    again = bench.build_checkpoint(tmp_path / "again", bench.TINY, seed=3)
    assert again == config
    np.testing.assert_array_equal(np.asarray(from_pretrained(tmp_path / "again").embed[...]),
                                  embed)  # the seed fixes the weights


def test_cpu_meter_counts_this_process_page_faults_and_kernel_time():
    with bench.CpuMeter() as m:
        buf = np.ones(16 * 2**20, np.float32)  # 64 MiB of fresh pages, each written
    assert buf[-1] == 1.0
    # At least one fault per 2 MiB huge page (THP), 16 Ki where pages are 4 KiB.
    assert m.faults >= 32
    assert m.kernel_s >= 0 and m.self_cores >= 0 and m.others_cores >= 0 and m.wall > 0


def test_train_step_quick_prints_its_result(capsys):
    """With `--lora R` the LoRA program runs beside the full-parameter one (issue 42)."""
    assert train.main(["--quick", "--reps", "1", "--lora", "2"]) == 0
    r = _result(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(r) == {"flops_per_s", "peak_flops_per_s", "fraction", "lora_s", "full_s",
                      "lora_over_full"}
    assert all(math.isfinite(x) and x > 0 for x in r.values())


def test_train_step_logp_chunk_reaches_the_trainer_and_is_checked(capsys):
    assert train.LearnBench(bench.TINY, train.QUICK, steps=2, logp_chunk=3).tr.rl.logp_chunk == 3
    with pytest.raises(SystemExit):
        train.main(["--quick", "--logp-chunk", "0"])
    assert "--logp-chunk must be >= 1, got 0" in capsys.readouterr().err


def test_grpo_step_quick_runs_both_sides(capsys):
    res = grpo.run(grpo.QUICK, steps=1, warmup=1, with_trl=HAS_TRL)
    r = _result(grpo.report(grpo.QUICK, res))
    assert set(r) == {"rljax_step_s", "trl_step_s", "ratio", "floor_s", "over_floor"}
    assert r["rljax_step_s"] > 0 and res["floor"] > 0
    assert 0 < res["rljax"]["tokens"] <= grpo.QUICK.rows * grpo.QUICK.new_tokens
    if HAS_TRL:
        assert r["trl_step_s"] > 0 and res["trl"]["generation"] > 0
        assert res["trl"]["reference"] > 0  # the wrapped reference forward was timed


def test_grpo_step_without_trl_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl -> ImportError
    with pytest.raises(SystemExit, match=r"pip install -e \.\[bench\]"):
        grpo.main(["--quick"])


def test_bench_moe_quick_prints_its_result(capsys):
    out = moe.main(["--quick", "--reps", "1", "--batch", "2", "--seq", "32"])
    assert set(out) == {"moe_s", "dense_active_s", "ratio", "flops_over_active"}
    assert _result(capsys.readouterr().out.strip().splitlines()[-1]) == pytest.approx(
        {k: float(f"{v:.4g}") for k, v in out.items()})


def test_bench_async_prints_its_result_line(capsys):
    """experiments/bench_async.py at a tiny size: its RESULT keys, the asynchronous
    trainer one step off (no timing asserted)."""
    load_experiment("bench_async").main(["--quick", "--steps", "1", "--warmup", "1",
                                         "--sources", "reward"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("RESULT source=reward "), line
    res = _result(line.replace("source=reward ", ""))
    for key in ("sync_s", "async_s", "speedup", "ideal", "efficiency", "overlap_frac"):
        assert math.isfinite(res[key]), key
    assert res["staleness_mean"] == 1.0
