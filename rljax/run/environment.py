"""The `env` section of an experiment: `rljax train` on multi-turn episodes.

With `ExperimentConfig.env` set, each training prompt's record (the task section's: its
fields, `prompt` and `answer` for the procedural tasks) starts one episode of the
environment per row, which answers the model's turns and whose return is the row's
reward (`rljax.train.multiturn`). The rest of the run is a single-turn run's: run
directory, metrics, plots, TensorBoard, checkpoints, exact resume, SIGTERM, held-out
evaluation (greedy episodes: the mean return, `env/...` means), `rljax eval`, `sample`
and `export`. A user's environment needs its class and this section:

    env=EnvConfig(env="my_env:MyEnv", limits=EnvLimits(max_turns=3, max_total_tokens=256))

| field | meaning |
|---|---|
| `env` | import path `"module:Class"` of the environment (`rljax.envs.Environment`), found as `python -m` finds modules (the current directory first) |
| `options` | keyword arguments of the class, `(("name", value), ...)` of JSON values |
| `tools` | import paths of its tools (each a `rljax.envs.Tool` instance, or a class called with no arguments), set as the environment's `tools` registry; None: the environment's own; `()`: none (every call answers `unknown_tool`: a control run) |
| `limits` | `rljax.envs.EnvLimits` (turns, observation and total tokens, tool limits) |
| `max_model_tokens` | the model's tokens over an episode (`MultiTurnConfig.max_model_tokens`; None: `limits.max_turns x sampling.max_new_tokens`); `sampling.max_new_tokens` is the per-turn budget |
| `chat` | render prompts and observations with the tokenizer's chat template (`rljax.envs.ChatRenderer`) |
| `return_mode`, `gamma` | the episode return (`rljax.envs.episode_return`) |
| `obs_multiple` | the observation widths' bucket |
| `tool_workers` | worker processes that run the tool calls (a `rljax.rewards.RewardPool`) |
| `sft_trace` | import path of `trace(metadata, env) -> (prompt, segments)` for the SFT warm-up (segments `(text, trained)`, `rljax.envs.tool_use_trace`'s form; `env` with its own tools, whatever `tools` says); None: the task's worked examples |
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.envs import ChatRenderer, EnvLimits, ToolRegistry
from rljax.envs.protocol import RETURN_MODES
from rljax.rewards.imported import load_function
from rljax.train.batching import encode_pairs, encode_traces
from rljax.train.config.checks import check_bool, check_choice, check_num, fail
from rljax.train.multiturn import MultiTurnConfig, response_budget

__all__ = ["EnvConfig", "EnvFactory", "build_multiturn", "check_env", "check_env_section",
           "encode_sft", "episode_eval", "trace_examples"]


def _check_path(field: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        fail("EnvConfig", field, value, "an import path 'module:name'"
             + (" or None" if optional else ""))


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """A run's multi-turn environment (the module docstring's table)."""

    env: str
    options: tuple[tuple[str, Any], ...] = ()
    tools: tuple[str, ...] | None = None
    limits: EnvLimits = EnvLimits()
    max_model_tokens: int | None = None
    chat: bool = False
    return_mode: str = "sum"
    gamma: float = 1.0
    obs_multiple: int = 16
    tool_workers: int = 1
    sft_trace: str | None = None

    def response_budget(self, turn_tokens: int) -> int:
        """The model's tokens an episode may hold (``MultiTurnConfig.response_budget``)."""
        return response_budget(self.max_model_tokens, self.limits, turn_tokens)

    def __post_init__(self):
        c = "EnvConfig"
        _check_path("env", self.env)
        if not isinstance(self.options, tuple) or not all(
                isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) and o[0]
                for o in self.options):
            fail(c, "options", self.options, "a tuple of (name, value) pairs")
        if self.tools is not None:
            if not isinstance(self.tools, tuple):
                fail(c, "tools", self.tools, "a tuple of import paths or None")
            for t in self.tools:
                _check_path("tools", t)
        if not isinstance(self.limits, EnvLimits):
            fail(c, "limits", self.limits, "a rljax.envs.EnvLimits")
        if self.max_model_tokens is not None:
            check_num(c, "max_model_tokens", self.max_model_tokens, lo=1, integer=True)
        check_bool(c, "chat", self.chat)
        check_choice(c, "return_mode", self.return_mode, RETURN_MODES)
        check_num(c, "gamma", self.gamma, lo=0, hi=1)
        check_num(c, "obs_multiple", self.obs_multiple, lo=1, integer=True)
        check_num(c, "tool_workers", self.tool_workers, lo=1, integer=True)
        _check_path("sft_trace", self.sft_trace, optional=True)


class EnvFactory:
    """``make_env()`` of a run: a new ``config.env`` with its ``options`` and, when
    ``tools`` is set, a ``ToolRegistry`` of those tools as its ``tools`` (the class and
    the tools are imported once, here)."""

    def __init__(self, config: EnvConfig):
        self.config = config
        self.cls = load_function(config.env, "env.env")
        self.tools = None if config.tools is None else [_tool(t) for t in config.tools]

    def __call__(self):
        env = self.cls(**dict(self.config.options))
        if self.tools is not None:
            env.tools = ToolRegistry(self.tools)
        return env


def _tool(path: str):
    obj = load_function(path, "env.tools")
    return obj() if isinstance(obj, type) else obj


def check_env_section(cfg) -> None:
    """``ExperimentConfig``'s checks of its ``env`` section: an ``EnvConfig`` or None, and
    not beside a reward kind other than the default, several seeds in one program or a
    teacher (ValueError naming the field)."""
    c, e = "ExperimentConfig", cfg.env
    if e is not None and not isinstance(e, EnvConfig):
        fail(c, "env", e, "a rljax.run.environment.EnvConfig or None")
    if e is not None and (cfg.reward.kind != "accuracy" or cfg.run.seeds > 1
                          or cfg.teacher is not None):
        fail(c, "env", e.env, "None with reward.kind other than the default, run.seeds > 1 "
             "or a teacher (an environment's episode returns are the rewards; several seeds "
             "in one program need a device reward: run each seed as its own run)")


def check_env(cfg) -> None:
    """Build one environment now (import errors and bad options name the setting), so a
    wrong name stops the run before its directory is made."""
    if cfg.env is None:
        return
    try:
        EnvFactory(cfg.env)()
    except TypeError as e:
        raise ValueError(f"env.env={cfg.env.env!r} with env.options={cfg.env.options!r}: "
                         f"{e}") from None
    if cfg.env.sft_trace is not None:
        load_function(cfg.env.sft_trace, "env.sft_trace")


def build_multiturn(cfg, tokenizer, pool=None) -> MultiTurnConfig | None:
    """The ``RLTrainer(multiturn=...)`` of ``cfg.env`` (None without one); ``pool``: the
    tool calls' ``RewardPool`` (default: for an environment with tools, the process's
    shared one of ``tool_workers``)."""
    e = cfg.env
    if e is None:
        return None
    factory = EnvFactory(e)
    if pool is None and hasattr(factory(), "tool_calls"):  # workers only for tools
        from rljax.run.user_reward import shared_reward_pool  # the process's one pool

        pool = shared_reward_pool(e.tool_workers)
    return MultiTurnConfig(factory, limits=e.limits, pool=pool,
                           return_mode=e.return_mode, gamma=e.gamma,
                           obs_multiple=e.obs_multiple,
                           chat=ChatRenderer(tokenizer) if e.chat else None,
                           max_model_tokens=e.max_model_tokens)


def encode_sft(cfg, tokenizer, prompts, targets) -> dict:
    """The warm-up batch of ``task.sft``'s ``(prompts, targets)``: target texts
    (``encode_pairs``, ``sampling.max_new_tokens`` wide) or, with ``env.sft_trace``,
    traces (``encode_traces``, ``env.limits.max_total_tokens`` wide)."""
    if cfg.env is not None and cfg.env.sft_trace is not None:
        return encode_traces(tokenizer, prompts, targets, cfg.task.max_prompt_tokens,
                             cfg.env.limits.max_total_tokens)
    return encode_pairs(tokenizer, prompts, targets, cfg.task.max_prompt_tokens,
                        cfg.sampling.max_new_tokens)


def trace_examples(cfg, records) -> tuple[list[str], list]:
    """``env.sft_trace``'s ``(prompts, traces)`` of ``records``, each through a fresh
    environment with its own tools (``env.tools`` sets the tools of the episodes, not of
    the demonstrations: a control run without tools warms up as the tool run does)."""
    trace = load_function(cfg.env.sft_trace, "env.sft_trace")
    factory = EnvFactory(dataclasses.replace(cfg.env, tools=None))
    pairs = [trace(r, factory()) for r in records]
    return [p for p, _ in pairs], [list(t) for _, t in pairs]


def episode_eval(cfg, model, tokenizer, task, n: int, k: int) -> dict:
    """``rljax eval`` of an environment run, by the one held-out evaluator
    (``rljax.train.sources.evaluate``) on its episode source: greedy episodes of the first
    ``n`` held-out prompts (``reward_mean``: their mean return, and the ``env/...``
    means), and ``k`` sampled episodes of each at ``sampling.temperature``
    (``sample_reward_mean``; ``best@k_reward_mean``: the mean over prompts of their best
    return)."""
    from flax import nnx

    from rljax.train.multiturn import MultiTurnRollouts
    from rljax.train.sources.episodes import Episodes
    from rljax.train.sources.evaluate import evaluate

    graphdef, params = nnx.split(model)
    mt = build_multiturn(cfg, tokenizer)
    rollouts = MultiTurnRollouts(
        graphdef, tokenizer, mt.make_env, sampling=cfg.sampling, limits=mt.limits,
        prompt_len=cfg.task.max_prompt_tokens, group_size=k, pool=mt.pool,
        return_mode=mt.return_mode, gamma=mt.gamma, obs_multiple=mt.obs_multiple,
        chat=mt.chat, max_model_tokens=mt.response_budget(cfg.sampling.max_new_tokens))
    res = evaluate(Episodes(rollouts), params, task.eval_prompts[:n], task.eval_metadata[:n],
                   batch_size=n, k=k, seed=cfg.run.seed)
    return {**res, "k": k, "seed": cfg.run.seed, "verifier": None,
            "temperature": cfg.sampling.temperature}
