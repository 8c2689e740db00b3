"""Trained policies as files: load from a run directory or an HF folder, export, sample.

A *source* is either
- a run directory (`config.json` with a `config_hash`, `checkpoints/`): the policy of its
  latest (or a chosen) checkpoint, on the architecture of the run's config, with the
  run's tokenizer (`tokenizer/` in the run directory, else the config's tokenizer), or
- a Hugging Face model folder (`config.json` + safetensors + tokenizer files).

These are the Python calls behind `rljax export`, `rljax sample` and `rljax eval`.

A run's policy is read from its checkpoint alone (`params["policy"]`, not the optimiser
moments), sharded over every device of every process; `export_hf` then gathers one tensor
at a time, so no host ever holds more than the largest tensor of the model, and process 0
alone writes. Launched on all hosts of a pod (`rljax export --distributed`) or on one
process, it writes the same files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from rljax.models import Decoder
from rljax.models.hf_config import config_from_hf
from rljax.models.hf_io import (from_pretrained, special_token_ids, state_getter, state_location,
                                write_pretrained)
from rljax.models.peft_io import merged_getter, write_peft
from rljax.models.tokenizer import (build_char_tokenizer, encode_prompts, load_tokenizer,
                                    stop_token_ids)
from rljax.rewards.device import is_device_reward
from rljax.run.builders import build_model, build_reward, build_task, model_prompt
from rljax.run.environment import episode_eval
from rljax.run.lora_runs import restore_lora_policy, saved_target
from rljax.run.experiment import ExperimentConfig, config_from_dict
from rljax.run.experiment_files import load_experiment
from rljax.run.overrides import apply_overrides
from rljax.run.run_writers import is_local, run_path, write_folder
from rljax.run.user_reward import shared_reward_pool
from rljax.sampling import generate
from rljax.sharding import MeshConfig, make_mesh
from rljax.train.checkpoint import Checkpointer, pure_params
from rljax.train.config import SamplingConfig
from rljax.train.sources.evaluate import evaluate
from rljax.train.sources.host import Rollouts

__all__ = ["PASS_THRESHOLD", "evaluate_source", "export_hf", "is_run_dir", "load_policy",
           "sample_texts"]

#: `rljax eval`'s default pass mark for a reward without a verifier: a sampled completion
#: passes pass@k when its reward is >= 0.5 (the midpoint of the usual 0-1 reward; also
#: the default pass mark of `rljax.rewards.Verified` and of the difficulty tracker).
PASS_THRESHOLD = 0.5


def is_run_dir(path: str | os.PathLike) -> bool:
    """True when `path` (local or gs://) is an rljax run directory (its config.json
    carries a config hash)."""
    cfg = run_path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "config_hash" in json.loads(cfg.read_text())
    except json.JSONDecodeError:
        return False


def run_tokenizer(run_dir, cfg) -> Any:
    tok = run_dir / "tokenizer"
    if tok.is_dir() and not is_local(tok):  # tokenizers load from local folders only
        with tempfile.TemporaryDirectory() as tmp:
            for f in tok.iterdir():
                f.copy(epath.Path(tmp) / f.name)
            return load_tokenizer(tmp)
    if tok.is_dir():
        return load_tokenizer(tok)
    if cfg.tokenizer == "char":
        return build_char_tokenizer()
    return load_tokenizer(cfg.tokenizer if cfg.tokenizer is not None else cfg.hf_path)


def _model_config(cfg):
    if cfg.model is not None:
        return cfg.policy_config(cfg.model)
    config = config_from_hf(json.loads((pathlib.Path(cfg.hf_path) / "config.json").read_text()))
    # The run's layout: a scanned run's checkpoints hold stacked [L, ...] layers.
    return cfg.policy_config(dataclasses.replace(config, scan_layers=cfg.scan_layers,
                                                 remat=cfg.remat))


def seed_config(cfg: ExperimentConfig, run_seed: int | None) -> ExperimentConfig:
    """The config of one seed of a run: `run_seed` (default the run's first seed,
    `run.seed`) with `run.seeds=1`, so its held-out prompts are that seed's own. A seed the
    run did not train is a ValueError naming the seeds it did."""
    seeds = list(range(cfg.run.seed, cfg.run.seed + cfg.run.seeds))
    seed = cfg.run.seed if run_seed is None else run_seed
    if seed not in seeds:
        raise ValueError(f"--seed {seed}: this run trained seed"
                         f"{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} "
                         "(run.seed, run.seeds); choose one of them")
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed, seeds=1))


def restore_policy(run_dir, step: int | None, mesh=None, run_seed: int | None = None):
    """`(run config of the chosen seed, model config, policy as pure nested dicts,
    checkpoint meta)` of a run directory (local or gs://). A several-seed run's stacked
    checkpoint is read on one device and seed `run_seed` (default `run.seed`) taken."""
    blob = json.loads((run_dir / "config.json").read_text())  # load_run_config, via epath
    full = config_from_dict(ExperimentConfig, blob.get("config", blob))
    cfg = seed_config(full, run_seed)
    ck_dir = run_dir / "checkpoints"
    if not ck_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} has no checkpoints/ to load a policy from")
    config = _model_config(cfg)
    num_seeds, k = full.run.seeds, cfg.run.seed - full.run.seed  # seed k of the stack
    where = mesh if num_seeds == 1 else None  # a several-seed stack: on one device
    if config.lora is not None:  # the checkpoints hold the adapters; the base is rebuilt
        tok = run_tokenizer(run_dir, cfg)
        models = [build_model(seed_config(full, s), tok, where)  # every seed's base, stacked
                  for s in range(full.run.seed, full.run.seed + num_seeds)]
        with Checkpointer(ck_dir) as ck:
            policy, meta = restore_lora_policy(ck, models, step, where, whole=full.warms_up_base,
                                               index=k)
        return cfg, config, policy, meta
    # The policy as saved (`saved_target`); a several-seed run's stacked [num_seeds, ...]
    abs_state = nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))), nnx.Param)
    lead = () if num_seeds == 1 else (num_seeds,)
    target = {"params": {"policy": saved_target(abs_state, where, lead)}}
    with Checkpointer(ck_dir) as ck:
        try:
            raw, meta = ck.restore_subtree(target, step)
        except (KeyError, ValueError) as e:
            raise ValueError(f"a checkpoint in {ck_dir} holds no params['policy'] of this "
                             f"run's model: {e}") from None
    policy = raw["params"]["policy"]
    if num_seeds > 1:  # seed k of the stack is run.seed + k (one program, not one a leaf)
        policy = jax.jit(lambda tree: jax.tree.map(lambda x: x[k], tree))(policy)
    return cfg, config, pure_params(policy), meta


def policy_split(config, policy: dict) -> tuple:
    """`(graphdef, state)` of a `Decoder(config)` holding `policy` (pure nested dicts, as
    `restore_policy` returns them), built abstractly: nothing is randomly initialised
    first (for a large model, a second copy of its weights and minutes of init)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, policy)
    return graphdef, state


def load_policy(source: str | pathlib.Path, *, step: int | None = None,
                run_seed: int | None = None):
    """`(Decoder, tokenizer, ExperimentConfig or None)` from a run directory or HF folder.

    For a run of several seeds (`run.seeds > 1`, one stacked checkpoint) `run_seed` picks
    the seed (default the run's first, `run.seed`); the config returned is that seed's
    (`run.seed=run_seed`, `run.seeds=1`)."""
    source = pathlib.Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is neither a run directory nor a model folder")
    if is_run_dir(source):
        cfg, config, policy, _ = restore_policy(source, step, run_seed=run_seed)
        return nnx.merge(*policy_split(config, policy)), run_tokenizer(source, cfg), cfg
    for name, value in (("step", step), ("seed", run_seed)):
        if value is not None:
            raise ValueError(f"{name}={value} applies to run directories; {source} is a "
                             "model folder")
    return from_pretrained(source), load_tokenizer(source), None


def export_hf(source: str | pathlib.Path, out_dir: str | os.PathLike, *,
              step: int | None = None, dtype: str = "float32",
              max_shard_bytes: int | None = None, run_seed: int | None = None,
              adapters: bool = False) -> epath.Path:
    """Write the policy of `source` as a Hugging Face folder (weights, config, tokenizer).

    A LoRA run's policy is written merged (``W + (alpha / r) A B``: a plain transformers
    model); with `adapters` its adapters are written instead as a PEFT folder
    (adapter_config.json + adapter_model.safetensors, float32, and the tokenizer), which
    ``peft.PeftModel.from_pretrained`` loads onto the base (`rljax.models.peft_io`).

    The folder is what transformers' `generate` needs: config.json and
    generation_config.json carry the tokenizer's bos / eos / pad ids, the tokenizer keeps
    its chat template, and the folder's mode follows the umask.

    `source` is a run directory (local or an `etils.epath` URL such as gs://bucket/run) or
    a local HF folder. `out_dir` is a local folder or a URL (written locally first, then
    copied). Bucket paths go through `etils.epath` and were not tried against a real bucket. `dtype` "float32" or
    "bfloat16"; `max_shard_bytes` splits the weights into files with an index. On several
    processes every process must call this (each takes part in every tensor's gather);
    process 0 alone writes. `run_seed` picks the seed of a several-seed run (`load_policy`).
    """
    out = run_path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export: {out} exists and is not empty; choose a new folder")
    cfg = None
    if not is_run_dir(source):
        model, tokenizer, _ = load_policy(source, step=step, run_seed=run_seed)
        config, get = model.config, state_getter(model)
    else:
        mesh = make_mesh(MeshConfig()) if jax.device_count() > 1 else None
        cfg, config, policy, _ = restore_policy(run_path(source), step, mesh, run_seed)
        tokenizer = run_tokenizer(run_path(source), cfg)
        get = lambda spath: multihost_utils.process_allgather(  # noqa: E731
            _leaf(policy, *state_location(config, spath)), tiled=True)
    if adapters and config.lora is None:
        raise ValueError(f"export --adapters: {source} has no LoRA adapters (lora.rank is 0)")
    if adapters and cfg is not None and cfg.warms_up_base:
        raise ValueError(f"export --adapters: the warm-up of {source} trained its base "
                         "(sft.full_parameters), which no folder holds for the adapters to "
                         "load onto; export the merged weights (without --adapters)")
    primary = jax.process_index() == 0

    def write(folder: pathlib.Path) -> None:
        if adapters:
            write_peft(config, get, folder if primary else None,
                       base_model=None if cfg is None else cfg.hf_path)
        else:
            write_pretrained(config, merged_getter(config, get, get), folder if primary else None,
                             dtype=dtype, max_shard_bytes=max_shard_bytes,
                             special_ids=special_token_ids(tokenizer))
        if primary:
            tokenizer.save_pretrained(str(folder))

    if primary:
        write_folder(out, write)
    else:
        write(out)  # gathers without writing
    return out


def _leaf(tree, spath, layer=None):
    for key in spath:
        tree = tree[str(key)]
    return tree if layer is None else tree[layer]  # one layer of a stacked parameter


def _sampling_defaults(run_cfg, max_new_tokens, temperature) -> dict:
    """`generate`'s sampling options: those given, else the run's `sampling` config (the
    distribution it was trained with, top-k / top-p included), else 64 tokens at T = 1."""
    s = run_cfg.sampling if run_cfg is not None else SamplingConfig()
    args = s.sampler_args()
    if max_new_tokens is not None:
        args["max_new_tokens"] = max_new_tokens
    if temperature is not None:
        args["temperature"] = temperature
    return args


def sample_texts(source: str | pathlib.Path, prompts: Sequence[str], *, num_samples: int = 1,
                 max_new_tokens: int | None = None, temperature: float | None = None,
                 seed: int = 0, step: int | None = None, run_seed: int | None = None,
                 raw: bool = False) -> list[list[str]]:
    """`num_samples` completions (text, up to EOS) of each prompt from the policy of `source`.

    `max_new_tokens` / `temperature` None take the run's `sampling` config (and its top-k /
    top-p); a model folder defaults to 64 tokens at temperature 1. `temperature=0` decodes
    greedily; `seed` seeds the sampling. A run directory's prompts are built as its
    training prompts were (`rljax.run.builders.model_prompt`: the chat template when
    `task.chat_template`, the system prompt, `task.assistant_prefix`) unless `raw`; a model
    folder's are used as given. `run_seed` picks a seed of a several-seed run
    (`load_policy`).
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    model, tokenizer, run_cfg = load_policy(source, step=step, run_seed=run_seed)
    if run_cfg is not None and not raw:
        prompts = [model_prompt(run_cfg, tokenizer, p) for p in prompts]
    eos = tokenizer.eos_token_id
    stops = () if eos is None else stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    res = generate(model, encode_prompts(tokenizer, list(prompts)), key=jax.random.key(seed),
                   stop_ids=stops, num_samples=num_samples, pad_id=pad,
                   **_sampling_defaults(run_cfg, max_new_tokens, temperature))
    texts = _decode(tokenizer, res, stops)
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]


def _decode(tokenizer, res, stops: tuple) -> list[str]:
    tokens, mask = np.asarray(res.tokens), np.asarray(res.completion_mask)
    return [tokenizer.decode([int(t) for t, m in zip(row, mrow) if m and int(t) not in stops])
            for row, mrow in zip(tokens, mask)]


def evaluate_source(source: str | pathlib.Path, *, experiment: str | None = None,
                    overrides: Sequence[str] = (), num_prompts: int | None = None, k: int = 1,
                    step: int | None = None, batch_size: int = 64,
                    run_seed: int | None = None,
                    pass_threshold: float | None = None) -> dict[str, Any]:
    """Held-out results of the policy of `source` on its task: greedy accuracy and pass@k
    with a verifier, and "verifier": the name of the check that computed them. A reward
    without a verifier (a custom reward, a reward model) is scored itself: the greedy
    "reward_mean", and pass@k where a completion passes when its reward is `>=
    pass_threshold` (default `PASS_THRESHOLD`; "pass_threshold" and "reward" name them).
    An environment run's (`ExperimentConfig.env`) are its episodes' returns instead
    (`rljax.run.environment.episode_eval`).

    The task and reward come from the run's config (or `experiment`, required for a
    model folder), with `overrides` (e.g. `task.eval_split=FILE`: another held-out file).
    Greedy: one temperature-0 completion per prompt. pass@k: k completions per prompt at
    `sampling.temperature`; a prompt passes when any passes (Chen et al. 2021's estimator
    with n = k samples), and `sample_accuracy` (`sample_pass`, `sample_reward_mean`
    without a verifier) is the mean over all k x prompts samples. `run_seed` picks a seed
    of a several-seed run (default its first, `run.seed`): its own held-out prompts. The
    scoring is the one held-out evaluator's (`rljax.train.sources.evaluate`) on a host
    source with the run's verifier or reward (its reward pool and time limit when it has
    workers).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    model, tokenizer, run_cfg = load_policy(source, step=step, run_seed=run_seed)
    if experiment is None and run_cfg is None:
        raise ValueError("eval of a model folder needs --experiment EXP to name the task and "
                         "its reward (a run directory carries its own)")
    cfg = (apply_overrides(run_cfg, overrides) if experiment is None
           else load_experiment(experiment, overrides))
    task = build_task(cfg, tokenizer)
    n = len(task.eval_prompts) if num_prompts is None else num_prompts
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(task.eval_prompts):
        raise ValueError(f"num_prompts must be in 1..{len(task.eval_prompts)} "
                         f"(rl.eval_prompts), got {num_prompts!r}")
    if cfg.env is not None:  # an environment run: episodes, their returns
        if pass_threshold is not None:
            raise ValueError(f"--pass-threshold {pass_threshold}: an environment run's eval "
                             "reports its sampled episodes' mean and best return "
                             "(sample_reward_mean, best@k_reward_mean), no pass@k")
        return episode_eval(cfg, model, tokenizer, task, n, k)
    reward_fns, accuracy_fn = build_reward(cfg, task)
    threshold = _pass_threshold(cfg, reward_fns, accuracy_fn, pass_threshold)
    graphdef, params = nnx.split(model)
    pool = shared_reward_pool(cfg.reward.workers) if cfg.reward.workers else None
    scored = reward_fns if accuracy_fn is None else (
        lambda c, m: np.zeros(len(c), np.float32))  # the verifier alone is reported
    source = Rollouts(graphdef, tokenizer, scored, accuracy_fn=accuracy_fn,
                      sampling=cfg.sampling, prompt_len=cfg.task.max_prompt_tokens,
                      group_size=1, reward_pool=pool, reward_timeout_s=cfg.reward.timeout_s)
    res = evaluate(source, params, task.eval_prompts[:n], task.eval_metadata[:n],
                   batch_size=batch_size, k=k, seed=cfg.run.seed, threshold=threshold)
    head = {"n": n, "k": k, "seed": cfg.run.seed}
    temp = {"temperature": cfg.sampling.temperature}
    if accuracy_fn is not None:
        return {**head, "verifier": getattr(accuracy_fn, "name", None),
                **_picked(res, "accuracy", f"pass@{k}", "sample_accuracy"), **temp}
    return {**head, "verifier": None, "reward": cfg.reward.function or cfg.reward.kind,
            "pass_threshold": threshold,
            **_picked(res, "reward_mean", f"pass@{k}", "sample_pass", "sample_reward_mean"),
            **temp}


def _picked(res: dict, *names: str) -> dict:
    return {name: res[name] for name in names}


def _pass_threshold(cfg, reward_fns, accuracy_fn, given: float | None) -> float | None:
    """The reward a sampled completion needs to pass: None with a verifier (it decides;
    giving one then is a ValueError), else `given` (a finite number) or `PASS_THRESHOLD`."""
    if accuracy_fn is not None:
        if given is not None:
            raise ValueError(f"--pass-threshold {given}: this run's reward has a verifier "
                             f"({getattr(accuracy_fn, 'name', accuracy_fn)}), which decides "
                             "what passes; the threshold is for a reward without one")
        return None
    if is_device_reward(reward_fns):
        raise ValueError(f"eval: the reward {cfg.reward.function} is a JAX device reward "
                         "without a verifier; rljax eval scores host rewards (a batch or "
                         "item function, a reward model) or a verifier; its held-out reward "
                         "means are in the run's eval_before.json and eval_after.json")
    threshold = PASS_THRESHOLD if given is None else given
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not \
            math.isfinite(threshold):
        raise ValueError(f"--pass-threshold must be a finite number, got {given!r}")
    return float(threshold)
