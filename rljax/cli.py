"""The `rljax` command line (also `python -m rljax`).

    rljax train EXPERIMENT [--set a.b=value ...] [--dry-run]
                [--distributed [--coordinator HOST:PORT --num-processes N --process-id I]]
    rljax eval SOURCE [--experiment EXP] [--set ...] [--num-prompts N] [--k K]
    rljax sample SOURCE --prompt TEXT [--prompt ...] [--num-samples N] [--max-new-tokens N]
    rljax export SOURCE OUT_DIR [--step N]
    rljax plot RUN_DIR

EXPERIMENT is a file under `experiments/` (by name) or a path to one. SOURCE is a run
directory (its latest checkpoint) or a Hugging Face model folder. Each command is a thin
layer over one Python call (named in its help), so everything here is also a library call.
Bad input (missing experiment, unknown or mistyped override, a run directory that holds
another run) prints one clear error line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

import jax

from rljax.run.artifacts import evaluate_source, export_hf, sample_texts
from rljax.run.experiment import load_experiment
from rljax.run.plots import plot_metrics
from rljax.run.run_dir import config_hash, config_to_dict, read_metrics
from rljax.run.runner import run_experiment

__all__ = ["build_parser", "main"]


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=1e-5 --set run.dir=runs/x")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the `rljax` command."""
    parser = argparse.ArgumentParser(prog="rljax", description="RL post-training of LMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run an experiment (rljax.run.runner.run_experiment)")
    p.add_argument("experiment", help="experiment name under experiments/ or a .py path")
    _add_set(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config as JSON and exit")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host TPU pod slices: "
                        "run the same command on every host; TPU VMs find their peers)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="with --distributed: process 0's address (elsewhere than TPU VMs)")
    p.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="with --distributed --coordinator: how many processes take part")
    p.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="with --distributed --coordinator: this process's index, 0..N-1")

    p = sub.add_parser("eval", help="greedy accuracy and pass@k (rljax.run.artifacts.evaluate_source)")
    p.add_argument("source", help="run directory or HF model folder")
    p.add_argument("--experiment", default=None,
                   help="experiment giving the task and reward (default: the run's own config)")
    _add_set(p)
    p.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default rl.eval_prompts)")
    p.add_argument("--k", type=int, default=1, help="samples per prompt for pass@k (default 1)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")

    p = sub.add_parser("sample", help="generate completions (rljax.run.artifacts.sample_texts)")
    p.add_argument("source", help="run directory or HF model folder")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the run's sampling.max_new_tokens (64 for a model folder)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the run's sampling.temperature (1.0 for a model "
                        "folder); a run's top-k / top-p apply too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")

    p = sub.add_parser("export", help="write a HF model folder (rljax.run.artifacts.export_hf)")
    p.add_argument("source", help="run directory (latest checkpoint) or HF model folder")
    p.add_argument("out_dir", help="output folder (must not exist or be empty)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")

    p = sub.add_parser("plot", help="PNG plots of a run's metrics (rljax.run.plots.plot_metrics)")
    p.add_argument("run_dir")
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
    if not named:
        return {}  # TPU VMs (and other auto-detected clusters) find their peers themselves
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
            "process_id": args.process_id}


def _init_distributed(kwargs: dict) -> None:
    """`jax.distributed.initialize`, with gloo collectives when the devices are CPUs
    (set before the backend starts; devices per process come from XLA_FLAGS)."""
    platforms = (jax.config.jax_platforms or "cpu").split(",")  # unset: may fall back to CPU
    if "cpu" in platforms:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


def _cmd_train(args) -> int:
    launch = _launch_args(args)
    if launch is not None and not args.dry_run:
        _init_distributed(launch)  # before anything starts a JAX backend
    cfg = load_experiment(args.experiment, args.overrides)
    if args.dry_run:
        cfg = cfg.resolved()  # the algorithm preset's values, as the run will use and save
        print(json.dumps({"config_hash": config_hash(cfg), "config": config_to_dict(cfg)}, indent=2))
        return 0
    run_experiment(cfg)
    return 0


def _cmd_eval(args) -> int:
    result = evaluate_source(args.source, experiment=args.experiment, overrides=args.overrides,
                             num_prompts=args.num_prompts, k=args.k, step=args.step)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_sample(args) -> int:
    outs = sample_texts(args.source, args.prompt, num_samples=args.num_samples,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.seed, step=args.step)
    for prompt, completions in zip(args.prompt, outs):
        for i, text in enumerate(completions):
            print(f"=== prompt: {prompt!r} sample {i}\n{text}")
    return 0


def _cmd_export(args) -> int:
    out = export_hf(args.source, args.out_dir, step=args.step)
    print(f"exported to {out}")
    return 0


def _cmd_plot(args) -> int:
    paths = plot_metrics(read_metrics(args.run_dir), pathlib.Path(args.run_dir) / "plots")
    if not paths:
        print(f"no plottable metrics in {args.run_dir}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


_COMMANDS = {"train": _cmd_train, "eval": _cmd_eval, "sample": _cmd_sample,
             "export": _cmd_export, "plot": _cmd_plot}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `rljax` command with `argv` (default `sys.argv[1:]`); returns the exit status.

    Configuration and input errors (ValueError, TypeError, FileNotFoundError) are printed as
    `rljax <command>: error: ...` and give status 2; other exceptions propagate.
    """
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        print(f"rljax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rljax {args.command}: interrupted", file=sys.stderr)
        return 130
