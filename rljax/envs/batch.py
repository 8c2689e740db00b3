"""`EnvBatch`: drives the environments of one process's rows, a turn at a time.

The rollout (`rljax.train.multiturn`) calls it per turn:

    envs = EnvBatch(ArithmeticToolEnv, encode=tokenizer.encode, limits=..., pool=pool)
    first = envs.reset(own_rows_metadata)       # observations + their ids, per row
    while not all_done_on_every_process:
        texts = decode(the turn's new tokens of own rows)
        out = envs.step(texts, model_tokens=the turn's token counts)
        # out.observation_ids[i]: ids to append for row i (loss mask 0); out.done_B ...

With `chat=ChatRenderer(tokenizer)` the prompts and observations are rendered with the
tokenizer's chat template (`rljax.envs.chat`): `step` then takes the turn's sampled ids
(`model_ids=`) and `observation_ids` are the template's delta after them.

Each process drives only its own rows; nothing here touches JAX. `BatchStep.all_done` is
this process's flag: the rollout must agree on it across processes (e.g. reduce
`done_B` in its program) so every process ends the turn loop together.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rljax.envs.chat import ChatRenderer, ChatTrajectory, observation_messages
from rljax.envs.protocol import EnvLimits, StepResult, episode_return
from rljax.envs.tools import ToolRegistry, ToolResult, run_tool_calls
from rljax.rewards import RewardPool

__all__ = ["EnvBatch", "BatchStep", "EnvError", "TRUNCATIONS"]

TRUNCATIONS = ("max_turns", "model_tokens", "obs_tokens", "total_tokens")


class EnvError(RuntimeError):
    """An environment broke its contract (raised, or returned a bad value); names the row."""


def _call(i: int, row: _Row, method: str, *args: Any) -> Any:
    """`row.env.method(*args)`, its time added to `row.env_s`; an exception becomes an
    `EnvError` naming row `i`."""
    t0 = time.perf_counter()
    try:
        return getattr(row.env, method)(*args)
    except Exception as e:
        raise EnvError(f"row {i}: {type(row.env).__name__}.{method} raised "
                       f"{type(e).__name__}: {e}"[:2000]) from e
    finally:
        row.env_s += time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class BatchStep:
    """One turn's answers for the process's B rows.

    `observations`: text per row ("" for rows that are done); `observation_ids`: their
    token ids from `encode` (empty for done rows): what the rollout appends; `rewards_B`
    float32 (this turn's reward; 0 for rows already done); `done_B`, `truncated_B` bool.
    """

    observations: list[str]
    observation_ids: list[list[int]]
    rewards_B: np.ndarray
    done_B: np.ndarray
    truncated_B: np.ndarray

    @property
    def all_done(self) -> bool:
        """Whether every row of this process is done (agree on it across processes)."""
        return bool(self.done_B.all())


@dataclasses.dataclass
class _Row:
    """One row's episode state and its counters."""

    env: Any
    rewards: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    tokens: int = 0
    model_tokens: int = 0
    tool_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    done: bool = False
    truncated: str | None = None
    env_s: float = 0.0
    tool_s: float = 0.0
    chat: ChatTrajectory | None = None


class EnvBatch:
    """The environments of one process's rows, stepped together.

    Args:
      make_env: called with no arguments once per row at `reset` (a class, or a
        `functools.partial`); returns an `Environment`.
      encode: `text -> token ids` (a tokenizer's `encode` without special tokens): counts
        the token budgets and gives the observations' ids. May be None with `chat`
        (then `chat.encode`).
      limits: `EnvLimits`.
      pool: a `rljax.rewards.RewardPool` for tool calls; required when an environment
        has tools (`tool_calls`). Keep one open across steps.
      chat: a `rljax.envs.ChatRenderer`: render each row's prompt (its `reset` text as
        the user message, its tools' schemas) and observations (`observation_messages`:
        tool results as `tool` messages, else a `user` message) with the tokenizer's
        chat template; `step` then needs `model_ids`. None (default): the observation
        text as it is, `encode`d.
      max_model_tokens: the model's tokens over one episode (every turn's together, the
        observations not counted: the whole-response budget); a row whose turns reach it
        is ended, truncated (`"model_tokens"`). None: bounded by the turn budgets only.
    """

    def __init__(self, make_env: Callable[[], Any],
                 encode: Callable[[str], Sequence[int]] | None,
                 limits: EnvLimits = EnvLimits(), pool: RewardPool | None = None, *,
                 chat: ChatRenderer | None = None, max_model_tokens: int | None = None):
        if chat is not None and not isinstance(chat, ChatRenderer):
            raise TypeError(f"EnvBatch.chat must be a ChatRenderer or None, got "
                            f"{type(chat).__name__}")
        if encode is None and chat is not None:
            encode = chat.encode
        if not callable(make_env) or not callable(encode):
            raise TypeError("EnvBatch: make_env and encode must be callables (make_env() -> "
                            "an Environment, encode(text) -> token ids)")
        if not isinstance(limits, EnvLimits):
            raise TypeError(f"EnvBatch.limits must be an EnvLimits, got {type(limits).__name__}")
        m = max_model_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"EnvBatch.max_model_tokens must be an int >= 1 or None, got {m!r}")
        self.max_model_tokens = m
        self.make_env, self.encode, self.limits, self.pool = make_env, encode, limits, pool
        self.chat = chat
        self._rows: list[_Row] = []

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The rows' `stop_strings`, each once, in first-seen order: where the rollout
        should end a model turn (besides the stop tokens). Empty before `reset`."""
        seen: dict[str, None] = {}
        for r in self._rows:
            seen.update(dict.fromkeys(getattr(r.env, "stop_strings", ())))
        return tuple(seen)

    def _ids(self, text: str) -> list[int]:
        return [int(t) for t in self.encode(text)]

    def reset(self, metadata: Sequence[Mapping[str, Any]]) -> BatchStep:
        """Start one episode per row of `metadata` (this process's rows, in order); the
        first observations (the prompts) and their ids. A prompt over
        `max_total_tokens` ends its row at once, truncated."""
        self._rows = []
        obs, ids = [], []
        for i, meta in enumerate(metadata):
            row = _Row(self.make_env())
            if hasattr(row.env, "tool_calls"):
                if not isinstance(getattr(row.env, "tools", None), ToolRegistry):
                    raise EnvError(f"row {i}: {type(row.env).__name__} has tool_calls but its "
                                   "`tools` is not a ToolRegistry")
                if self.pool is None:
                    raise ValueError(f"EnvBatch: row {i}'s environment has tools but no pool "
                                     "was given; pass pool=rljax.rewards.RewardPool(...)")
            text = _call(i, row, "reset", meta)
            if not isinstance(text, str):
                raise EnvError(f"row {i}: {type(row.env).__name__}.reset returned a "
                               f"{type(text).__name__}, not a str")
            if self.chat is not None:
                row.chat = self.chat.start(text, getattr(row.env, "tools", None))
                text, row_ids = row.chat.text, list(row.chat.ids)
            else:
                row_ids = self._ids(text)
            row.tokens = len(row_ids)
            if row.tokens > self.limits.max_total_tokens:
                row.done, row.truncated, text, row_ids = True, "total_tokens", "", []
            self._rows.append(row)
            obs.append(text)
            ids.append(row_ids)
        return self._answer(obs, ids, [0.0] * len(self._rows))

    def _answer(self, obs: list[str], ids: list[list[int]], rewards: list[float]) -> BatchStep:
        return BatchStep(obs, ids, np.asarray(rewards, np.float32),
                         np.array([r.done for r in self._rows], bool),
                         np.array([r.truncated is not None for r in self._rows], bool))

    def _run_tools(self, texts: Sequence[str], active: list[int]) -> dict[int, list[ToolResult]]:
        """Parse every active row's calls; run them all in the pool at once."""
        calls, owner = [], []
        for i in active:
            row = self._rows[i]
            if not hasattr(row.env, "tool_calls"):
                continue
            parsed = _call(i, row, "tool_calls", texts[i])
            calls += [(row.env.tools, c) for c in parsed]
            owner += [i] * len(parsed)
        if not calls:
            return {}
        t0 = time.perf_counter()
        results = run_tool_calls(self.pool, calls, timeout_s=self.limits.tool_timeout_s,
                                 max_result_chars=self.limits.max_tool_result_chars,
                                 max_error_chars=self.limits.max_tool_error_chars)
        seconds = time.perf_counter() - t0
        per_row: dict[int, list[ToolResult]] = {}
        for i, r in zip(owner, results):
            per_row.setdefault(i, []).append(r)
        for i, rs in per_row.items():
            self._rows[i].tool_calls += len(rs)
            self._rows[i].tool_errors += sum(not r.ok for r in rs)
            self._rows[i].tool_timeouts += sum(r.kind == "timeout" for r in rs)
            self._rows[i].tool_s += seconds
        return per_row

    def step(self, model_texts: Sequence[str], model_tokens: Sequence[int] | None = None,
             model_ids: Sequence[Sequence[int]] | None = None) -> BatchStep:
        """One model turn for every row (texts of rows already done are ignored).

        `model_tokens[i]`: how many tokens the model drew for row i this turn (counted
        with `encode` when None). `model_ids[i]`: the ids it drew (required with `chat`,
        where they count the tokens and the delta follows them). Runs the rows' tool
        calls, steps each environment, and applies the limits in order: the
        environment's own `done`, then `max_turns`, `max_model_tokens`, `max_obs_tokens`,
        `max_total_tokens`.
        """
        B = len(self._rows)
        if len(model_texts) != B or (model_tokens is not None and len(model_tokens) != B) \
                or (model_ids is not None and len(model_ids) != B):
            raise ValueError(f"EnvBatch.step: {B} rows, got {len(model_texts)} texts"
                             + ("" if model_tokens is None else f", {len(model_tokens)} counts")
                             + ("" if model_ids is None else f", {len(model_ids)} id lists"))
        if self.chat is not None and model_ids is None:
            raise ValueError("EnvBatch.step: with chat, pass model_ids (the ids each row "
                             "drew this turn): the chat template's delta follows them")
        active = [i for i in range(B) if not self._rows[i].done]
        for i in active:
            if not isinstance(model_texts[i], str):
                raise ValueError(f"EnvBatch.step: row {i} is not done, so its model text must "
                                 f"be a str, got a {type(model_texts[i]).__name__}")
        tool_results = self._run_tools(model_texts, active)
        obs, ids, rewards = [""] * B, [[] for _ in range(B)], [0.0] * B
        for i in active:
            n = (len(model_ids[i]) if model_ids is not None else
                 len(self._ids(model_texts[i])) if model_tokens is None else int(model_tokens[i]))
            obs[i], ids[i], rewards[i] = self._step_row(
                i, model_texts[i], n, tool_results.get(i, []),
                None if model_ids is None else model_ids[i])
        return self._answer(obs, ids, rewards)

    def _observe(self, row: _Row, res: StepResult, results: list[ToolResult],
                 sampled: Sequence[int] | None) -> tuple[str, list[int], Any]:
        """The observation's text and ids, and the chat delta to commit (None: no chat)."""
        if row.chat is None:
            return res.observation, self._ids(res.observation), None
        delta = self.chat.next_turn(row.chat, sampled,  # type: ignore[union-attr]
                                    observation_messages(res.observation, results))
        return delta.text, list(delta.ids), delta

    def _step_row(self, i: int, text: str, n_model: int, results: list[ToolResult],
                  sampled: Sequence[int] | None = None) -> tuple[str, list[int], float]:
        row = self._rows[i]
        res = _call(i, row, "step", text, results)
        if not isinstance(res, StepResult) or not isinstance(res.observation, str) \
                or isinstance(res.reward, bool) or not isinstance(res.reward, (int, float)):
            raise EnvError(f"row {i}: {type(row.env).__name__}.step must return a StepResult "
                           f"with a str observation and a float reward, got {res!r}"[:500])
        reward = float(res.reward)
        if not math.isfinite(reward):
            raise EnvError(f"row {i}: {type(row.env).__name__}.step returned reward {reward}")
        row.turns += 1
        row.tokens += n_model
        row.model_tokens += n_model
        row.rewards.append(reward)
        if res.done:
            row.done = True
            return "", [], reward
        obs_text, obs_ids, delta = self._observe(row, res, results, sampled)
        spent = self.max_model_tokens is not None and row.model_tokens >= self.max_model_tokens
        cut = ("max_turns" if row.turns >= self.limits.max_turns else
               "model_tokens" if spent else
               "obs_tokens" if len(obs_ids) > self.limits.max_obs_tokens else
               "total_tokens" if row.tokens + len(obs_ids) >= self.limits.max_total_tokens
               else None)
        if cut:
            row.done, row.truncated = True, cut
            return "", [], reward
        row.tokens += len(obs_ids)
        row.tool_tokens += len(obs_ids)
        if delta is not None:
            row.chat.extend(delta)  # type: ignore[union-attr]
        return obs_text, obs_ids, reward

    def trajectory(self, i: int) -> ChatTrajectory | None:
        """Row i's chat trajectory (its ids, loss mask and messages so far; the last
        turn of a row that ended is not in it), or None without `chat`."""
        return self._rows[i].chat

    def remaining_tokens_B(self) -> np.ndarray:
        """int32[B]: tokens a live row's next model turn may take before it reaches
        `max_total_tokens` or `max_model_tokens` (0 for rows that are done). The rollout
        bounds the turn's decoding by it; a turn that reaches it ends its row, truncated."""
        cap = self.max_model_tokens
        left = [self.limits.max_total_tokens - r.tokens if cap is None else
                min(self.limits.max_total_tokens - r.tokens, cap - r.model_tokens)
                for r in self._rows]
        return np.array([0 if r.done else n for r, n in zip(self._rows, left)], np.int32)

    def returns_B(self, mode: str = "sum", gamma: float = 1.0) -> np.ndarray:
        """float32[B]: each row's episode return (`rljax.envs.episode_return`)."""
        return np.array([episode_return(r.rewards, mode, gamma) for r in self._rows], np.float32)

    def info(self, i: int) -> dict[str, Any]:
        """Row i's episode so far: `turns`, `tool_calls` (calls parsed, unreadable ones
        included), `tool_errors` (calls that did not return a result), `tool_timeouts`
        (those of them cut at `tool_timeout_s`), `truncated` (None
        or one of `TRUNCATIONS`), `done`, `tokens` (counted toward the total),
        `model_tokens` (the model's turns), `tool_tokens` (the observations after the
        prompt), `rewards` (per turn), `env_s` (seconds in its environment's methods), `tool_s`
        (wall seconds of the tool batches its calls ran in)."""
        r = self._rows[i]
        return {"turns": r.turns, "tool_calls": r.tool_calls, "tool_errors": r.tool_errors,
                "tool_timeouts": r.tool_timeouts,
                "truncated": r.truncated, "done": r.done, "tokens": r.tokens,
                "model_tokens": r.model_tokens, "tool_tokens": r.tool_tokens,
                "rewards": list(r.rewards), "env_s": r.env_s, "tool_s": r.tool_s}

    def metrics(self) -> dict[str, tuple[float, int]]:
        """Episode metrics as `(sum, count)` over this process's rows, so processes add
        sums and counts and divide once: `env/turns`, `env/tool_calls`,
        `env/tool_errors`, `env/tool_timeouts`, `env/truncated`, `env/env_s`, `env/tool_s`,
        `env/return`."""
        n = len(self._rows)
        sums = {f"env/{k}": sum(getattr(r, k) for r in self._rows)
                for k in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "env_s",
                          "tool_s")}
        sums["env/truncated"] = sum(r.truncated is not None for r in self._rows)
        sums["env/return"] = float(self.returns_B().sum()) if n else 0.0
        return {k: (float(v), n) for k, v in sums.items()}
