"""Abstract inputs of a TPU recipe's programs for ahead-of-time compiles (no weights, no
TPU): sharded `jax.ShapeDtypeStruct` trees of the parameters, optimiser state, prompts
and rollout batch as a run places them. Shared by `memory_budget.py` (per-chip memory),
`collective_budget.py` (collectives) and `roofline.py` (step estimates), which import
this folder's modules by name (``sys.path`` gets this folder first).
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
from flax import nnx

from rljax.sampling.head import _source, _to_VxD_jit
from rljax.sharding import batch_sharding, replicated, state_shardings
from rljax.train.learn.update import opt_state_shardings, trainable
from rljax.train.rl import RLTrainer

GIB = 2.0**30


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a pytree of sharded abstract arrays (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def abstract(values, shardings):
    return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                        values, shardings)


def outputs(compiled):
    """A compiled program's outputs as sharded abstract arrays (inputs of the next one)."""
    return abstract(compiled.out_info, compiled.output_shardings)


def abstract_params(module_fn, mesh):
    """`(graphdef, params)` of `module_fn()` built with `jax.eval_shape`, every leaf an
    abstract array with its sharding from rljax's logical rules."""
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(nnx.eval_shape(module_fn))
    return graphdef, abstract(state, state_shardings(state, mesh))


def cast(tree, dtype: str):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
        sharding=x.sharding), tree)


def key(mesh):
    k = jax.eval_shape(lambda: jax.random.key(0))
    return jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=replicated(mesh))


def batch(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))


class Tokenizer(types.SimpleNamespace):
    """What the trainer reads of a tokenizer before sampling: the pad and stop ids."""


def trainer(cfg, graphdef, value_gd, mesh, model_cfg):
    eos = model_cfg.vocab_size - 1
    return RLTrainer(graphdef, Tokenizer(eos_token_id=eos, pad_token_id=eos), lambda c, m: None,
                     algorithm=cfg.algorithm, optim=cfg.optim, sampling=cfg.sampling,
                     rl=cfg.rl, prompt_len=cfg.task.max_prompt_tokens,
                     value_graphdef=value_gd, mesh=mesh)


def opt_state(trainer, params, mesh):
    """The optimiser state as `init_opt_state` places it."""
    filters = {"policy": trainer.trainable}  # a LoRA policy: its adapters only
    shapes = jax.eval_shape(lambda p: {k: trainer.txs[k].init(p[k]) for k in p},
                            trainable(params, filters)[0])
    return abstract(shapes, opt_state_shardings(trainer.txs, params, mesh, filters))


def sampler_head(params, model_cfg, mesh):
    """The sampler's vocab-major output weight (`state_vocab_major_weight`)."""
    name, already = _source(model_cfg)
    var = params[name]
    w = var.get_value() if hasattr(var, "get_value") else var
    if already and w.dtype == jnp.dtype(model_cfg.compute_dtype):
        return w
    with jax.set_mesh(mesh):
        return outputs(_to_VxD_jit.lower(w, already, jnp.dtype(model_cfg.compute_dtype))
                        .compile())


def rollout(trainer, mesh, b, p, t):
    from rljax.train.batch import Rollout

    f32, i32 = jnp.float32, jnp.int32
    return Rollout(prompt_BxP=batch(mesh, (b, p), i32), prompt_mask_BxP=batch(mesh, (b, p), f32),
                   completion_BxT=batch(mesh, (b, t), i32),
                   completion_mask_BxT=batch(mesh, (b, t), f32),
                   sampler_logp_BxT=batch(mesh, (b, t), f32), truncated_B=batch(mesh, (b,), f32),
                   rewards_B=batch(mesh, (b,), f32), correct_B=batch(mesh, (b,), f32),
                   weight_B=batch(mesh, (b,), f32), group_size=trainer.alg.group_size,
                   has_correct=True)
