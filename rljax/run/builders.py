"""From an `ExperimentConfig` to the objects a run needs: tokenizer, mesh, model, prompt
sources, SFT pairs and reward functions.

Prompt sources are addressed by position, `source(start, n) -> (prompts, metadata)`, so a
resumed run (which saved `TrainState.data_pos`) reads exactly the prompts the original
run would have read next. Procedural tasks draw problem `i` from a generator seeded with
`(seed, i)`; file tasks visit records in one shuffled order per epoch.
Procedural tasks keep three streams apart: the SFT warm-up reads stream 0, RL reads
stream 1 (so RL sees fresh prompts, never the warm-up's worked examples) and the held-out
prompts come from their own stream; a training draw that repeats a held-out prompt is
redrawn (deterministically), so held-out prompts are never trained on. File tasks take
held-out prompts from the evaluation split; their SFT warm-up and RL visit the training
split in two independent shuffled orders, so RL does not start on the warm-up's records.
Validation prompts (only when `sft.stop_accuracy` is set) come from a fourth stream
without the held-out prompts, or for file tasks from the evaluation split just after
the held-out slice: the warm-up's stop never looks at the prompts that measure it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from rljax import rewards as rw
from rljax.data import ArithmeticTask, CountdownTask, ShuffledIterator, build_chat_prompt
from rljax.models import Decoder, ModelConfig
from rljax.models.hf_io import from_pretrained
from rljax.models.tokenizer import (add_stop_ids, build_char_tokenizer, check_vocab,
                                    generation_eos_ids, load_tokenizer)
from rljax.rewards.device import is_device_reward
from rljax.rewards.imported import load_function
from rljax.run.environment import check_env, trace_examples
from rljax.run.experiment import ExperimentConfig
from rljax.run.task_files import check_data_files, filtered_split, require_answers
from rljax.run.device_tasks import ArithmeticDeviceReward
from rljax.run.tasks import ArithmeticReward, CountdownReward
from rljax.run.user_reward import Verifier, check_reward, custom_reward, shared_reward_pool
from rljax.sharding import make_mesh, mesh_context
from rljax.train.reward_model import RewardModelScorer

__all__ = ["ComponentReward", "TaskData", "build_mesh", "build_model", "build_reward",
           "build_task", "build_tokenizer", "check_inputs", "model_prompt",
           "shared_reward_pool"]

_SFT_STREAM, _RL_STREAM = 0, 1  # SFT and RL draw different problems
_EVAL_STREAM = 1_000_003  # seeds the held-out stream apart from the training streams
_VAL_STREAM = 1_000_033  # the warm-up's validation prompts (sft.stop_accuracy)
_SFT_FILE_ORDER = 0x534654  # "SFT": seeds the warm-up's visiting order of a file task


def build_tokenizer(cfg: ExperimentConfig):
    """"char" -> `build_char_tokenizer()`; a folder -> `load_tokenizer`; None -> `hf_path`'s.
    The checkpoint's generation_config.json stop ids count whichever folder the tokenizer
    comes from."""
    if cfg.tokenizer == "char":
        return build_char_tokenizer()
    tok = load_tokenizer(cfg.tokenizer if cfg.tokenizer is not None else cfg.hf_path)
    if cfg.tokenizer is not None and cfg.hf_path is not None:
        add_stop_ids(tok, generation_eos_ids(cfg.hf_path))
    return tok


def build_mesh(cfg: ExperimentConfig):
    """The device mesh of `cfg.mesh`, or None when it is a single device. Sizes that do
    not multiply to the device count are a ValueError naming them (never ignored)."""
    try:
        cfg.mesh.resolve(jax.device_count())
    except ValueError as e:
        raise ValueError(f"mesh: {e} (mesh.data={cfg.mesh.data}, mesh.fsdp={cfg.mesh.fsdp}, "
                         f"mesh.tensor={cfg.mesh.tensor}; {jax.device_count()} "
                         f"{jax.default_backend()} device(s))") from None
    if jax.device_count() == 1:
        return None
    return make_mesh(cfg.mesh)


@functools.partial(nnx.jit, static_argnums=0)
def _random_decoder(model_cfg: ModelConfig, key: jax.Array) -> Decoder:
    """The random init of a `Decoder(model_cfg)` from a PRNG key: the key is an argument,
    so every seed (and every run of a process) shares one compiled program."""
    return Decoder(model_cfg, rngs=nnx.Rngs(key))


def build_model(cfg: ExperimentConfig, tokenizer, mesh=None, seed: int | None = None):
    """The policy `Decoder`: random init from `cfg.model` (seed `run.seed`) or `hf_path`,
    with `cfg.lora`'s adapters (drawn from the same seed) when its rank is > 0."""
    seed = cfg.run.seed if seed is None else seed
    if cfg.hf_path is not None:
        model = from_pretrained(cfg.hf_path, dtype=cfg.compute_dtype, mesh=mesh,
                                attention=cfg.attention, scan_layers=cfg.scan_layers,
                                remat=cfg.remat, lora=cfg.lora, lora_seed=seed)
    else:
        with mesh_context(mesh):  # one compiled program builds every weight, already sharded
            model = _random_decoder(cfg.policy_config(cfg.model), jax.random.key(seed))
    check_vocab(tokenizer, model.config)
    return model


@dataclasses.dataclass
class TaskData:
    """Prompt sources of a task.

    train: `(start, n) -> (prompt texts, metadata dicts)` for RL.
    eval_prompts, eval_metadata: the held-out prompts.
    sft: `(start, n) -> (prompt texts, target texts)` for the SFT warm-up (with
      `env.sft_trace`: the traces' prompts and segments, `rljax.run.environment`).
    val_prompts, val_metadata: the warm-up's validation prompts (empty unless
      `sft.stop_accuracy` is set), disjoint from the held-out ones.
    train_size: the training split's prompts (None: a procedural task, unlimited).
    splits: file tasks: per split name, where its records came from and what the length
      filter did (`records`, `kept`, `dropped`, `longest`, `limit`, `file`); a run
      records it in `data.json` and prints it at start-up.
    has_answers: every record has a reference `answer` (procedural tasks always do); a
      custom reward's run has a verifier only then.
    verifier: a file task's answer check, "math" or "string" (`reward.verifier`, or
      for "auto" `rljax.rewards.answer_verifier` of its answers); None for procedural tasks.
    sft_records: `(start, n) -> records` the warm-up's targets are made from.
    """

    train: Callable[[int, int], tuple[list[str], list[dict]]]
    eval_prompts: list[str]
    eval_metadata: list[dict]
    sft: Callable[[int, int], tuple[list[str], list[str]]]
    val_prompts: list[str] = dataclasses.field(default_factory=list)
    val_metadata: list[dict] = dataclasses.field(default_factory=list)
    train_size: int | None = None
    splits: dict[str, dict] = dataclasses.field(default_factory=dict)
    has_answers: bool = True
    verifier: str | None = None
    sft_records: Callable[[int, int], list[dict]] | None = None

    def describe(self) -> list[str]:
        """One line per split: records read, dropped by the length filter, kept."""
        return [f"data: split {name!r} ({d['file']}): {d['records']} records, {d['dropped']} "
                f"dropped as longer than task.max_prompt_tokens={d['limit']} (longest "
                f"{d['longest']} tokens), {d['kept']} kept" for name, d in self.splits.items()]


def _fill(template: str, record: dict, field: str) -> str:
    try:
        return template.format(**record)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{field}={template!r} does not fit the task's records ({e!r}); "
                         f"their fields: {sorted(record)}") from None


def _prompt_text(cfg: ExperimentConfig, tokenizer, record: dict) -> str:
    return model_prompt(cfg, tokenizer, _fill(cfg.task.prompt_template, record,
                                              "task.prompt_template"))


def model_prompt(cfg: ExperimentConfig, tokenizer, text: str) -> str:
    """The model's input for the user text `text`, as the run's prompts are built: the
    tokenizer's chat template with `task.system_prompt` when `task.chat_template`, else
    the system prompt as a first line; then `task.assistant_prefix`."""
    t = cfg.task
    if t.chat_template:
        return build_chat_prompt(tokenizer, text, system=t.system_prompt,
                                 assistant_prefix=t.assistant_prefix)
    head = f"{t.system_prompt}\n" if t.system_prompt else ""
    return head + text + t.assistant_prefix


def _procedural(cfg: ExperimentConfig) -> Callable[..., list[dict]]:
    """`draw(stream, start, n, exclude=())`: problems `start..start+n-1` of `stream`; a
    problem whose prompt is in `exclude` is redrawn from a sub-seed, deterministically."""
    t, seed = cfg.task, cfg.run.seed
    if t.name == "arithmetic":
        task = ArithmeticTask(digits=t.difficulty, ops=t.ops, style=t.style)
        draw = lambda rng: task.sample(rng).to_record()
    else:
        task = CountdownTask(num_numbers=t.difficulty, max_number=t.max_number)
        draw = task.sample

    def one(stream: int, i: int, exclude) -> dict:
        rec, attempt = draw(np.random.default_rng([seed, stream, i])), 0
        while exclude and rec["prompt"] in exclude:
            attempt += 1
            if attempt > 1000:
                raise ValueError(f"task: cannot draw a training prompt outside the "
                                 f"{len(exclude)} held-out prompts; lower rl.eval_prompts "
                                 f"or raise task.difficulty")
            rec = draw(np.random.default_rng([seed, stream, i, attempt]))
        return rec

    return lambda stream, start, n, exclude=(): [one(stream, start + i, exclude)
                                                 for i in range(n)]


def _epoch_order(records: Sequence[dict], permutation: Callable[[int], np.ndarray]):
    """`(start, n) -> records` visiting `records` in `permutation(epoch)` order per epoch."""
    n_rec = len(records)
    perm = functools.lru_cache(maxsize=2)(permutation)  # one permutation per epoch
    return lambda start, n: [records[int(perm(i // n_rec)[i % n_rec])]
                             for i in range(start, start + n)]


def build_task(cfg: ExperimentConfig, tokenizer) -> TaskData:
    """Training, held-out and SFT sources of `cfg.task` (see the module docstring)."""
    t = cfg.task
    n_val = cfg.sft.stop_prompts if cfg.sft is not None and cfg.sft.stop_accuracy > 0 else 0
    known: dict = {}  # a file task's size, length-filter counts, answers (else the defaults)
    if t.name in ("arithmetic", "countdown"):
        draw = _procedural(cfg)
        eval_records = draw(_EVAL_STREAM, 0, cfg.rl.eval_prompts)
        held = frozenset(r["prompt"] for r in eval_records)
        records = lambda start, n: draw(_RL_STREAM, start, n, held)
        sft_records = lambda start, n: draw(_SFT_STREAM, start, n, held)
        val_records = draw(_VAL_STREAM, 0, n_val, held)
    else:
        done: dict = {}
        length = lambda r: len(tokenizer.encode(_prompt_text(cfg, tokenizer, r),  # noqa: E731
                                                add_special_tokens=False))
        train = filtered_split(cfg, length, "split", done)
        held = filtered_split(cfg, length, "eval_split", done)
        require_answers(cfg, train + held)
        eval_records = held[: cfg.rl.eval_prompts]
        val_records = held[len(eval_records): len(eval_records) + n_val]
        if len(val_records) < n_val:
            raise ValueError(
                f"sft.stop_prompts={n_val}: split {t.eval_split!r} has {len(held)} usable "
                f"records, {len(eval_records)} of them held out (rl.eval_prompts); it needs "
                f"{n_val} more for validation. Lower sft.stop_prompts or rl.eval_prompts."
            )
        records = _epoch_order(train, ShuffledIterator(train, seed=cfg.run.seed).permutation)
        # Not [seed, 0, epoch]: numpy's SeedSequence ignores trailing zeros, so that would
        # repeat the RL order ([seed, epoch]) for seed 0.
        sft_records = _epoch_order(train, lambda epoch: np.random.default_rng(
            [_SFT_FILE_ORDER, cfg.run.seed, epoch]).permutation(len(train)))
        answers = [r["answer"] for r in (*train, *held) if "answer" in r]
        complete = t.answer_field is not None and len(answers) == len(train) + len(held)
        verifier = cfg.reward.verifier
        known = dict(train_size=len(train), splits=done.get("_splits", {}),
                     has_answers=complete,
                     verifier=rw.answer_verifier(answers) if verifier == "auto" else verifier)

    def texts(recs):
        return [_prompt_text(cfg, tokenizer, r) for r in recs]

    def rl_source(start: int, n: int):
        recs = records(start, n)
        return texts(recs), recs

    def sft_source(start: int, n: int):
        recs = sft_records(start, n)
        if cfg.env is not None and cfg.env.sft_trace is not None:  # episodes' traces
            return trace_examples(cfg, recs)
        return texts(recs), [_fill(t.sft_template, r, "task.sft_template") for r in recs]

    return TaskData(rl_source, texts(eval_records), list(eval_records), sft_source,
                    texts(val_records), list(val_records), sft_records=sft_records, **known)


def check_inputs(cfg: ExperimentConfig) -> None:
    """What can be checked before a run writes anything: the custom reward imports, and a
    file task's split files exist, the environment builds (errors name the setting)."""
    check_reward(cfg)
    check_env(cfg)
    check_data_files(cfg)


def build_reward(cfg: ExperimentConfig, task: TaskData | None = None
                 ) -> tuple[Any, Verifier | None]:
    """`(reward_fns, accuracy_fn)` for `RLTrainer`: item rewards (a list) or a batch
    reward function, and the verifier (a `Verifier`, `(completion, meta) -> bool`, whose
    `name` labels the accuracy; it pickles, so it runs in the reward pool under the time
    limit) or None: a custom reward has a verifier only when every record of `task` has a
    reference answer. An environment run (`cfg.env`) has neither: its episodes' returns
    are the rewards."""
    if cfg.env is not None:
        return None, None
    r, t = cfg.reward, cfg.task
    prefix = t.assistant_prefix.strip()
    fmt = rw.TagFormat(think_open=f"<{r.think_tag}>", think_close=f"</{r.think_tag}>",
                       answer_open=f"<{r.answer_tag}>", answer_close=f"</{r.answer_tag}>",
                       think_in_prompt=r.think_in_prompt or prefix == f"<{r.think_tag}>")
    tagged = r.kind in ("format", "accuracy+format")
    if t.name == "arithmetic":
        acc = ArithmeticReward(style=t.style)
        label = f"rljax.run.tasks.check_arithmetic(style={t.style!r})"
    elif t.name == "countdown":
        acc = CountdownReward(fmt=fmt, correct=1.0, format_score=0.0)
        label = "rljax.data.check_countdown"
    else:
        acc, label = _answer_check(cfg, task, fmt if tagged else None)
    accuracy_fn = Verifier(rw.Verified(acc, correct=1.0, incorrect=0.0, name="accuracy"),
                           label)
    if task is not None and not task.has_answers:
        accuracy_fn = None  # nothing to verify against: the reward is the headline
    if r.kind == "reward_model":
        return RewardModelScorer.from_pretrained(r.model_path), accuracy_fn
    if r.kind == "custom":
        return custom_reward(cfg, ComponentReward), accuracy_fn
    terms = []
    if r.kind in ("accuracy", "accuracy+format"):
        terms.append((r.accuracy_weight * r.correct_reward, dataclasses.replace(acc, name="accuracy")))
    if r.kind in ("format", "accuracy+format"):
        terms.append((r.format_weight if r.kind == "accuracy+format" else 1.0,
                      rw.FormatReward(fmt, name="format")))
    return ComponentReward(tuple(terms), timeout_s=r.timeout_s, workers=r.workers), accuracy_fn


def _answer_check(cfg: ExperimentConfig, task: TaskData | None, tags) -> tuple[Any, str]:
    """A file task's verifier and its label: `MathAccuracy` or `StringAccuracy` as
    `task.verifier` (or `reward.verifier`, "auto" -> math, without a task) says."""
    r = cfg.reward
    kind = task.verifier if task is not None and task.verifier else (
        "math" if r.verifier == "auto" else r.verifier)
    cls = rw.StringAccuracy if kind == "string" else rw.MathAccuracy
    how = f"reward.verifier={r.verifier!r}" + (f" -> {kind!r}" if r.verifier == "auto" else "")
    return cls(mode=r.answer_mode, answer_tags=tags), (
        f"rljax.rewards.{cls.__name__}(mode={r.answer_mode!r}) against task.answer_field="
        f"{cfg.task.answer_field!r} ({how})")


def has_device_reward(cfg: ExperimentConfig) -> bool:
    """Whether the task's reward has a JAX form (`build_device_reward`): the arithmetic
    task's accuracy reward in the plain or reversed style, or a custom `reward.function`
    that is a `DeviceReward` instance."""
    r, t = cfg.reward, cfg.task
    if r.kind == "custom":
        return is_device_reward(load_function(r.function, "reward.function"))
    return t.name == "arithmetic" and t.style in ("plain", "reversed") and r.kind == "accuracy"


def build_device_reward(cfg: ExperimentConfig, tokenizer):
    """The task's reward as a JAX function of token ids (`rljax.rewards.device`): the
    several-seed run's step is then one program. Where there is none
    (`has_device_reward`): ValueError."""
    r, t = cfg.reward, cfg.task
    if not has_device_reward(cfg):
        if r.kind == "custom":
            raise ValueError(f"reward.function={r.function!r} is a host reward; a device "
                             "reward is a rljax.rewards.device.DeviceReward instance")
        raise ValueError(
            f"a device reward exists for task 'arithmetic' (style plain or reversed) with "
            f"reward.kind 'accuracy', or as a custom reward.function; got task {t.name!r} "
            f"style {t.style!r} reward.kind {r.kind!r}")
    if r.kind == "custom":
        return load_function(r.function, "reward.function")
    vocab = cfg.model.vocab_size if cfg.model is not None else len(tokenizer)
    return ArithmeticDeviceReward.from_tokenizer(
        tokenizer, vocab, tokenizer.eos_token_id, style=t.style,
        scale=r.accuracy_weight * r.correct_reward)


class ComponentReward:
    """Batch reward `sum_j w_j f_j` over item rewards that keeps each term's batch mean.

    `last` holds `{"reward/<name>": mean}` of the latest call and `last_components` its
    per-row values (name -> float32[B]), from which the trainer logs each term's mean over
    the whole step (`rljax.train.sources.host.Rollouts.step_metrics`): the accuracy and format
    terms separately (R1-Zero's two rewards). With `workers > 0` the
    item calls run in the process's shared `RewardPool` (`shared_reward_pool`) and each is
    cut at `timeout_s`: a call past it scores 0 and is logged (by `score_batch`) with its
    row and its prompt's file and line (the metadata's `source`), and the run goes on;
    `last_timeouts` counts the rows of the latest call with a term cut (`reward/timeouts`).
    """

    is_batch_reward = True
    name = "reward"

    def __init__(self, terms: tuple[tuple[float, Callable], ...], *, timeout_s: float | None = None,
                 workers: int = 0):
        self.terms, self.last, self.last_components = terms, {}, {}
        self.last_timeouts = 0
        self.timeout_s, self.workers = timeout_s, workers

    def __call__(self, completions, metadata) -> np.ndarray:
        pool = shared_reward_pool(self.workers) if self.workers > 0 else None
        out = rw.score_batch([f for _, f in self.terms], completions, metadata,
                             weights=[w for w, _ in self.terms], pool=pool,
                             timeout_s=self.timeout_s if pool is not None else None)
        self.last = {f"reward/{k}": float(np.mean(v)) for k, v in out.components.items()}
        self.last_components = out.components
        self.last_timeouts = len({t.index for t in out.timeouts})
        return out.rewards
