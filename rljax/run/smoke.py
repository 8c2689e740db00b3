"""Stand-ins for a recipe's real inputs, made on the fly, so its smoke setting runs on CPU:
a tiny random Hugging Face checkpoint of the same architecture (with a local character
tokenizer and chat template) and a small GSM8K-format prompt set.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from flax import nnx

from rljax.data import ArithmeticTask
from rljax.models import Decoder, ModelConfig
from rljax.models.hf_io import save_pretrained
from rljax.models.tokenizer import build_char_tokenizer

__all__ = ["make_tiny_hf_checkpoint", "write_gsm8k_like"]


def make_tiny_hf_checkpoint(path: str | pathlib.Path | None = None, *, architecture: str = "qwen2",
                            seed: int = 0, max_position_embeddings: int = 512) -> pathlib.Path:
    """Write a random 1-layer, 32-wide decoder of `architecture` (Qwen2: q/k/v biases, tied
    embeddings) plus the char tokenizer as an HF folder; returns its path (a new temporary
    folder when `path` is None)."""
    path = pathlib.Path(path or tempfile.mkdtemp(prefix=f"rljax_tiny_{architecture}_"))
    tok = build_char_tokenizer()
    qwen2 = architecture == "qwen2"
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=max_position_embeddings,
                      rope_theta=1_000_000.0 if qwen2 else 10_000.0, qkv_bias=qwen2,
                      tie_word_embeddings=qwen2, architecture=architecture)
    save_pretrained(Decoder(cfg, rngs=nnx.Rngs(seed)), path)
    tok.save_pretrained(str(path))
    return path


def write_gsm8k_like(path: str | pathlib.Path, *, n_train: int = 64, n_test: int = 16,
                     seed: int = 0) -> pathlib.Path:
    """`train.jsonl` / `test.jsonl` in GSM8K's release format ("question", and "answer" as a
    worked solution ending in `#### <number>`), from `rljax.data`'s word problems."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    task = ArithmeticTask(digits=2, ops=("+", "-"), style="word")
    for split, n, s in (("train", n_train, seed), ("test", n_test, seed + 1)):
        with open(path / f"{split}.jsonl", "w", encoding="utf-8") as fh:
            for p in task.generate(n, seed=s):
                fh.write(json.dumps({"question": p.prompt, "answer": p.solution}) + "\n")
    return path
