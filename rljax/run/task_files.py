"""A file task's data: which file each split reads, its records, the length filter.

`split_file` decides where a split comes from (a folder's `<split>.jsonl`, a file path,
or a single-file `task.path`, which has no held-out split unless `task.eval_split` says
where evaluation prompts come from); `filtered_split` reads it with every record field
kept and drops prompts over `task.max_prompt_tokens`, counting them per split;
`require_answers` names a record without the answer the reward checks.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

from rljax.data import (LengthPolicy, TfdsPromptSource, filter_by_length, gsm8k_transform,
                        load_prompts)
from rljax.data.files import PROMPT_SUFFIXES
from rljax.run.experiment import ExperimentConfig

__all__ = ["check_data_files", "filtered_split", "needs_answer", "read_split",
           "require_answers", "split_file"]


def needs_answer(cfg: ExperimentConfig) -> bool:
    """Whether the reward checks a reference answer (then every record must have one)."""
    return cfg.reward.kind in ("accuracy", "accuracy+format") or cfg.task.name == "gsm8k"


def split_file(cfg: ExperimentConfig, role: str) -> pathlib.Path:
    """The file of `task.<role>` ("split" or "eval_split") of a file task: a file path as
    given; `<split>.jsonl` / `.parquet` in a folder `path`; `path` itself when `path` is
    one file (for "eval_split" only if it equals `split`: evaluating on the training
    prompts is said explicitly, never assumed). ValueError / FileNotFoundError naming the
    setting otherwise."""
    t = cfg.task
    split = getattr(t, role)
    if split.endswith(PROMPT_SUFFIXES):
        given = pathlib.Path(split)
        if given.is_file() or not (t.path and pathlib.Path(t.path).is_dir()):
            return given
        return pathlib.Path(t.path) / split
    path = pathlib.Path(t.path)
    if not path.exists():
        raise FileNotFoundError(f"task.path={t.path!r} does not exist (a JSONL / Parquet "
                                "file, or a folder of <split>.jsonl files)")
    if path.is_dir():
        file = path / f"{split}{'.parquet' if t.name == 'parquet' else '.jsonl'}"
        if not file.is_file():
            there = sorted(p.name for p in path.iterdir())[:20]
            raise FileNotFoundError(f"task.{role}={split!r}: no file {file} (the folder "
                                    f"{path} holds {there}); set task.{role} to one of its "
                                    "splits or to a file path")
        return file
    if role == "split" or split == t.split:
        return path
    raise ValueError(
        f"task.path={t.path!r} is one file, so task.eval_split={split!r} names no split of "
        f"it: set task.eval_split to a file of held-out prompts (e.g. "
        f"task.eval_split=data/test.jsonl), or to task.split ({t.split!r}) to evaluate on "
        "the training prompts")


def read_split(cfg: ExperimentConfig, split: str, role: str = "split") -> Sequence[dict]:
    """The records of `task.<role>` (named `split`): a TFDS split, or a file's records
    with every field, the mapped `prompt` and, where present, `answer`."""
    t = cfg.task
    mapping = {"prompt": t.prompt_field}
    if t.answer_field is not None:  # None: the records have no reference answer
        mapping["answer"] = t.answer_field
    if t.name == "tfds":
        src = TfdsPromptSource(split=split, name=t.dataset, data_dir=t.path, mapping=mapping)
        # GSM8K keeps "#### answer" at the end of its solution field, on TFDS too.
        return [gsm8k_transform(r) for r in src] if t.dataset == "gsm8k" else src
    transform = gsm8k_transform if t.name == "gsm8k" else None
    # The answer is read when present; `require_answers` names a missing one if the
    # reward checks it (GSM8K's transform splits it, so it must be there).
    return load_prompts(split_file(cfg, role), mapping, transform=transform,
                        optional=() if t.name == "gsm8k" else ("answer",))


def filtered_split(cfg: ExperimentConfig, length_fn: Callable[[dict], int], role: str,
                   done: dict) -> list[dict]:
    """The records of `task.<role>` whose prompt's `length_fn` is within
    `task.max_prompt_tokens`, read and filtered once per file (`done` remembers them, and
    under "_splits" what the filter did per split: `TaskData.splits`)."""
    t = cfg.task
    name = getattr(t, role)
    file = str(split_file(cfg, role)) if t.name != "tfds" else f"tfds:{t.dataset}/{name}"
    if file not in done:
        kept, rep = filter_by_length(
            [dict(r) for r in read_split(cfg, name, role)],
            LengthPolicy(t.max_prompt_tokens, action="drop"), length_fn=length_fn,
            name=f"split {name!r}")
        if not kept:
            raise ValueError(f"split {name!r}: every prompt is longer than "
                             f"task.max_prompt_tokens={t.max_prompt_tokens} ({rep})")
        done[file] = kept
        done.setdefault("_splits", {})[name] = dict(
            file=file, records=rep.total, kept=rep.kept, dropped=len(rep.dropped),
            longest=rep.max_length, limit=rep.limit)
    return done[file]


def require_answers(cfg: ExperimentConfig, records: Sequence[dict]) -> None:
    """ValueError naming the first record without an answer, if the reward checks one."""
    if not needs_answer(cfg):
        return
    for r in records:
        if "answer" not in r:
            raise ValueError(
                f"{r.get('source', 'a record')}: no field {cfg.task.answer_field!r} "
                f"(task.answer_field), the reference answer reward.kind={cfg.reward.kind!r} "
                f"checks completions against; fields present: "
                f"{sorted(k for k in r if k != 'source')}. Set task.answer_field, or use a "
                "reward that needs no answer (reward.function)")


def check_data_files(cfg: ExperimentConfig) -> None:
    """A file task's split files exist (errors name the setting); nothing is read."""
    if cfg.task.name in ("jsonl", "parquet", "gsm8k"):
        for role in ("split", "eval_split"):
            split_file(cfg, role)
