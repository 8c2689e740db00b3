"""Smoke test of experiments/load_memory.py's helpers on a tiny checkpoint (no timing)."""

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np

from rljax.models import ModelConfig, from_pretrained

_PATH = pathlib.Path(__file__).parents[1] / "experiments" / "load_memory.py"
_spec = importlib.util.spec_from_file_location("load_memory", _PATH)
load_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_memory)


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
