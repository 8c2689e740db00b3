"""Frozen, validated configuration dataclasses for SFT and the RL loop.

Every config validates itself in ``__post_init__``; an error names the field, the bad
value and what is allowed. Checks that need two configs are
:func:`check_algorithm_sampling` and :func:`check_packing`. The package: ``algorithm``
(``AlgorithmConfig`` and ``algorithm_preset``, public here too), ``presets`` (the
algorithm registry), ``checks`` (field checks), ``dicts`` (configs to JSON dicts and back).
"""

from __future__ import annotations

import dataclasses

from rljax.train.config.algorithm import (ADV_STDS, AGGREGATIONS, ALGORITHMS,  # noqa: F401
                                          GROUP_BASELINES, KL_IN, KL_KINDS, OLD_LOGP,
                                          AlgorithmConfig, algorithm_preset)
from rljax.train.config.checks import check_algorithm_sampling, check_packing  # noqa: F401
from rljax.train.config.checks import (check_bool, check_choice, check_micro_batch, check_num,
                                       check_pass_options, fail)

SCHEDULES = ("constant", "cosine", "linear")
REF_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, a decay schedule and global-norm clipping.

    Attributes:
      lr: peak learning rate.
      warmup_steps: linear warm-up from 0 to ``lr`` over this many updates (0 = none).
        GRPO on a freshly initialised Adam state needs it: a constant 3e-4 collapsed the
        arithmetic demo's accuracy to 0 within 20 steps.
      schedule: after warm-up, "constant", "cosine" or "linear" decay to
        ``lr * min_lr_ratio`` at the last update.
      min_lr_ratio: final learning rate as a fraction of ``lr``.
      weight_decay: decoupled weight decay (AdamW, Loshchilov & Hutter 2019).
      b1, b2, eps: Adam moments (in [0, 1): 1 makes the bias correction divide by 0) and
        epsilon.
      clip_norm: clip the global gradient norm to this value (0 = no clipping).
    """

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0

    def __post_init__(self):
        c = "OptimConfig"
        check_num(c, "lr", self.lr, lo=0.0, lo_open=True)
        check_num(c, "warmup_steps", self.warmup_steps, lo=0, integer=True)
        check_choice(c, "schedule", self.schedule, SCHEDULES)
        check_num(c, "min_lr_ratio", self.min_lr_ratio, lo=0.0, hi=1.0)
        check_num(c, "weight_decay", self.weight_decay, lo=0.0)
        check_num(c, "b1", self.b1, lo=0.0, hi=1.0, hi_open=True)
        check_num(c, "b2", self.b2, lo=0.0, hi=1.0, hi_open=True)
        check_num(c, "eps", self.eps, lo=0.0, lo_open=True)
        check_num(c, "clip_norm", self.clip_norm, lo=0.0, finite=False)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Rollout sampling settings (passed to ``rljax.sampling.generate``).

    Attributes:
      max_new_tokens: completion length cap (tokens).
      temperature: softmax temperature (> 0 in RL; the trainer's log-probs use the same).
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus threshold in (0, 1] (1 = off).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        c = "SamplingConfig"
        check_num(c, "max_new_tokens", self.max_new_tokens, lo=1, integer=True)
        check_num(c, "temperature", self.temperature, lo=0.0, lo_open=True)
        check_num(c, "top_k", self.top_k, lo=0, integer=True)
        check_num(c, "top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)

    @property
    def filters(self) -> bool:
        """True when top-k or top-p removes tokens from the draw."""
        return self.top_k > 0 or self.top_p < 1.0

    def sampler_args(self, *, greedy: bool = False) -> dict:
        """The sampler's sampling arguments (``rljax.sampling.generate`` / ``prepare``):
        ``max_new_tokens``, ``temperature`` and ``top_k`` / ``top_p`` (None when off).
        ``greedy``: temperature 0 and no filters (top-k and top-p always keep the most
        likely token, so the argmax is the same; one greedy program whatever the filters).
        Every caller that samples from a run's config makes them here."""
        if greedy:
            return dict(max_new_tokens=self.max_new_tokens, temperature=0.0, top_k=None,
                        top_p=None)
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    top_k=self.top_k or None, top_p=self.top_p if self.top_p < 1.0 else None)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop's schedule and memory options.

    Attributes:
      steps: RL steps (each: sample, score, update).
      prompts_per_step: prompts per step; the batch holds ``prompts_per_step * group_size``
        completions.
      eval_every: evaluate every N steps (0 = only before and after).
      eval_prompts: held-out prompts per evaluation.
      remat: rematerialise each decoder layer in the backward pass.
      logp_chunk: sequence positions per log-prob chunk; each chunk's ``[B, chunk, V]``
        logits are recomputed in the backward pass, never the whole ``[B, T, V]``. The
        default 32 keeps a chunk's logits at ``B x 32 x V`` (262 MB for 64 rows and a
        32,000 vocabulary; 1 GB at 128 positions) while its head matmul still has
        ``B x 32`` rows; raise it only for batches of a few rows.
      max_nonfinite_steps: stop with an error after this many consecutive updates skipped
        for a non-finite loss or gradient.
      peak_flops: one chip's peak FLOP/s for the MFU estimate (0 = the chip's dense bf16
        peak from ``rljax.train.throughput.PEAK_BF16_FLOPS``; no MFU on CPU or an
        unknown chip, only model FLOP/s).
      value_lr_ratio: PPO: value-model learning rate as a multiple of the policy's.
      ref_dtype: storage dtype of the frozen KL reference, "float32" or "bfloat16" (half
        the memory; its forward runs in the model's compute_dtype and its log-probs stay
        float32; policy and optimiser stay float32). See ``rljax.train.learn.reference``.
      share_prompts: in the learning program's forwards (reference, old policy, teacher,
        the update), run each group's prompt through the decoder once and its
        ``group_size`` completions after it (``Decoder.grouped_hidden_states``): the same
        log-probs and gradients with the prompt's layer FLOPs divided by the group size.
        It applies when ``group_size > 1``, the micro-batches hold whole groups and the
        attention is "xla" or "splash"; minibatches then draw whole groups.
      one_pass_head: with a token-separable objective (``rljax.objectives.token_separable``)
        and a linear output head, each update forms the head's gradient in the same pass
        as its log-probs (``rljax.train.learn.onepass``): three ``[rows x V]`` products a
        chunk instead of four, the same values and (to rounding) gradients. False: the
        log-prob chunks are recomputed in the backward.
      share_prompts and one_pass_head: None (the default) takes the fast path where it
        applies, else the other one, and the start-up line says why; True is an error where
        it does not apply (``rljax.train.programs.paths``; ``RLTrainer.paths`` says which).
      tokens_per_micro_batch: > 0 packs each row's real tokens into rows of width ``P + T``
        and sizes the learning program's micro-batches by this many token slots
        (``rljax.train.learn.packing``; at least one packed row per batch shard); 0: padded
        rows, ``micro_batch_size`` rows at a time. Needs a host reward and one minibatch;
        the forwards then compute every row's prompt (no ``share_prompts``).
      max_staleness: 0 (the default): every step samples with the policy it then updates
        (the synchronous step). k >= 1: bounded-staleness asynchronous RL
        (``rljax.train.async_driver``): the batch a step learns from was sampled at most
        k updates earlier, and the next batch's sampling, rewards and tools run while the
        chips learn (docs/async.md). Needs a host source (a host reward, DAPO's refill or
        environment episodes).
    """

    steps: int = 100
    prompts_per_step: int = 8
    eval_every: int = 0
    eval_prompts: int = 256
    remat: bool = False
    logp_chunk: int = 32
    max_nonfinite_steps: int = 5
    peak_flops: float = 0.0
    value_lr_ratio: float = 1.0
    ref_dtype: str = "float32"
    share_prompts: bool | None = None
    one_pass_head: bool | None = None
    tokens_per_micro_batch: int = 0
    max_staleness: int = 0

    def __post_init__(self):
        c = "RLConfig"
        check_num(c, "max_staleness", self.max_staleness, lo=0, integer=True)
        check_num(c, "tokens_per_micro_batch", self.tokens_per_micro_batch, lo=0, integer=True)
        check_num(c, "prompts_per_step", self.prompts_per_step, lo=1, integer=True)
        check_num(c, "eval_prompts", self.eval_prompts, lo=1, integer=True)
        check_pass_options(c, self)
        check_num(c, "peak_flops", self.peak_flops, lo=0.0)
        check_num(c, "value_lr_ratio", self.value_lr_ratio, lo=0.0, lo_open=True)
        check_choice(c, "ref_dtype", self.ref_dtype, REF_DTYPES)
        check_bool(c, "share_prompts", self.share_prompts, auto=True)
        check_bool(c, "one_pass_head", self.one_pass_head, auto=True)

    def eval_due(self, step: int) -> bool:
        """Whether the held-out evaluation runs after RL step ``step`` (1-based): every
        ``eval_every`` steps, except the last, which the run's final evaluation covers."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.steps


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on (prompt, completion) pairs; loss on completion tokens.

    Attributes:
      steps: optimiser updates.
      batch_size: pairs per update.
      micro_batch_size: pairs per accumulation micro-batch (0 = whole batch).
      optim: the SFT optimiser (its own schedule; the RL optimiser starts fresh).
      remat, logp_chunk, max_nonfinite_steps: as in :class:`RLConfig`.
      eval_every: held-out loss every N steps (0 = only at the end).
      stop_loss: stop the warm-up early once the mean training loss of the last 20 steps
        is below this (0 = run all `steps`); a loss target gives every seed a similar
        starting ability where a fixed step count does not.
      stop_accuracy: stop the warm-up at the first check (every `stop_every` steps) where
        greedy accuracy on `stop_prompts` validation prompts reaches this (0 = off; in
        [0, 1]). The validation prompts are disjoint from the held-out prompts that
        measure accuracy before and after RL (a procedural task may also draw them for
        training). It sets the starting ability directly: the loss at which a model
        reaches a given accuracy moves with the machine's rounding.
      stop_every, stop_prompts: how often the accuracy is checked, on how many prompts.
      stop_dense: check every step once a check has scored above 0 (an ability that
        jumps from 0 to past `stop_accuracy` within a few steps, as tool use does,
        would overshoot it between checks `stop_every` steps apart).
      full_parameters: for a policy with LoRA adapters (an experiment's `lora.rank > 0`):
        the warm-up trains every weight of the base instead of the adapters, as
        pretraining would have made it, and RL then trains the adapters (at their
        initialisation) on the warmed base; the run's checkpoints hold that base too.
    """

    steps: int = 100
    batch_size: int = 32
    micro_batch_size: int = 0
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10, schedule="cosine",
                                            min_lr_ratio=0.1)
    )
    remat: bool = False
    logp_chunk: int = 32
    max_nonfinite_steps: int = 5
    eval_every: int = 0
    stop_loss: float = 0.0
    stop_accuracy: float = 0.0
    stop_every: int = 10
    stop_prompts: int = 256
    stop_dense: bool = False
    full_parameters: bool = False

    def __post_init__(self):
        c = "SFTConfig"
        check_bool(c, "full_parameters", self.full_parameters)
        check_bool(c, "stop_dense", self.stop_dense)
        check_num(c, "stop_loss", self.stop_loss, lo=0)
        check_num(c, "stop_accuracy", self.stop_accuracy, lo=0, hi=1)
        for name in ("stop_every", "stop_prompts", "batch_size"):
            check_num(c, name, getattr(self, name), lo=1, integer=True)
        check_micro_batch(c, self.micro_batch_size, self.batch_size)
        if not isinstance(self.optim, OptimConfig):
            fail(c, "optim", self.optim, "an OptimConfig")
        check_pass_options(c, self)
