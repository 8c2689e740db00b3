"""bfloat16 as the recipes compute: the sampler / learner log-prob gap at step 0 and the
gradient's cosine against float32.

The recipes (``rljax.run.recipes``, experiments/gsm8k_*.py) keep float32 parameters and
compute the forward in bfloat16 (``ModelConfig.compute_dtype="bfloat16"``: matmul inputs
bf16, accumulation, logits, softmax and log-probs float32). The sampler (KV-cache
prefill + decode) and the learning program (one full forward, chunked log-probs, the
one-pass head) are different programs, so at the same parameters and the same tokens
their log-probs differ by rounding. ``old_logp="sampler"`` uses the sampler's log-probs
as the ratio's denominator, and TIS / ICEPOP weight tokens by
``exp(logp_learner - logp_sampler)``: a gap near 1e-2 per token would move ratios by
about 1% before any update, the size of a clip range's fine structure.

This script, on one small random model (Qwen2-like: GQA, qkv bias, tied head) and the
same float32 parameters at both compute dtypes:

1. samples ``prompts x group`` completions at temperature 1 with rljax's sampler;
2. computes the learner's log-probs of those tokens (``policy_logprobs``, shared prompts
   as the recipes' ``share_prompts``) and reports ``|logp_learner - logp_sampler|`` over
   the real completion tokens (mean and max), per compute dtype;
3. computes the GRPO loss's gradient (``rl_loss``, the one-pass head, random group
   advantages) at bf16 and at float32 on the same batch (the float32 sampler's tokens)
   and reports their cosine and relative norm difference.

``--head_scale`` multiplies the tied embedding (so the logits) to make the random
model's next-token distributions as peaked as a trained model's: the default 4 gives
about 0.9 nats per sampled token (1 gives 9, near uniform; 5 gives 0.1); the reported
entropy says where a run stands. It runs anywhere JAX does (XLA:CPU runs bf16 x bf16
dots with float32 accumulation; on a GPU / TPU the same script measures the chip's own
numerics). Ends with one ``RESULT`` line.

    python experiments/bf16_gap.py [--head_scale 4] [--prompts 8 --group 4 --new 64]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models import Decoder, ModelConfig
from rljax.sampling import generate
from rljax.train.config import algorithm_preset
from rljax.train.learn import algorithms as alg
from rljax.train.learn.logprobs import policy_logprobs
from rljax.train.learn.layout import Padded
from rljax.train.learn.loss import rl_loss


def model_config(dtype: str, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=256, intermediate_size=704, num_layers=4,
                       num_heads=8, num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, architecture="qwen2",
                       compute_dtype=dtype, max_position_embeddings=256)


def build(vocab: int, head_scale: float, seed: int = 0):
    """Graphdefs at float32 and bfloat16 compute, and one float32 parameter state."""
    model = Decoder(model_config("float32", vocab), rngs=nnx.Rngs(seed))
    gd32, params = nnx.split(model)
    gd16, _ = nnx.split(Decoder(model_config("bfloat16", vocab), rngs=nnx.Rngs(seed)))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * head_scale if "embed" in jax.tree_util.keystr(p) else x, params)
    return gd32, gd16, params


def sample(gd, params, prompts_BxP, group: int, new: int, key):
    res = generate((gd, params), prompts_BxP, key=key, max_new_tokens=new, temperature=1.0,
                   num_samples=group, length_multiple=16)
    seqs = {"prompt_BxP": res.prompt_tokens,
            "prompt_mask_BxP": res.prompt_mask.astype(jnp.float32),
            "completion_BxT": res.tokens,
            "completion_mask_BxT": res.completion_mask.astype(jnp.float32)}
    return seqs, res.sampling_logprobs


def logp_gap(gd, params, seqs, sampler_logp, group: int, chunk: int) -> dict:
    """Learner vs sampler log-probs of the sampled tokens, over real completion tokens."""
    fn = jax.jit(functools.partial(policy_logprobs, gd, chunk=chunk, group=group))
    logp, ent = fn(params, seqs)
    m = np.asarray(seqs["completion_mask_BxT"]) > 0
    gap = np.abs(np.asarray(logp) - np.asarray(sampler_logp))[m]
    return {"gap_mean": float(gap.mean()), "gap_max": float(gap.max()),
            "entropy": float(np.asarray(ent)[m].mean()),
            "logp_mean": float(np.asarray(logp)[m].mean())}


def grpo_grad(gd, params, seqs, sampler_logp, adv_B, group: int, chunk: int, new: int):
    """Gradient of GRPO's loss (per-token mean; one update: the ratio's denominator is the
    current policy) through the one-pass head, as the learning program computes it."""
    a = algorithm_preset("grpo", group_size=group, kl_coef=0.0)
    mb = dict(seqs, sampler_logp_BxT=sampler_logp,
              adv_BxT=jnp.broadcast_to(adv_B[:, None], sampler_logp.shape))
    loss = functools.partial(rl_loss, policy_gd=gd, value_gd=None,
                             objective=alg.make_objective(a, new), chunk=chunk,
                             temperature=1.0, remat=False, self_old=True, use_sampler=False,
                             entropy_grad=False, layout=Padded(group), one_pass=True)

    def f(p):
        s, n, _ = loss({"policy": p}, mb, alg.make_coef(a))
        return s / n

    return jax.jit(jax.grad(f))(params)


def cosine(a, b) -> tuple[float, float]:
    x = np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(a)])
    y = np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(b)])
    return (float(x @ y / np.linalg.norm(x) / np.linalg.norm(y)),
            float(np.linalg.norm(x - y) / np.linalg.norm(y)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--head_scale", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gd32, gd16, params = build(args.vocab, args.head_scale, args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(1, args.vocab, size=(args.prompts, args.prompt_len)).astype(np.int32)
    key = jax.random.key(args.seed)
    out = {}
    for name, gd in (("f32", gd32), ("bf16", gd16)):
        seqs, slogp = sample(gd, params, prompts, args.group, args.new, key)
        out[name] = logp_gap(gd, params, seqs, slogp, args.group, args.chunk)
        out[name + "_batch"] = (seqs, slogp)
        print(f"{name}: sampler/learner |dlogp| mean {out[name]['gap_mean']:.3e} max "
              f"{out[name]['gap_max']:.3e}; entropy {out[name]['entropy']:.2f} nats, "
              f"mean logp {out[name]['logp_mean']:.2f}", flush=True)
    seqs, slogp = out["f32_batch"]
    adv_B = jnp.asarray(rng.standard_normal(slogp.shape[0]), jnp.float32)
    g32 = grpo_grad(gd32, params, seqs, slogp, adv_B, args.group, args.chunk, args.new)
    g16 = grpo_grad(gd16, params, seqs, slogp, adv_B, args.group, args.chunk, args.new)
    cos, rel = cosine(g16, g32)
    print(f"GRPO gradient, bf16 vs float32 compute: cosine {cos:.6f}, relative difference "
          f"{rel:.3e}", flush=True)
    res = dict(device=jax.devices()[0].device_kind.replace(" ", "_"),
               head_scale=args.head_scale, entropy=round(out["bf16"]["entropy"], 3),
               gap_bf16_mean=f"{out['bf16']['gap_mean']:.3e}",
               gap_bf16_max=f"{out['bf16']['gap_max']:.3e}",
               gap_f32_mean=f"{out['f32']['gap_mean']:.3e}",
               grad_cos=f"{cos:.6f}", grad_rel_diff=f"{rel:.3e}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    return res


if __name__ == "__main__":
    main()
