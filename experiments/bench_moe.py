"""A tiny Qwen3-MoE's learning step against a dense model of the same *active* parameters,
and the compiled MoE layer's FLOPs against its active-parameter FLOPs (issue 57).

Models (float32, random): hidden 256, 4 layers, 8 heads, 4 kv heads (head 32), vocab
4096. MoE: 8 experts of width 352, top-2 (704 active), every layer MoE. Dense: the same
with a SwiGLU MLP of width 704, so both hold the same active parameters (the MoE adds the
8-wide router). One learning step: next-token cross-entropy over ``--batch`` x ``--seq``
tokens, its gradient, an SGD update (parameters donated). The two programs' calls are
interleaved and each side's median is taken over ``--reps`` calls after a compiling call;
other processes' CPU use is printed beside each figure (these cores are shared).

FLOPs: XLA's cost analysis of one compiled MoE layer (router, dispatch, experts, combine)
on the step's tokens, over its active-parameter FLOPs ``2 N (D E + 3 k D F)``.

Targets (issue 57): ``ratio <= 3`` (moe_s / dense_active_s) and ``flops_over_active <= 1.5``.

    python experiments/bench_moe.py [--reps 5] [--batch 16] [--seq 256] [--impl auto]
                                    [--quick]

Last line: ``RESULT moe_s=... dense_active_s=... ratio=... flops_over_active=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from rljax.models import Decoder, ModelConfig  # noqa: E402
from rljax.models.config import MoeConfig  # noqa: E402
from rljax.models.moe import MoeMLP, resolve_impl  # noqa: E402

SIZES = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=4096)
QUICK = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=256)


def configs(sizes: dict, experts: int, k: int, impl: str) -> tuple[ModelConfig, ModelConfig]:
    """(MoE config, dense config of the same active parameters)."""
    active = 704 if sizes is SIZES else 64
    moe = MoeConfig(num_experts=experts, experts_per_token=k, intermediate_size=active // k,
                    impl=impl)
    dense = ModelConfig(intermediate_size=active, qk_norm=True, architecture="qwen3",
                        max_position_embeddings=4096, **sizes)
    return dataclasses.replace(dense, architecture="qwen3_moe", moe=moe), dense


def learn_step(config: ModelConfig):
    """A jitted SGD step on next-token cross-entropy: ``(state, ids) -> (state, loss)``."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))

    def loss_fn(state, ids):
        logits = nnx.merge(graphdef, state)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    def step(state, ids):
        loss, g = jax.value_and_grad(loss_fn)(state, ids)
        return jax.tree.map(lambda p, d: p - 1e-3 * d, state, g), loss

    return jax.jit(step, donate_argnums=0)


def moe_layer_flops(config: ModelConfig, tokens: int) -> tuple[float, float]:
    """(XLA cost-analysis FLOPs of one compiled MoE layer on ``tokens`` tokens, its
    active-parameter FLOPs)."""
    layer = MoeMLP(config, nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((1, tokens, config.hidden_size), jnp.float32)
    fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[0])
    cost = fn.lower(state, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    moe, d = config.moe, config.hidden_size
    active = 2 * tokens * (d * moe.num_experts
                           + 3 * moe.experts_per_token * d * moe.intermediate_size)
    return float(cost["flops"]), float(active)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--impl", default="auto", choices=("auto", "ragged", "tiled"))
    p.add_argument("--quick", action="store_true", help="a one-layer model (smoke test)")
    a = p.parse_args(argv)
    moe_cfg, dense_cfg = configs(QUICK if a.quick else SIZES, a.experts, a.k, a.impl)
    print(f"impl={resolve_impl(a.impl)} experts={a.experts} k={a.k} "
          f"tokens={a.batch * a.seq}", flush=True)
    ids = jax.random.randint(jax.random.key(1), (a.batch, a.seq + 1), 0, moe_cfg.vocab_size)
    sides = {}
    for name, cfg in (("moe", moe_cfg), ("dense", dense_cfg)):
        state = nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)))
        step = learn_step(cfg)
        state, loss = step(state, ids)  # compiles
        loss.block_until_ready()
        sides[name] = [step, state, []]
    for _ in range(a.reps):
        for name, side in sides.items():
            step, state, times = side
            with B.CpuMeter() as m:
                state, loss = step(state, ids)
                loss.block_until_ready()
            side[1] = state
            times.append(m.wall)
            print(f"{name}: {m.wall:.3f} s (others {m.others_cores:.2f} cores)", flush=True)
    moe_s, dense_s = (B.median(sides[n][2]) for n in ("moe", "dense"))
    flops, active = moe_layer_flops(moe_cfg, a.batch * a.seq)
    out = dict(moe_s=moe_s, dense_active_s=dense_s, ratio=moe_s / dense_s,
               flops_over_active=flops / active)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in out.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
