"""The task and reward sections of an experiment config (`TaskConfig`, `RewardConfig`);
`rljax.run.experiment.ExperimentConfig` holds them beside the trainer's sections."""

from __future__ import annotations

import dataclasses

from rljax.rewards.extract import MODES as EXTRACT_MODES
from rljax.rewards.strings import VERIFIERS
from rljax.train.config.checks import check_bool, check_choice, check_num, fail

__all__ = ["FUNCTION_FORMS", "REWARD_KINDS", "RewardConfig", "TASKS", "TaskConfig",
           "VERIFIER_CHOICES", "check_str"]


def check_str(cls, field, value, *, optional=False):
    """A non-empty string (or None where ``optional``), else ``fail`` naming the field."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        fail(cls, field, value, "a non-empty string" + (" or None" if optional else ""))


TASKS = ("arithmetic", "countdown", "gsm8k", "jsonl", "parquet", "tfds")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Where prompts come from and how they are turned into model input.

    Attributes:
      name: the prompt source (see `TASKS`): procedural "arithmetic" or "countdown";
        "gsm8k" (GSM8K's JSONL release: `path` is the folder with `train.jsonl` and
        `test.jsonl`, answers after `####`); "jsonl" / "parquet" files (`path` a folder
        holding `{split}.jsonl` or a file); "tfds" (a prepared array_record dataset:
        `dataset` in `path` as TFDS data_dir, read without TensorFlow).
      path: local file, folder or TFDS data directory (None for procedural tasks).
      dataset: TFDS dataset name (e.g. "gsm8k") when name="tfds".
      split, eval_split: training and held-out splits: with a folder `path`, the files
        `<split>.jsonl` / `.parquet` in it; either may also be a file path. With a
        single-file `path` there is no held-out split to find: `eval_split` must be a
        file of held-out prompts, or equal `split` to evaluate on the training prompts.
      prompt_field, answer_field: the record fields read as the prompt and the reference
        answer (file/TFDS records; every other field is kept too, for the reward's
        metadata and `prompt_template`). The answer is optional unless the reward checks
        it (`reward.kind` "accuracy" or "accuracy+format"); `answer_field=None`: the
        records have none (no verifier: a custom reward's mean is the headline).
      difficulty: procedural difficulty: arithmetic operand digits; Countdown numbers given.
      max_number: Countdown's largest given number.
      ops: arithmetic operators drawn ("+", "-", "*", "/").
      style: arithmetic prompt style: "plain" ("12+34=" -> "46"), "reversed" (answer
        digits least-significant first: "12+34=" -> "64") or "word" (word problem, "####").
      chat_template: wrap prompts with the tokenizer's chat template.
      system_prompt: optional system message (chat template) or prefix.
      assistant_prefix: text appended after the prompt (e.g. "<think>" for R1-Zero).
      prompt_template: the user text built from a record with `str.format` (default the
        record's own "{prompt}"; e.g. a compact "{numbers}->{target}" for char models).
      sft_template: SFT target built from a record with `str.format` (e.g. "{solution}").
      max_prompt_tokens: prompt width; file prompts over it are dropped, counted, reported.
    """

    name: str = "arithmetic"
    path: str | None = None
    dataset: str | None = None
    split: str = "train"
    eval_split: str = "test"
    prompt_field: str = "question"
    answer_field: str | None = "answer"
    difficulty: int = 3
    max_number: int = 99
    ops: tuple[str, ...] = ("+",)
    style: str = "plain"
    chat_template: bool = False
    system_prompt: str | None = None
    assistant_prefix: str = ""
    prompt_template: str = "{prompt}"
    sft_template: str = "{solution}"
    max_prompt_tokens: int = 256

    def __post_init__(self):
        c = "TaskConfig"
        check_choice(c, "name", self.name, TASKS)
        if self.name in ("gsm8k", "jsonl", "parquet", "tfds") and not self.path:
            fail(c, "path", self.path, f"a local folder or file when name={self.name!r}")
        if self.name == "tfds" and not self.dataset:
            fail(c, "dataset", self.dataset, "a TFDS dataset name when name='tfds'")
        for f in ("split", "eval_split", "prompt_field", "prompt_template", "sft_template"):
            check_str(c, f, getattr(self, f))
        check_str(c, "answer_field", self.answer_field, optional=True)
        check_num(c, "max_number", self.max_number, lo=2, integer=True)
        if not self.ops or not all(o in ("+", "-", "*", "/") for o in self.ops):
            fail(c, "ops", self.ops, "a non-empty tuple of '+', '-', '*', '/'")
        if self.style not in ("plain", "reversed", "word"):
            fail(c, "style", self.style, "'plain', 'reversed' or 'word'")
        if not isinstance(self.assistant_prefix, str):
            fail(c, "assistant_prefix", self.assistant_prefix, "a string")
        for f in ("path", "dataset", "system_prompt"):
            check_str(c, f, getattr(self, f), optional=True)
        if self.answer_field is None and self.name == "gsm8k":
            fail(c, "answer_field", None, "a record field for task 'gsm8k' (its answers "
                 "follow '####' in that field)")
        check_num(c, "difficulty", self.difficulty, lo=0, integer=True)
        check_bool(c, "chat_template", self.chat_template)
        check_num(c, "max_prompt_tokens", self.max_prompt_tokens, lo=1, integer=True)


REWARD_KINDS = ("accuracy", "format", "accuracy+format", "reward_model", "custom")
VERIFIER_CHOICES = ("auto", *VERIFIERS)
FUNCTION_FORMS = ("batch", "item")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward: verifiers from `rljax.rewards`, a learned reward model, or a function.

    Attributes:
      kind: "accuracy" (the task's verifier: math-answer equivalence against the reference,
        or a procedural task's own checker such as Countdown's), "format" (R1-Zero tags),
        "accuracy+format"
        (weighted sum), "reward_model" (`rljax.train.reward_model`, from `model_path`) or
        "custom" (`function`, an import path "pkg.mod:fn"; setting `function` implies
        "custom", and refuses the other kinds).
      accuracy_weight, format_weight: weights of the two terms.
      correct_reward: reward of a verified answer (Tülu 3's RLVR uses 10; default 1).
      answer_mode: `rljax.rewards.extract_answer` mode ("auto" = last boxed, else GSM8K's
        "####", else "the answer is"; or "boxed", "gsm8k", "answer_is", "last_number").
      verifier: how a file task's answers are checked: "math" (`rljax.rewards.math_equal`:
        equal values), "string" (`rljax.rewards.string_equal`: equal text up to case,
        whitespace and punctuation around words; in answer_mode "auto" an unmarked
        completion is the answer as a whole) or "auto": "math" when any reference answer
        reads as a number, else "string". Procedural tasks have their own check ("auto").
      think_tag, answer_tag: R1-Zero format tag names (`<think>...</think>` etc.).
      think_in_prompt: the prompt already opens the think tag (TinyZero's template).
      model_path: saved reward model directory (kind="reward_model").
      function: import path "module:name" of a custom reward, found as `python -m` finds
        modules (the current directory first: ./my_reward.py is "my_reward:score").
      function_form: "batch": `function(completions, metadata) -> rewards` is called once
        per batch of this process's completions; "item": `function(completion, meta) ->
        float` once per completion. `metadata` are the prompts' records: every field of
        a file's record, and `source` ("file:line").
      timeout_s: per-call time limit (one item, or one batch for a batch reward; the
        calls run in `workers` worker processes; a call past the limit scores 0, is logged
        with its prompts' file lines, and the run goes on).
      workers: reward worker processes (0 = score in the training process, where a call
        cannot be cut, so `timeout_s` does not apply).
      batch_chunk: completions per call of a batch reward in the workers (0: the whole
        batch in one call): each chunk is cut at `timeout_s` on its own, so one hang
        scores 0 for its chunk only (a multiple of `algorithm.group_size` keeps each group
        in one call). Needs `function_form="batch"` and `workers > 0`.
    """

    kind: str = "accuracy"
    accuracy_weight: float = 1.0
    format_weight: float = 0.0
    correct_reward: float = 1.0
    answer_mode: str = "auto"
    verifier: str = "auto"
    think_tag: str = "think"
    answer_tag: str = "answer"
    think_in_prompt: bool = False
    model_path: str | None = None
    function: str | None = None
    function_form: str = "batch"
    timeout_s: float = 5.0
    workers: int = 2
    batch_chunk: int = 0

    def __post_init__(self):
        c = "RewardConfig"
        if self.function is not None and self.kind == "accuracy":  # the default kind
            object.__setattr__(self, "kind", "custom")  # reward.function implies custom
        if self.function is not None and self.kind != "custom":
            fail(c, "kind", self.kind, f"'custom' when function is set (function="
                  f"{self.function!r} implies kind='custom'; unset one of them)")
        check_choice(c, "function_form", self.function_form, FUNCTION_FORMS)
        check_num(c, "workers", self.workers, lo=0, integer=True)
        check_choice(c, "kind", self.kind, REWARD_KINDS)
        for f in ("accuracy_weight", "format_weight", "correct_reward"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                fail(c, f, v, "a number")
        check_choice(c, "answer_mode", self.answer_mode, EXTRACT_MODES)
        check_choice(c, "verifier", self.verifier, VERIFIER_CHOICES)
        for f in ("think_tag", "answer_tag"):
            check_str(c, f, getattr(self, f))
        if self.think_tag == self.answer_tag:
            fail(c, "answer_tag", self.answer_tag, "a name different from think_tag")
        check_bool(c, "think_in_prompt", self.think_in_prompt)
        check_num(c, "timeout_s", self.timeout_s, lo=0, lo_open=True, finite=False)
        check_num(c, "batch_chunk", self.batch_chunk, lo=0, integer=True)
        if self.batch_chunk and (self.kind != "custom" or self.function_form != "batch"
                                 or self.workers == 0):
            fail(c, "batch_chunk", self.batch_chunk, "0 unless the reward is a custom batch "
                 "reward (function_form='batch') scored in workers (workers > 0); an item "
                 "reward has a limit per completion already")
        if self.kind == "reward_model" and not self.model_path:
            fail(c, "model_path", self.model_path, "a directory when kind='reward_model'")
        if self.kind == "custom" and (not self.function or self.function.count(":") != 1):
            fail(c, "function", self.function, "an import path 'pkg.mod:fn' when kind='custom'")
