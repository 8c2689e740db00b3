"""Smoke test of experiments/load_memory.py's helpers on a tiny checkpoint (no timing)."""

import jax.numpy as jnp
import numpy as np

from _experiments import load_experiment
from rljax.models import ModelConfig, from_pretrained

load_memory = load_experiment("load_memory")


def test_random_checkpoint_loads_and_rss_is_read(tmp_path):
    cfg = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=1,
                      num_heads=2, num_kv_heads=1)
    nbytes = load_memory.write_random_checkpoint(tmp_path, cfg)
    n_params = sum(int(np.prod(s)) for _, _, s, _ in load_memory_weight_map(cfg))
    assert nbytes > 4 * n_params  # float32 data plus the header
    model = from_pretrained(tmp_path)
    assert model.config == cfg
    assert 0.0 < float(jnp.std(model.embed[...])) < 0.05
    assert load_memory.rss_anon_mb() > 0


def load_memory_weight_map(cfg):
    from rljax.models import weight_map

    return weight_map(cfg)
