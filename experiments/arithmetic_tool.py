"""Multi-turn GRPO with a calculator tool, on a laptop CPU: three-digit multiplication that
a small model trained here can solve only by calling the tool.

Each episode: the prompt is the question (`"123*456.\\n"`); the model calls the calculator
(`<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>`),
reads its `<tool_response>` (appended with loss mask 0: never trained on) and answers
`<answer>56088</answer>` (reward 1 if right; `rljax.envs.ArithmeticToolEnv`). Per seed:

1. a character-level decoder (2 layers, width 128) is initialised from the seed;
2. SFT warm-up on tool-use traces (`rljax.envs.tool_use_trace`, the tool's output masked
   from the loss) until greedy success on validation problems reaches `stop_success`
   (checked every `stop_every` steps, and every step once a problem has succeeded: success
   jumps within a few steps); `success_before` is measured then, on held-out problems;
3. GRPO on episodes (`RLTrainer(multiturn=...)`: turns decoded from one KV cache, tools in
   a worker pool); `success_after` on the same held-out problems.

The control run (seed 0's warm-up, then the same GRPO with the tool disabled: every call
answers "unknown tool") shows that the gain comes from using the tool: without it a model
this size does not multiply three-digit numbers.

    python experiments/arithmetic_tool.py              # 3 seeds and the control
    python experiments/arithmetic_tool.py --seeds 1 --quick   # seconds: a smoke run

The last line is `RESULT seeds=<n> success_before=<x> success_after=<y>
success_after_min=<z> tool_calls_per_episode=<t> turns_mean=<m> control_success=<c>
wall_s=<s>` (means over seeds; `tool_calls_per_episode` and `turns_mean` over the held-out
episodes after GRPO). Results: docs/arithmetic_tool.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.data import ArithmeticTask
from rljax.envs import (ArithmeticToolEnv, EnvLimits, ToolRegistry, arithmetic_tool_rows,
                        tool_use_trace)
from rljax.models import Decoder, ModelConfig
from rljax.models.tokenizer import build_char_tokenizer
from rljax.rewards import RewardPool
from rljax.train import encode_traces
from rljax.train.config import (OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                algorithm_preset)
from rljax.train.multiturn import MultiTurnConfig
from rljax.train.rl import RLTrainer
from rljax.train.sft import SFTTrainer

INSTRUCTION = "{question}\n"  # the warm-up teaches the format; the prompt is the question


@dataclasses.dataclass(frozen=True)
class ToolRun:
    """The experiment's settings (the defaults are the recorded run)."""

    digits: int = 3
    hidden: int = 128
    layers: int = 2
    sft_max_steps: int = 400
    sft_batch: int = 64
    sft_lr: float = 2e-3
    stop_success: float = 0.4
    stop_every: int = 5
    rl_steps: int = 80
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 4e-4
    temperature: float = 0.5
    turn_tokens: int = 96
    max_turns: int = 3
    total_tokens: int = 224
    val_problems: int = 128
    eval_problems: int = 256


QUICK = ToolRun(hidden=32, layers=1, sft_max_steps=2, sft_batch=8, stop_every=1, rl_steps=2,
                prompts_per_step=2, group_size=2, val_problems=4, eval_problems=8)


def make_env(tool: bool):
    """One row's environment: the calculator, or none (the control)."""
    tools = None if tool else ToolRegistry()
    return ArithmeticToolEnv(tools=tools, instruction=INSTRUCTION)


def rows_source(rows):
    """``source(start, n) -> (prompts, metadata)`` over ``rows`` (cycling)."""
    def source(start, n):
        picked = [rows[(start + i) % len(rows)] for i in range(n)]
        return [r["prompt"] for r in picked], picked
    return source


def episodes(tr: RLTrainer, params, rows) -> dict:
    """Greedy episodes of ``rows``: success, tool calls that returned a result, turns."""
    out = tr.multiturn.sample(params, rows_source(rows), 0, len(rows), jax.random.key(0),
                              greedy=True, group_size=1)
    success = np.asarray(out.rollout.rewards_B) == 1.0
    ok_calls = np.array([i["tool_calls"] - i["tool_errors"] for i in out.info])
    return {"success": float(success.mean()), "calls": float(ok_calls.mean()),
            "turns": float(np.mean([i["turns"] for i in out.info])),
            "success_without_call": int(np.sum(success & (ok_calls == 0)))}


def trainer(cfg: ToolRun, gd, tok, pool, tool: bool) -> RLTrainer:
    limits = EnvLimits(max_turns=cfg.max_turns, max_total_tokens=cfg.total_tokens)
    return RLTrainer(
        gd, tok, None,
        algorithm=algorithm_preset("grpo", group_size=cfg.group_size, kl_coef=0.0,
                                   old_logp="sampler"),
        optim=OptimConfig(lr=cfg.lr, warmup_steps=min(5, cfg.rl_steps), schedule="constant"),
        sampling=SamplingConfig(max_new_tokens=cfg.turn_tokens, temperature=cfg.temperature),
        rl=RLConfig(steps=cfg.rl_steps, prompts_per_step=cfg.prompts_per_step, logp_chunk=32),
        prompt_len=16,
        multiturn=MultiTurnConfig(functools.partial(make_env, tool), limits=limits, pool=pool))


def warm_up(cfg: ToolRun, gd, params, tok, tr: RLTrainer, task, seed: int, out):
    """SFT on tool-use traces until greedy validation success reaches ``stop_success``."""
    sft = SFTTrainer(gd, SFTConfig(steps=cfg.sft_max_steps, batch_size=cfg.sft_batch,
                                   optim=OptimConfig(lr=cfg.sft_lr, warmup_steps=10,
                                                     schedule="constant")))
    state = sft.init_state(params, seed=seed)
    val = arithmetic_tool_rows(task, cfg.val_problems, seed=10_000 + seed)
    env, seen = make_env(True), False
    for step in range(1, cfg.sft_max_steps + 1):
        rows = arithmetic_tool_rows(task, cfg.sft_batch, seed=seed * 100_003 + step)
        prompts, traces = zip(*[tool_use_trace(r, env) for r in rows])
        state, m = sft.step(state, encode_traces(tok, prompts, traces, 16, cfg.total_tokens))
        if step % cfg.stop_every == 0 or seen:  # every step once any problem succeeded
            s = episodes(tr, state.params["policy"], val)["success"]
            seen = seen or s > 0
            print(f"seed {seed} sft step {step}: nll={m['nll']:.3f} val_success={s:.3f}",
                  file=out, flush=True)
            if s >= cfg.stop_success:
                break
    return state.params["policy"], step


def rl(tr: RLTrainer, params, seed: int, train_rows, cfg: ToolRun, out, tag: str):
    state = tr.init_state(params, seed=seed)
    source = rows_source(train_rows)
    for step in range(1, cfg.rl_steps + 1):
        state, m = tr.step(state, source)
        if step % 5 == 0 or step == cfg.rl_steps:
            print(f"{tag} rl step {step}: reward={m['reward_mean']:.3f} "
                  f"turns={m['env/turns']:.2f} calls={m['env/tool_calls']:.2f}",
                  file=out, flush=True)
    return state.params["policy"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1 (default 3)")
    ap.add_argument("--quick", action="store_true", help="a tiny smoke run (tests)")
    ap.add_argument("--no-control", action="store_true", help="skip the control run")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {args.seeds}")
    cfg = QUICK if args.quick else ToolRun()
    t0, out = time.time(), sys.stdout
    tok = build_char_tokenizer()
    task = ArithmeticTask(digits=cfg.digits, ops=("*",))
    held_out = arithmetic_tool_rows(task, cfg.eval_problems, seed=999)
    train_rows = arithmetic_tool_rows(task, 4096, seed=7)
    mcfg = ModelConfig(vocab_size=len(tok), hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
                       num_layers=cfg.layers, num_heads=4, num_kv_heads=4,
                       max_position_embeddings=256)
    per_seed, control = [], None
    with RewardPool(workers=1) as pool:
        for seed in range(args.seeds):
            gd, params = nnx.split(Decoder(mcfg, rngs=nnx.Rngs(seed)))
            tr = trainer(cfg, gd, tok, pool, tool=True)
            params, sft_steps = warm_up(cfg, gd, params, tok, tr, task, seed, out)
            before = episodes(tr, params, held_out)
            control_params = jax.tree.map(jnp.copy, params) if seed == 0 else None
            after = episodes(tr, rl(tr, params, seed, train_rows, cfg, out, f"seed {seed}"),
                             held_out)
            row = {"seed": seed, "sft_steps": sft_steps, "before": before, "after": after}
            per_seed.append(row)
            print("SEED " + json.dumps(row), file=out, flush=True)
            if control_params is not None and not args.no_control:
                ctr = trainer(cfg, gd, tok, pool, tool=False)
                control = episodes(ctr, rl(ctr, control_params, seed, train_rows, cfg, out,
                                           "control"), held_out)
                print("CONTROL " + json.dumps(control), file=out, flush=True)
    before = np.array([r["before"]["success"] for r in per_seed])
    after = np.array([r["after"]["success"] for r in per_seed])
    c = float("nan") if control is None else control["success"]
    print(f"RESULT seeds={len(per_seed)} success_before={before.mean():.6f} "
          f"success_after={after.mean():.6f} success_after_min={after.min():.6f} "
          f"tool_calls_per_episode={np.mean([r['after']['calls'] for r in per_seed]):.6f} "
          f"turns_mean={np.mean([r['after']['turns'] for r in per_seed]):.6f} "
          f"control_success={c:.6f} wall_s={time.time() - t0:.3f}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
