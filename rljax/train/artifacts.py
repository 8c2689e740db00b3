"""Trained policies as files: load from a run directory or an HF folder, export, sample.

A *source* is either
- a run directory (`config.json` with a `config_hash`, `checkpoints/`): the policy of its
  latest (or a chosen) checkpoint, on the architecture of the run's config, with the
  run's tokenizer (`tokenizer/` in the run directory, else the config's tokenizer), or
- a Hugging Face model folder (`config.json` + safetensors + tokenizer files).

These are the Python calls behind `rljax export` and `rljax sample`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from rljax.train.checkpoint import Checkpointer, pure_params

__all__ = ["export_hf", "is_run_dir", "load_policy", "sample_texts"]


def is_run_dir(path: str | pathlib.Path) -> bool:
    """True when `path` is an rljax run directory (its config.json carries a config hash)."""
    cfg = pathlib.Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "config_hash" in json.loads(cfg.read_text())
    except json.JSONDecodeError:
        return False


def _run_tokenizer(run_dir: pathlib.Path, cfg) -> Any:
    from rljax.models.tokenizer import build_char_tokenizer, load_tokenizer

    if (run_dir / "tokenizer").is_dir():
        return load_tokenizer(run_dir / "tokenizer")
    if cfg.tokenizer not in (None, "char"):
        return load_tokenizer(cfg.tokenizer)
    if cfg.tokenizer is None:
        return load_tokenizer(cfg.hf_path)
    return build_char_tokenizer()


def _policy_from_run(run_dir: pathlib.Path, step: int | None):
    from rljax.models import Decoder
    from rljax.models.hf_io import from_pretrained
    from rljax.train.experiment import load_run_config

    cfg = load_run_config(run_dir)
    ck_dir = run_dir / "checkpoints"
    if not ck_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} has no checkpoints/ to load a policy from")
    with Checkpointer(ck_dir) as ck:
        raw, meta = ck.restore_raw(step)
    try:
        policy = pure_params(raw["params"]["policy"])
    except (KeyError, TypeError):
        raise ValueError(f"checkpoint {meta.get('step')} in {ck_dir} holds no params['policy']") from None
    if cfg.model is not None:
        model = Decoder(cfg.model, rngs=nnx.Rngs(0))
    else:
        model = from_pretrained(cfg.hf_path)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, policy)
    nnx.update(model, state)
    return model, _run_tokenizer(run_dir, cfg), cfg


def load_policy(source: str | pathlib.Path, *, step: int | None = None):
    """`(Decoder, tokenizer, ExperimentConfig or None)` from a run directory or HF folder."""
    from rljax.models.hf_io import from_pretrained
    from rljax.models.tokenizer import load_tokenizer

    source = pathlib.Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is neither a run directory nor a model folder")
    if is_run_dir(source):
        return _policy_from_run(source, step)
    if step is not None:
        raise ValueError(f"step={step} applies to run directories; {source} is a model folder")
    return from_pretrained(source), load_tokenizer(source), None


def export_hf(source: str | pathlib.Path, out_dir: str | pathlib.Path, *,
              step: int | None = None) -> pathlib.Path:
    """Write the policy of `source` as a Hugging Face folder (weights, config, tokenizer)."""
    from rljax.models.hf_io import save_pretrained

    out = pathlib.Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export: {out} exists and is not empty; choose a new folder")
    model, tokenizer, _ = load_policy(source, step=step)
    save_pretrained(model, out)
    tokenizer.save_pretrained(str(out))
    return out


def sample_texts(source: str | pathlib.Path, prompts: Sequence[str], *, num_samples: int = 1,
                 max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
                 step: int | None = None) -> list[list[str]]:
    """`num_samples` completions (text, up to EOS) of each prompt from the policy of `source`.

    `temperature=0` decodes greedily. Prompts are used as given (no chat template).
    """
    from rljax.models.tokenizer import encode_prompts
    from rljax.sampling import generate

    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    model, tokenizer, _ = load_policy(source, step=step)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    res = generate(model, encode_prompts(tokenizer, list(prompts)), key=jax.random.key(seed),
                   max_new_tokens=max_new_tokens, temperature=temperature,
                   stop_ids=() if eos is None else (eos,), num_samples=num_samples, pad_id=pad)
    tokens, mask = np.asarray(res.tokens), np.asarray(res.completion_mask)
    texts = [tokenizer.decode([int(t) for t, m in zip(row, mrow) if m and t != eos])
             for row, mrow in zip(tokens, mask)]
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
