"""The top-level experiment config (`ExperimentConfig` and its task, reward and run
sections) and `load_run_config`; experiment files are loaded by
`rljax.run.experiment_files.load_experiment`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from rljax.models import ModelConfig
from rljax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
from rljax.models.lora import LoraConfig
from rljax.rewards.extract import MODES as EXTRACT_MODES
from rljax.rewards.strings import VERIFIERS
from rljax.run.environment import EnvConfig, check_env_section
from rljax.run.profiling import parse_profile_steps
from rljax.sharding import MeshConfig
from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                check_algorithm_sampling)
from rljax.train.config.checks import check_bool, check_choice, check_num, fail
from rljax.train.config.dicts import config_from_dict

__all__ = ["ExperimentConfig", "RewardConfig", "RunConfig", "TaskConfig", "config_from_dict",
           "load_run_config"]


def _check_str(cls, field, value, *, optional=False):
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
            _check_str(c, f, getattr(self, f))
        _check_str(c, "answer_field", self.answer_field, optional=True)
        check_num(c, "max_number", self.max_number, lo=2, integer=True)
        if not self.ops or not all(o in ("+", "-", "*", "/") for o in self.ops):
            fail(c, "ops", self.ops, "a non-empty tuple of '+', '-', '*', '/'")
        if self.style not in ("plain", "reversed", "word"):
            fail(c, "style", self.style, "'plain', 'reversed' or 'word'")
        if not isinstance(self.assistant_prefix, str):
            fail(c, "assistant_prefix", self.assistant_prefix, "a string")
        for f in ("path", "dataset", "system_prompt"):
            _check_str(c, f, getattr(self, f), optional=True)
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
            _check_str(c, f, getattr(self, f))
        if self.think_tag == self.answer_tag:
            fail(c, "answer_tag", self.answer_tag, "a name different from think_tag")
        check_bool(c, "think_in_prompt", self.think_in_prompt)
        check_num(c, "timeout_s", self.timeout_s, lo=0, lo_open=True, finite=False)
        if self.kind == "reward_model" and not self.model_path:
            fail(c, "model_path", self.model_path, "a directory when kind='reward_model'")
        if self.kind == "custom" and (not self.function or self.function.count(":") != 1):
            fail(c, "function", self.function, "an import path 'pkg.mod:fn' when kind='custom'")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how a run is recorded.

    Attributes:
      dir: the run directory (config, metrics, TensorBoard, checkpoints, plots).
      seed: the run's seed in [0, 2**32) (model init, data order, sampling; JAX keys keep
        32 bits of it, so a larger one would repeat a smaller run).
      save_every: checkpoint every N steps (0 = only at the end).
      keep: checkpoints kept.
      resume: True: continue the run in `dir` from its latest checkpoint (an error when
        `dir` holds no run, e.g. a misspelt path); "auto": continue it if there is one,
        else start one there (a preemptible job's setting); False: start a run (a `dir`
        holding another run is refused).
      overwrite: delete the run in `dir` and start afresh (no experiment sets it: a run is
        only replaced when asked for).
      log_every: print a progress line every N steps.
      tensorboard: write tensorboardX event files.
      wandb_project: also log to Weights & Biases (needs `wandb` installed).
      plots: write PNG plots at the end (and at each evaluation).
      profile_steps: RL steps to trace with the JAX profiler into `<dir>/profile/`, as
        "3,5" or "3-5" (numbered as in metrics.jsonl, from 1; "" = none); see
        `rljax.run.profiling`. Not part of the config hash: a resumed run may change it.
      seeds: independent runs trained at once in one compiled program (seeds `seed`,
        `seed + 1`, ...; `rljax.run.seed_runs`); > 1 needs a device reward (the
        arithmetic task's accuracy reward, or a custom `reward.function` that is a
        `rljax.rewards.device.DeviceReward`) and one device; such a run resumes as one
        run does.
    """

    dir: str = "runs/default"
    seed: int = 0
    save_every: int = 0
    keep: int = 3
    resume: bool | str = False
    overwrite: bool = False
    log_every: int = 1
    tensorboard: bool = True
    wandb_project: str | None = None
    plots: bool = True
    profile_steps: str = ""
    seeds: int = 1

    def __post_init__(self):
        c = "RunConfig"
        _check_str(c, "dir", self.dir)
        check_num(c, "seed", self.seed, lo=0, integer=True)
        if self.seed >= 2**32:  # jax.random.key keeps 32 bits: 2**32 would repeat seed 0
            fail(c, "seed", self.seed, "an int in [0, 2**32 - 1]")
        check_num(c, "save_every", self.save_every, lo=0, integer=True)
        check_num(c, "keep", self.keep, lo=1, integer=True)
        check_num(c, "log_every", self.log_every, lo=1, integer=True)
        check_num(c, "seeds", self.seeds, lo=1, integer=True)
        for f in ("overwrite", "tensorboard", "plots"):
            check_bool(c, f, getattr(self, f))
        if not (isinstance(self.resume, bool) or self.resume == "auto"):
            fail(c, "resume", self.resume, "True, False or 'auto'")
        if self.resume and self.overwrite:
            fail(c, "overwrite", self.overwrite, "False when resume=True (choose one)")
        _check_str(c, "wandb_project", self.wandb_project, optional=True)
        try:
            parse_profile_steps(self.profile_steps)
        except ValueError as e:
            fail(c, "profile_steps", self.profile_steps, str(e).split("allowed: ", 1)[-1])


def _check_answers(t: TaskConfig, r: RewardConfig) -> None:
    """The verifier settings fit the task: procedural tasks check their own answers, and
    a reward that checks answers needs the field they are in."""
    if t.name in ("arithmetic", "countdown") and r.verifier != "auto":
        fail("RewardConfig", "verifier", r.verifier, f"'auto' for task {t.name!r} (it has its "
             "own check; 'math' and 'string' are for file tasks)")
    if t.answer_field is None and r.kind in ("accuracy", "accuracy+format") \
            and t.name not in ("arithmetic", "countdown"):
        fail("TaskConfig", "answer_field", None, f"a record field when reward.kind="
             f"{r.kind!r} (it checks the reference answer); None only with a reward that "
             "needs none (reward.function, 'format', 'reward_model')")


_SECTIONS = dict(task=TaskConfig, reward=RewardConfig, algorithm=AlgorithmConfig,
                 optim=OptimConfig, sampling=SamplingConfig, rl=RLConfig, mesh=MeshConfig,
                 run=RunConfig, lora=LoraConfig)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs: model, tokenizer, data, reward, algorithm, schedule, mesh.

    Attributes:
      name: the experiment's name (used in the run summary).
      model: a `ModelConfig` for a randomly initialised model, or None with `hf_path`.
      hf_path: a local Hugging Face checkpoint folder to start from (exclusive with `model`).
      compute_dtype: matmul dtype of a model loaded from `hf_path` ("float32" | "bfloat16";
        parameters stay float32). A random-init model uses `model.compute_dtype`.
      attention: `ModelConfig.attention` of a model loaded from `hf_path` ("xla", "splash"
        on TPU, "cudnn" on GPU); a random-init model uses `model.attention`.
      scan_layers, remat: `ModelConfig.scan_layers` / `ModelConfig.remat` of a model loaded
        from `hf_path` (stacked `[L, ...]` layers under one scan; what each layer keeps for
        the backward pass: "none", "full", "dots_saveable"); a random-init model uses
        `model`'s. A run's checkpoints have the layout of its `scan_layers`.
      lora: LoRA adapters on the policy's projections (`rljax.models.lora.LoraConfig`;
        rank 0, the default, is off), for a random-init model and an `hf_path` alike
        (`model.lora` stays None): only the adapters train, and the KL reference is the
        policy at the start of RL (the base with a frozen copy of the adapters as the
        warm-up left them). E.g. ``--set lora.rank=32 --set lora.alpha=64``.
      tokenizer: a tokenizer folder, or "char" for `rljax.models`' character tokenizer
        (None: the one in `hf_path`).
      teacher: on-policy distillation's teacher (`algorithm.name="distill"` needs it, the
        others refuse it): a run directory (its latest checkpoint's policy) or a Hugging
        Face folder, sharing the student's tokenizer (`rljax.run.teacher.load_teacher`).
      task, reward, algorithm, optim, sampling, rl: see their classes.
      sft: an optional supervised warm-up before RL (None = none).
      env: a multi-turn environment (`rljax.run.environment.EnvConfig`; None: single-turn
        completions scored by `reward`): the task's records start its episodes and their
        returns are the rewards.
      mesh: device mesh sizes (`rljax.sharding.MeshConfig`).
      run: run directory, seed, checkpoints.
      smoke: a quick run (two steps on CPU with a tiny model, no end-of-run plots) for
        testing a recipe.
      recipe: a named recipe of the experiment file (its `RECIPES`; `rljax.run.recipes`),
        applied by `load_experiment` through the file's `recipe(cfg)`.
    """

    name: str = "experiment"
    model: ModelConfig | None = None
    hf_path: str | None = None
    compute_dtype: str = "float32"
    attention: str = "xla"
    scan_layers: bool = False
    remat: str = "none"
    lora: LoraConfig = LoraConfig()
    tokenizer: str | None = "char"
    teacher: str | None = None
    task: TaskConfig = TaskConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    sampling: SamplingConfig = SamplingConfig()
    sft: SFTConfig | None = None
    env: EnvConfig | None = None
    rl: RLConfig = RLConfig()
    mesh: MeshConfig = MeshConfig()
    run: RunConfig = RunConfig()
    smoke: bool = False
    recipe: str | None = None

    def __post_init__(self):
        c = "ExperimentConfig"
        _check_str(c, "name", self.name)
        if (self.model is None) == (self.hf_path is None):
            fail(c, "model", self.model,
                  "exactly one of model (a ModelConfig, random init) and hf_path (a folder)")
        if self.model is not None and not isinstance(self.model, ModelConfig):
            fail(c, "model", self.model, "a rljax.models.ModelConfig or None")
        if self.model is not None and self.model.lora is not None:
            fail(c, "model.lora", self.model.lora, "None (set adapters in the lora section: "
                 "lora.rank, lora.alpha, lora.targets)")
        _check_str(c, "hf_path", self.hf_path, optional=True)
        if self.compute_dtype not in ("float32", "bfloat16"):
            fail(c, "compute_dtype", self.compute_dtype, "'float32' or 'bfloat16'")
        _check_str(c, "tokenizer", self.tokenizer, optional=True)
        if self.tokenizer is None and self.hf_path is None:
            fail(c, "tokenizer", None, "a folder or 'char' when there is no hf_path")
        for field, cls in _SECTIONS.items():
            if not isinstance(getattr(self, field), cls):
                fail(c, field, getattr(self, field), f"a {cls.__name__}")
        if self.sft is not None and not isinstance(self.sft, SFTConfig):
            fail(c, "sft", self.sft, "a SFTConfig or None")
        if self.sft is not None and self.sft.full_parameters and not self.lora.enabled:
            fail(c, "sft.full_parameters", True, "False without LoRA adapters (lora.rank=0: "
                 "a warm-up trains every weight anyway; the flag picks the base over the "
                 "adapters when lora.rank > 0)")
        check_env_section(self)
        check_algorithm_sampling(self.algorithm, self.sampling, None if self.env is None else
                                 self.env.response_budget(self.sampling.max_new_tokens))
        _check_str(c, "teacher", self.teacher, optional=True)
        if self.algorithm.needs_teacher != (self.teacher is not None):
            fail(c, "teacher", self.teacher, "a run directory or Hugging Face folder when "
                  "algorithm.name='distill' (advantage_estimator='teacher'), else None "
                  f"(algorithm.name={self.algorithm.name!r}, advantage_estimator="
                  f"{self.algorithm.resolved('advantage_estimator')!r})")
        check_bool(c, "smoke", self.smoke)
        check_choice(c, "attention", self.attention, ATTENTION_IMPLS)
        check_bool(c, "scan_layers", self.scan_layers)
        check_choice(c, "remat", self.remat, REMAT_POLICIES)
        _check_str(c, "recipe", self.recipe, optional=True)
        _check_answers(self.task, self.reward)

    @property
    def warms_up_base(self) -> bool:
        """Whether the SFT warm-up trains a LoRA policy's base (`sft.full_parameters`): the
        RL phase then starts from a base that is not the rebuildable initial one."""
        return self.sft is not None and self.sft.steps > 0 and self.sft.full_parameters

    def policy_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` (the run's model, random-init or read from `hf_path`) with this
        run's adapters (`lora`; rank 0 leaves it without any)."""
        return dataclasses.replace(config, lora=self.lora)

    def resolved(self) -> ExperimentConfig:
        """This config with the algorithm's preset filled in (``AlgorithmConfig.resolve``):
        what a run uses, saves in its config.json and ``--dry-run`` prints. Switch
        ``algorithm.name`` on the unresolved config (resolving pins the preset values)."""
        return dataclasses.replace(self, algorithm=self.algorithm.resolve())


def load_run_config(run_dir: str | pathlib.Path) -> ExperimentConfig:
    """The `ExperimentConfig` a run directory was made with (from its config.json)."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json)")
    blob = json.loads(path.read_text())
    return config_from_dict(ExperimentConfig, blob.get("config", blob))
