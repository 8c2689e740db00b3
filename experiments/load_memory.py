"""Host memory of `rljax.models.from_pretrained`: anonymous RSS increase vs checkpoint size.

Writes a random float32 Llama-style checkpoint (a few hundred MB) tensor by tensor, warms
up the loader on a tiny checkpoint (so JAX/XLA start-up is not counted), then measures
RssAnon (/proc/self/status: private anonymous memory; the memory-mapped safetensors pages
are file-backed and not counted) before and after loading, and its peak during the load
(sampled every 2 ms). Target: increase <= ~1.3x the checkpoint size.

    python experiments/load_memory.py [--layers 4] [--hidden 1024] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import tempfile
import threading
import time

import numpy as np


def rss_anon_mb() -> float:
    """This process's RssAnon in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("RssAnon not found in /proc/self/status (Linux only)")


class PeakSampler(threading.Thread):
    """Samples RssAnon in the background; `.peak` is the maximum seen."""

    def __init__(self, period_s=0.002):
        super().__init__(daemon=True)
        self.period_s, self.peak, self._stop_evt = period_s, rss_anon_mb(), threading.Event()

    def run(self):
        while not self._stop_evt.is_set():
            self.peak = max(self.peak, rss_anon_mb())
            time.sleep(self.period_s)

    def stop(self):
        self._stop_evt.set()
        self.join()
        self.peak = max(self.peak, rss_anon_mb())


def write_random_checkpoint(path: pathlib.Path, config) -> int:
    """A random checkpoint for `config`, written one tensor at a time; returns its bytes."""
    from rljax.models import config_to_hf, weight_map
    from rljax.models.safetensors_io import write_safetensors

    rng = np.random.default_rng(0)
    specs = [(name, shape, np.float32,
              lambda shape=shape: rng.standard_normal(shape, dtype=np.float32) * 0.02)
             for name, _, shape, _ in weight_map(config)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(config)))
    write_safetensors(path / "model.safetensors", specs)
    return os.path.getsize(path / "model.safetensors")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: tmp)")
    args = ap.parse_args()

    import jax

    from rljax.models import ModelConfig, from_pretrained

    h = args.hidden
    big = ModelConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=(11 * h) // 4,
                      num_layers=args.layers, num_heads=max(h // 64, 1),
                      num_kv_heads=max(h // 256, 1))
    tiny = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = pathlib.Path(tmp)
        ckpt_bytes = write_random_checkpoint(tmp / "big", big)
        write_random_checkpoint(tmp / "tiny", tiny)
        warm = from_pretrained(tmp / "tiny")  # JAX / XLA start-up, not the loader
        jax.block_until_ready(jax.tree.leaves(warm))
        del warm
        gc.collect()
        before = rss_anon_mb()
        sampler = PeakSampler()
        sampler.start()
        model = from_pretrained(tmp / "big")
        jax.block_until_ready(jax.tree.leaves(model))
        sampler.stop()
        gc.collect()
        after = rss_anon_mb()
        ckpt_mb = ckpt_bytes / 2**20
        increase = after - before
        print(f"checkpoint {ckpt_mb:.1f} MiB ({big.num_layers} layers, hidden {h}, "
              f"vocab {big.vocab_size}); RssAnon before {before:.1f}, after {after:.1f}, "
              f"peak during load {sampler.peak:.1f} MiB")
        print(f"RESULT ckpt_mb={ckpt_mb:.1f} rss_anon_increase_mb={increase:.1f} "
              f"ratio={increase / ckpt_mb:.3f} peak_ratio={(sampler.peak - before) / ckpt_mb:.3f}")


if __name__ == "__main__":
    main()
