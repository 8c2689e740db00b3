"""Every command in the README and docs/*.md runs as written (shrunk).

Each fenced shell block (```bash / sh / shell / console) of README.md and of every
docs/*.md that calls `rljax` is one test: its lines run in order, and any non-zero exit
fails the test. The blocks of one file run in order in one temporary directory (a guide's
later steps use the files its earlier steps wrote). `rljax ...` lines (with optional
`NAME=value` prefixes, and an optional `> FILE` for the output) run in this process
through `rljax.cli.main`, shrunk: `rljax
train` gets `--set smoke=true` and caps on its steps and held-out prompts appended
(`SHRINK`; the last `--set` wins); other lines (files written with heredocs, `python`,
`cd`...) run with bash. A block that cannot run here (it needs a TPU pod, a download,
several hosts) carries the marker

    <!-- doc-test: skip <reason> -->

on the line right above its opening fence; the test is then reported as skipped with that
reason, never left out silently.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from rljax.cli import main
from rljax.run.experiment_files import load_experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHELLS = ("bash", "sh", "shell", "console")
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# `rljax train` caps: (field, largest value kept, only when the config has the section).
SHRINK = (("rl.steps", 2, "rl"), ("rl.eval_prompts", 8, "rl"), ("sft.steps", 2, "sft"))


def doc_files() -> list[pathlib.Path]:
    """README.md and every docs/*.md (new docs are picked up without a change here)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """`(line, body, skip reason or None)` of each fenced shell block of `text`."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if lang in SHELLS:
            skip = SKIP.search(lines[start - 1]) if start else None
            out.append((start + 1, "\n".join(lines[start + 1:i]),
                        (skip.group(1) or "marked") if skip else None))
        i += 1
    return out


def _rljax_argv(command: str) -> tuple[dict, list[str], str | None] | None:
    """`(env assignments, argv after "rljax", file its stdout goes to or None)` when
    `command` calls rljax, else None."""
    words = shlex.split(command, comments=True)
    env, target = {}, None
    while words and ASSIGN.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if len(words) > 2 and words[-2] == ">":
        words, target = words[:-2], words[-1]
    if words[:1] == ["rljax"]:
        return env, words[1:], target
    if words[:3] in (["python", "-m", "rljax"], ["python3", "-m", "rljax"]):
        return env, words[3:], target
    return None


def steps(body: str) -> list[tuple[str, object]]:
    """The block as `("rljax", (env, argv))` and `("shell", script)` steps, in order
    (backslash continuations joined; a heredoc's lines stay with its command)."""
    out: list[tuple[str, object]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        here = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if here:
            end = i + 1
            while end < len(lines) and lines[end].strip() != here.group(1):
                end += 1
            line = "\n".join([line, *lines[i + 1:end + 1]])
            i = end
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        call = None if here else _rljax_argv(line)
        if call is not None:
            out.append(("rljax", call))
        elif out and out[-1][0] == "shell":
            out[-1] = ("shell", out[-1][1] + "\n" + line)
        else:
            out.append(("shell", line))
    return out


def calls_rljax(body: str) -> bool:
    return any(kind == "rljax" for kind, _ in steps(body))


def shrink(argv: list[str]) -> list[str]:
    """`rljax train EXP ...` with `smoke=true` and the `SHRINK` caps: a field the command
    sets gets the smaller of its value and the cap (an override may appear only once), the
    others are appended."""
    if argv[:1] != ["train"] or "--dry-run" in argv:
        return argv
    argv = list(argv)
    sets = {argv[i + 1].partition("=")[0]: i + 1 for i, a in enumerate(argv[:-1])
            if a == "--set"}
    cfg = load_experiment(argv[1], [argv[i] for i in sets.values()]
                          + ([] if "smoke" in sets else ["smoke=true"]))
    if "smoke" not in sets:
        argv += ["--set", "smoke=true"]
    for field, cap, section in SHRINK:
        sec = getattr(cfg, section)
        if sec is None:
            continue
        value = f"{field}={min(getattr(sec, field.split('.')[1]), cap)}"
        if field in sets:
            argv[sets[field]] = value
        else:
            argv += ["--set", value]
    return argv


def _run_rljax(env: dict, argv: list[str], target: str | None) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            rc = main(shrink(argv))
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
    if target is not None:
        pathlib.Path(target).write_text(out.getvalue())
    return rc, out.getvalue() + err.getvalue()


def _run_shell(script: str, cwd: pathlib.Path) -> tuple[int, str]:
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _cases():
    """Every shell block of each doc file that calls `rljax` somewhere (the other blocks
    set up what those calls read: files written with heredocs)."""
    for path in doc_files():
        blocks = shell_blocks(path.read_text())
        if any(calls_rljax(body) for _, body, _ in blocks):
            for line, body, skip in blocks:
                marks = [pytest.mark.skip(reason=f"doc-test: skip {skip}")] if skip else []
                yield pytest.param(path.name, body, id=f"{path.relative_to(ROOT)}:{line}",
                                   marks=marks)


@pytest.fixture(scope="module")
def doc_dirs(tmp_path_factory):
    """One working directory per doc file, shared by its blocks (run in file order)."""
    dirs = {}

    def get(name: str) -> pathlib.Path:
        if name not in dirs:
            dirs[name] = tmp_path_factory.mktemp(name.replace(".", "_"))
        return dirs[name]
    return get


@pytest.mark.parametrize("doc, body", list(_cases()))
def test_doc_block_runs(doc, body, doc_dirs, monkeypatch):
    tmp_path = doc_dirs(doc)
    monkeypatch.chdir(tmp_path)
    for kind, what in steps(body):
        if kind == "rljax":
            rc, log = _run_rljax(*what)
            shown = "rljax " + shlex.join(what[1])
        else:
            rc, log = _run_shell(what, tmp_path)
            shown = what
        assert rc == 0, f"`{shown}` exited with {rc}:\n{log[-4000:]}"


def test_parser_finds_commands_markers_and_heredocs():
    text = "\n".join([
        "```bash", "rljax train x --set a.b=1 \\", "    --set c=2   # why", "```",
        "<!-- doc-test: skip needs a TPU pod -->", "```bash", "rljax train big", "```",
        "```python", "rljax = 1", "```",
        "```bash", "cat > r.py <<'EOF'", "rljax is not run here", "EOF",
        "PYTHONPATH=. rljax eval runs/x --k 2", "echo done", "```"])
    blocks = shell_blocks(text)
    assert [(line, skip) for line, _, skip in blocks] == [(1, None), (6, "needs a TPU pod"),
                                                          (12, None)]
    assert steps(blocks[0][1]) == [("rljax", ({}, ["train", "x", "--set", "a.b=1", "--set",
                                                   "c=2"], None))]
    kinds = steps(blocks[2][1])
    assert [k for k, _ in kinds] == ["shell", "rljax", "shell"]
    assert kinds[0][1].endswith("EOF") and kinds[1][1] == ({"PYTHONPATH": "."},
                                                           ["eval", "runs/x", "--k", "2"], None)
    assert steps("rljax train x --dry-run > r.json") == [
        ("rljax", ({}, ["train", "x", "--dry-run"], "r.json"))]
    assert not calls_rljax("bash scripts/demo.sh   # installs rljax")
    assert shrink(["train", "arithmetic_grpo", "--set", "rl.steps=100"]) == [
        "train", "arithmetic_grpo", "--set", "rl.steps=2", "--set", "smoke=true", "--set",
        "rl.eval_prompts=8", "--set", "sft.steps=2"]


def test_reference_lists_every_config_field():
    """docs/reference.md has a row for every field of every config section (a new field
    fails here until it is documented)."""
    import dataclasses
    import typing

    from rljax.run.experiment import ExperimentConfig

    text = (ROOT / "docs" / "reference.md").read_text()
    missing, sections = [], 0
    for name, hint in typing.get_type_hints(ExperimentConfig).items():
        cls = next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)),
                   None)
        sections += cls is not None
        rows = [f"{name}.{g.name}" for g in dataclasses.fields(cls)] if cls else [name]
        missing += [r for r in rows if f"| `{r}` |" not in text]
    assert sections >= 9 and not missing, f"docs/reference.md lacks rows for {missing}"
