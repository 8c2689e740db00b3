"""On-policy distillation's teacher: a frozen decoder read from a run directory or a
Hugging Face folder, checked to share the student's tokenizer, its weights sharded over
the run's mesh (global arrays on every process, like the policy's).

`load_teacher(path, tokenizer, mesh)` returns `(graphdef, params)` for
`rljax.train.rl.RLTrainer(teacher=...)`; the trainer computes the teacher's log-probs
inside its learning program (`rljax.train.learn`), so no host ever fetches them.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models import from_pretrained
from rljax.models.hf_config import config_from_hf
from rljax.models.tokenizer import check_same_tokenizer, check_vocab, load_tokenizer
from rljax.run.artifacts import is_run_dir, policy_split, restore_policy, run_tokenizer
from rljax.run.run_writers import run_path

__all__ = ["load_teacher"]


def load_teacher(path: str | os.PathLike, tokenizer, mesh=None, *,
                 dtype: str = "float32") -> tuple:
    """The teacher at `path` as `(graphdef, params)`, sharded over `mesh` (None: one device).

    Args:
      path: an rljax run directory (local or gs://; the policy of its latest checkpoint,
        with the run's tokenizer) or a local Hugging Face model folder (config.json,
        safetensors and tokenizer files).
      tokenizer: the student's tokenizer; the teacher's must map text to the same ids
        (`rljax.models.tokenizer.check_same_tokenizer`).
      mesh: the run's device mesh.
      dtype: matmul dtype of a Hugging Face teacher ("float32" | "bfloat16"; a run
        directory's teacher keeps its run's model config).

    Raises:
      FileNotFoundError: `path` is neither a run directory nor a model folder.
      ValueError: the tokenizers differ, or the teacher's vocabulary cannot hold the
        student's token ids (each error names the teacher's path).
    """
    where = f"teacher {os.fspath(path)!r}"
    if is_run_dir(path):  # its latest policy
        cfg, config, policy, _ = restore_policy(run_path(path), None, mesh)
        if mesh is None:
            # One device, one process: orbax restores onto device 0 *committed*, which would
            # commit the learning program's outputs and recompile the next step's sampler
            # and learning programs; uncommitted like the policy's weights, nothing recompiles.
            policy = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), policy)
        graphdef, params = policy_split(config, policy)
        teacher_tok = run_tokenizer(run_path(path), cfg)
    elif (pathlib.Path(path) / "config.json").is_file():
        teacher_tok = load_tokenizer(path)
        config = config_from_hf(json.loads((pathlib.Path(path) / "config.json").read_text()))
        check_same_tokenizer(tokenizer, teacher_tok, where)  # before reading the weights
        graphdef, params = nnx.split(from_pretrained(path, dtype=dtype, mesh=mesh))
    else:
        raise FileNotFoundError(f"{where} is neither an rljax run directory (config.json with "
                                "a config_hash, checkpoints/) nor a Hugging Face model folder "
                                "(config.json, safetensors)")
    check_same_tokenizer(tokenizer, teacher_tok, where)
    try:
        check_vocab(tokenizer, config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return graphdef, params
