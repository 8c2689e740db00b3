"""experiments/memory_budget.py's machinery on a tiny model with the CPU compiler: every
program of a GRPO recipe compiles ahead of time over a 4 x 2 CPU mesh from abstract
shapes, and the per-chip figures add up (the TPU run itself is by hand, see docs/recipes.md)."""

import dataclasses
import importlib.util
import pathlib
import sys

import jax

from rljax.models import ModelConfig
from rljax.run.experiment_files import load_experiment
from rljax.sharding import MeshConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _budget_module():
    spec = importlib.util.spec_from_file_location("rljax_memory_budget",
                                                  ROOT / "experiments/memory_budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tiny_recipe_compiles_every_program_and_reports_it():
    mb = _budget_module()
    cfg = load_experiment(ROOT / "experiments/gsm8k_qwen25_grpo.py", ["recipe=0.5b-v5e8"])
    cfg = dataclasses.replace(
        cfg, mesh=MeshConfig(data=1, fsdp=4, tensor=2),
        task=dataclasses.replace(cfg.task, max_prompt_tokens=16),
        sampling=dataclasses.replace(cfg.sampling, max_new_tokens=8),
        algorithm=dataclasses.replace(cfg.algorithm, micro_batch_size=8),
        rl=dataclasses.replace(cfg.rl, prompts_per_step=4, logp_chunk=8))
    tiny = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, tie_word_embeddings=True, qkv_bias=True,
                       architecture="qwen2", compute_dtype="bfloat16", scan_layers=True,
                       remat="full")  # the recipes' layout
    lines = []
    rows = mb.compile_recipe(cfg, tiny, jax.devices()[:8], label="tiny", hbm_gib=16.0,
                             log=lines.append)
    assert [r.program for r in rows] == ["prefill", "decode", "logprob", "learn"]
    for r in rows:
        assert r.peak == r.arguments + r.outputs + r.temps + r.code - r.aliased
        assert r.arguments > 0 and r.fits
    # The learning program donates params and optimiser state: their bytes are aliased.
    assert rows[-1].aliased > 0
    # Sampling keeps Adam's moments and the reference resident beside the policy.
    assert rows[0].resident > 0 and rows[-1].resident == 0
    assert "state per chip" in lines[0]
    last = mb.result_line(rows)
    assert last.startswith("RESULT programs=4 worst=tiny/") and last.endswith("fits=true")
    assert "| tiny | learn |" in mb.table(rows)
