"""Smoke tests of experiments/bench_sampler.py's helpers on a tiny model (no timing asserts)."""

import math

import pytest
from flax import nnx

from _experiments import load_experiment
from rljax.models import Decoder, ModelConfig

bench = load_experiment("bench_sampler")


def _tiny(tied):
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=2, num_kv_heads=1, tie_word_embeddings=tied)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def test_decode_step_flops_counts_every_matmul():
    cfg = _tiny(False).config
    h, n, k, d, f, v = 8, 2, 1, 16, 24, 64
    per_layer = d * (2 * n * h + 2 * k * h) + 3 * d * f + 2 * n * h * 10
    assert cfg.head_dim == h
    assert bench.decode_step_flops(cfg, 3, 10) == 2 * 3 * (2 * per_layer + d * v)


def test_head_step_seconds_runs_the_loop_and_refuses_a_tied_head():
    sec = bench.head_step_seconds(_tiny(False), rows=4, steps=3, reps=2)
    assert math.isfinite(sec) and 0 < sec < 10  # a hang guard, not a speed target
    with pytest.raises(ValueError, match="untied lm_head"):
        bench.head_step_seconds(_tiny(True), rows=4, steps=3, reps=2)
