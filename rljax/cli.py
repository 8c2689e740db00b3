"""The `rljax` command line (also `python -m rljax`).

    rljax train EXPERIMENT [--set a.b=value ...] [--dry-run] [--profile-steps STEPS]
                [--distributed [--coordinator HOST:PORT --num-processes N --process-id I]
                 [--heartbeat-timeout S]]
    rljax eval SOURCE [--experiment EXP] [--set ...] [--num-prompts N] [--k K] [--seed S]
               [--step N] [--pass-threshold R]
    rljax sample SOURCE --prompt TEXT [--prompt ...] [--num-samples N] [--max-new-tokens N]
                 [--raw] [--seed S] [--sampling-seed N]
    rljax export SOURCE OUT_DIR [--step N] [--dtype float32|bfloat16] [--max-shard-size SIZE]
                 [--adapters] [--seed S] [--distributed ...]
    rljax plot RUN_DIR [--seed S]

EXPERIMENT is a file under `experiments/` (by name) or a path to one. SOURCE is a run
directory (its latest checkpoint) or a Hugging Face model folder. Each command is a thin
layer over one Python call (named in its help), so everything here is also a library call.
A run of several seeds (`run.seeds`) keeps them in one checkpoint: `--seed S` picks one for
eval / sample / export (default the run's first seed, `run.seed`); `plot` draws one curve
per seed (or only `--seed S`'s). `eval` and `sample` keep their compiled programs in JAX's
persistent compilation cache (`rljax.run.compile_cache`: ~/.cache/rljax/jax;
RLJAX_COMPILE_CACHE=DIR or 0), so a second call with the same model skips compiling.
Bad input (ValueError, TypeError, FileNotFoundError, FileExistsError: a missing experiment,
an unknown or mistyped override, a run directory that holds another run or is in use) prints
one line `rljax <command>: error: ...` and exits with status 2 (argparse's usage errors too);
any other failure prints its traceback and that line and exits 1; Ctrl-C exits 130. A run
stopped by SIGTERM (preemption: every process saves the same step) exits 0 with the step and
the resume hint.
With --distributed, a process whose run fails (typically because another process died:
its collectives fail) prints why and exits 1 at once instead of waiting in JAX's shutdown;
one that hangs in a collective is ended by JAX's coordination service after
--heartbeat-timeout seconds without a heartbeat from a peer.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import traceback
from collections.abc import Sequence

import jax

from rljax.run.artifacts import PASS_THRESHOLD, evaluate_source, export_hf, sample_texts
from rljax.run.compile_cache import use_compile_cache
from rljax.run.experiment_files import load_experiment
from rljax.run.plots import plot_metrics
from rljax.run.preemption import Preempted
from rljax.run.run_dir import config_hash, config_to_dict, read_metrics
from rljax.run.runner import run_experiment

__all__ = ["HEARTBEAT_TIMEOUT_S", "build_parser", "main"]

# Seconds without heartbeats after which JAX's coordination service declares a process dead
# and ends the others (JAX's default, 100 s, is longer than a preemption notice lasts).
HEARTBEAT_TIMEOUT_S = 30
# Configuration and input errors: one line and status 2 (module docstring).
_INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=1e-5 --set run.dir=runs/x")


def _add_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host TPU pod slices: "
                        "run the same command on every host; TPU VMs find their peers)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="with --distributed: process 0's address (elsewhere than TPU VMs)")
    p.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="with --distributed --coordinator: how many processes take part")
    p.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="with --distributed --coordinator: this process's index, 0..N-1")
    p.add_argument("--heartbeat-timeout", type=int, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                   help="with --distributed: seconds without a peer's heartbeat before JAX "
                        f"ends every process (default {HEARTBEAT_TIMEOUT_S})")


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="which seed of a several-seed run (run.seeds > 1: one stacked "
                        "checkpoint) to use; default the run's first seed, run.seed")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the `rljax` command."""
    parser = argparse.ArgumentParser(prog="rljax", description="RL post-training of LMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run an experiment (rljax.run.runner.run_experiment)")
    p.add_argument("experiment", help="experiment name under experiments/ or a .py path")
    _add_set(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config as JSON and exit")
    p.add_argument("--profile-steps", default=None, metavar="STEPS",
                   help="write JAX profiler traces of these RL steps (as numbered in "
                        "metrics.jsonl, from 1) into RUN_DIR/profile/, e.g. 3,5 or 3-5 "
                        "(same as --set run.profile_steps=STEPS)")
    _add_launch(p)

    p = sub.add_parser("eval", help="greedy accuracy (a reward without a verifier: its mean) "
                                    "and pass@k (rljax.run.artifacts.evaluate_source)")
    p.add_argument("source", help="run directory or HF model folder")
    p.add_argument("--experiment", default=None,
                   help="experiment giving the task and reward (default: the run's own config)")
    _add_set(p)
    p.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default rl.eval_prompts)")
    p.add_argument("--k", type=int, default=1, help="samples per prompt for pass@k (default 1)")
    p.add_argument("--pass-threshold", type=float, default=None, metavar="R",
                   help="a reward without a verifier: a sampled completion passes pass@k when "
                        f"its reward is >= R (default {PASS_THRESHOLD}); a verifier decides "
                        "otherwise")
    _add_checkpoint(p)

    p = sub.add_parser(
        "sample", help="generate completions (rljax.run.artifacts.sample_texts)",
        description="Generate completions. From a run directory each prompt is wrapped as the "
                    "run's training prompts were: the tokenizer's chat template when the run "
                    "set task.chat_template, its task.system_prompt and "
                    "task.assistant_prefix (--raw: the prompt as given). A model folder's "
                    "prompts are used as given.")
    p.add_argument("source", help="run directory or HF model folder")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the run's sampling.max_new_tokens (64 for a model folder)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the run's sampling.temperature (1.0 for a model "
                        "folder); a run's top-k / top-p apply too")
    p.add_argument("--raw", action="store_true",
                   help="use each prompt as given (no chat template, system prompt or "
                        "assistant prefix from the run)")
    p.add_argument("--sampling-seed", type=int, default=0, metavar="N",
                   help="PRNG seed of the sampling (default 0)")
    _add_checkpoint(p)

    p = sub.add_parser("export", help="write a HF model folder (rljax.run.artifacts.export_hf)")
    p.add_argument("source", help="run directory (latest checkpoint) or HF model folder")
    p.add_argument("out_dir", help="output folder (must not exist or be empty; local or gs://)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the written weights (default float32)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="split the weights into files of at most SIZE (bytes, or with KB / "
                        "MB / GB as in transformers: 5GB = 5e9 bytes), with "
                        "model.safetensors.index.json (default: one file)")
    p.add_argument("--adapters", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT folder (adapter_config.json "
                        "+ adapter_model.safetensors) instead of the merged weights")
    _add_checkpoint(p)
    _add_launch(p)

    p = sub.add_parser("plot", help="PNG plots of a run's metrics (rljax.run.plots.plot_metrics)")
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="a several-seed run: draw only seed S (default: one curve per seed)")
    return parser


def _launch_args(args) -> dict | None:
    """The keyword arguments of `jax.distributed.initialize` from the launch flags, or
    None without --distributed; a bad combination is a ValueError naming the flags."""
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    named = [k for k, v in given.items() if v is not None]
    if not args.distributed:
        if named:
            raise ValueError(f"{', '.join(named)}: only with --distributed (a multi-process "
                             "run)")
        return None
    if args.heartbeat_timeout < 1:
        raise ValueError(f"--heartbeat-timeout must be >= 1 second, got {args.heartbeat_timeout}")
    beat = {"heartbeat_timeout_seconds": args.heartbeat_timeout}
    if not named:
        return beat  # TPU VMs (and other auto-detected clusters) find their peers themselves
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"--distributed with {', '.join(named)} also needs "
                         f"{', '.join(missing)} (give --coordinator HOST:PORT "
                         "--num-processes N --process-id I together, or none of them)")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in 0..{args.num_processes - 1} "
                         f"(--num-processes {args.num_processes}), got {args.process_id}")
    return {"coordinator_address": args.coordinator, "num_processes": args.num_processes,
            "process_id": args.process_id, **beat}


def _exit_failed_process(command: str, err: Exception) -> None:
    """In a multi-process run: say why this process fails, then leave at once, so that
    the peers' collectives fail too instead of waiting for this process (and so that JAX's
    shutdown barrier does not wait for peers that may be dead). Status 2 for bad input."""
    n, i = jax.process_count(), jax.process_index()
    code = 2 if isinstance(err, _INPUT_ERRORS) else 1
    if code == 1:
        print(traceback.format_exc(limit=-4), file=sys.stderr)
    print(f"rljax {command}: error: process {i} of {n} failed: {err}\n"
          f"rljax {command}: with several processes a failed collective usually means "
          "another process died or was killed (its log says why); exiting now.",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _distributed(args) -> bool:
    """Parse the launch flags and, when asked, call `jax.distributed.initialize` before
    anything starts a JAX backend, with gloo collectives when the devices are CPUs (devices
    per process come from XLA_FLAGS); True if so."""
    launch = _launch_args(args)
    if launch is None or getattr(args, "dry_run", False):
        return False
    if "cpu" in (jax.config.jax_platforms or "cpu").split(","):  # unset: may fall back to CPU
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**launch)
    return True


def _cmd_train(args) -> int:
    distributed = _distributed(args)
    overrides = list(args.overrides)
    if args.profile_steps is not None:
        overrides.append(f"run.profile_steps={args.profile_steps}")
    cfg = load_experiment(args.experiment, overrides)
    if args.dry_run:
        cfg = cfg.resolved()  # the algorithm preset's values, as the run will use and save
        print(json.dumps({"config_hash": config_hash(cfg), "config": config_to_dict(cfg)}, indent=2))
        return 0
    try:
        run_experiment(cfg)
    except Preempted as e:
        print(f"rljax train: {e}", file=sys.stderr, flush=True)
        return 0
    except Exception as e:
        if distributed and jax.process_count() > 1:
            _exit_failed_process("train", e)
        raise
    return 0


def _cmd_eval(args) -> int:
    use_compile_cache()
    result = evaluate_source(args.source, experiment=args.experiment, overrides=args.overrides,
                             num_prompts=args.num_prompts, k=args.k, step=args.step,
                             run_seed=args.seed, pass_threshold=args.pass_threshold)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_sample(args) -> int:
    use_compile_cache()
    outs = sample_texts(args.source, args.prompt, num_samples=args.num_samples,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.sampling_seed, step=args.step, run_seed=args.seed,
                        raw=args.raw)
    for prompt, completions in zip(args.prompt, outs):
        for i, text in enumerate(completions):
            print(f"=== prompt: {prompt!r} sample {i}\n{text}")
    return 0


_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1, "": 1}


def _parse_size(text: str | None) -> int | None:
    """"5GB" -> 5_000_000_000 (transformers' convention); None stays None."""
    if text is None:
        return None
    t = text.strip().upper()
    unit = next(u for u in _SIZE_UNITS if t.endswith(u))  # "" matches last
    number = t[:len(t) - len(unit)] if unit else t
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"--max-shard-size must be a positive size such as 20000, 500MB or "
                         f"5GB, got {text!r}")
    return size


def _cmd_export(args) -> int:
    shard = _parse_size(args.max_shard_size)
    distributed = _distributed(args)
    try:
        out = export_hf(args.source, args.out_dir, step=args.step, dtype=args.dtype,
                        max_shard_bytes=shard, run_seed=args.seed, adapters=args.adapters)
    except Exception as e:
        if distributed and jax.process_count() > 1:
            _exit_failed_process("export", e)
        raise
    if jax.process_index() == 0:
        print(f"exported to {out}")
    return 0


def _cmd_plot(args) -> int:
    records = read_metrics(args.run_dir)
    if args.seed is not None:
        seeds = sorted({r["seed"] for r in records if "seed" in r})
        if args.seed not in seeds:
            raise ValueError(f"--seed {args.seed}: the metrics of {args.run_dir} hold seeds "
                             f"{seeds or 'none (a one-seed run)'}")
        records = [r for r in records if r.get("seed") == args.seed]
    paths = plot_metrics(records, pathlib.Path(args.run_dir) / "plots")
    if not paths:
        print(f"no plottable metrics in {args.run_dir}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


_COMMANDS = {"train": _cmd_train, "eval": _cmd_eval, "sample": _cmd_sample,
             "export": _cmd_export, "plot": _cmd_plot}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `rljax` command with `argv` (default `sys.argv[1:]`); returns the exit status
    (the module docstring says which)."""
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except _INPUT_ERRORS as e:
        print(f"rljax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rljax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a runtime failure: the traceback says where
        traceback.print_exc()
        print(f"rljax {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
