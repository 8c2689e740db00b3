"""The top-level experiment config (`ExperimentConfig` and its run section; the task and
reward sections are in `rljax.run.sections`) and `load_run_config`; experiment files are
loaded by `rljax.run.experiment_files.load_experiment`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from rljax.models import ModelConfig
from rljax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
from rljax.models.lora import LoraConfig
from rljax.run.environment import EnvConfig, check_env_section
from rljax.run.profiling import parse_profile_steps
from rljax.run.sections import RewardConfig, TaskConfig, check_str
from rljax.sharding import MeshConfig
from rljax.train.config import (AlgorithmConfig, OptimConfig, RLConfig, SamplingConfig, SFTConfig,
                                check_algorithm_sampling)
from rljax.train.config.checks import check_bool, check_choice, check_num, fail
from rljax.train.config.dicts import config_from_dict

__all__ = ["ExperimentConfig", "RewardConfig", "RunConfig", "TaskConfig", "config_from_dict",
           "load_run_config"]


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
      seeds: independent runs trained at once, each step's programs vmapped over them
        (seeds `seed`, `seed + 1`, ...; `rljax.run.seed_runs`): with a device reward (the
        arithmetic task's accuracy reward, or a custom `reward.function` that is a
        `rljax.rewards.device.DeviceReward`) the whole step is one program, with a host
        reward each seed's batch is scored on the host; one device; such a run resumes
        as one run does.
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
        check_str(c, "dir", self.dir)
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
        check_str(c, "wandb_project", self.wandb_project, optional=True)
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
        check_str(c, "name", self.name)
        if (self.model is None) == (self.hf_path is None):
            fail(c, "model", self.model,
                  "exactly one of model (a ModelConfig, random init) and hf_path (a folder)")
        if self.model is not None and not isinstance(self.model, ModelConfig):
            fail(c, "model", self.model, "a rljax.models.ModelConfig or None")
        if self.model is not None and self.model.lora is not None:
            fail(c, "model.lora", self.model.lora, "None (set adapters in the lora section: "
                 "lora.rank, lora.alpha, lora.targets)")
        check_str(c, "hf_path", self.hf_path, optional=True)
        if self.compute_dtype not in ("float32", "bfloat16"):
            fail(c, "compute_dtype", self.compute_dtype, "'float32' or 'bfloat16'")
        check_str(c, "tokenizer", self.tokenizer, optional=True)
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
        check_str(c, "teacher", self.teacher, optional=True)
        if self.algorithm.needs_teacher != (self.teacher is not None):
            fail(c, "teacher", self.teacher, "a run directory or Hugging Face folder when "
                  "algorithm.name='distill' (advantage_estimator='teacher'), else None "
                  f"(algorithm.name={self.algorithm.name!r}, advantage_estimator="
                  f"{self.algorithm.resolved('advantage_estimator')!r})")
        check_bool(c, "smoke", self.smoke)
        check_choice(c, "attention", self.attention, ATTENTION_IMPLS)
        check_bool(c, "scan_layers", self.scan_layers)
        check_choice(c, "remat", self.remat, REMAT_POLICIES)
        check_str(c, "recipe", self.recipe, optional=True)
        if self.run.seeds > 1 and self.rl.max_staleness:
            fail(c, "rl.max_staleness", self.rl.max_staleness,
                 f"0 with run.seeds={self.run.seeds}: several seeds learn in one vmapped "
                 "program, with no per-seed in-flight batch (or run.seeds=1 for an "
                 "asynchronous run)")
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
