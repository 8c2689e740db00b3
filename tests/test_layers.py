"""The layering contracts of pyproject.toml (run by `lint-imports` in scripts/test.sh) catch
an upward import: checked on a temporary copy of the package, with one import added. And
importing the package loads neither torch nor matplotlib (start-up time of every process).
No module reaches into another's private names."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = pathlib.Path(sys.executable).with_name("lint-imports")


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """The package and its pyproject.toml (the contracts) under `tmp_path`."""
    shutil.copytree(ROOT / "rljax", tmp_path / "rljax",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first, so the copy is the rljax that is analysed, not the installed one.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _add_import(root: pathlib.Path, module: str, line: str) -> None:
    path = root / module
    path.write_text(path.read_text() + f"\n{line}\n")


@pytest.fixture(scope="module")
def lint_available():
    if not LINT.exists():
        pytest.fail(f"{LINT} not found: pip install -e '.[test]' (import-linter)")


def test_unmodified_copy_keeps_every_contract(tmp_path, lint_available):
    res = _lint(_copy(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize("module, line, contract, edge, broken", [
    # The example: the lowest layer reaching up to the trainer. rljax.train's own
    # lowest modules import objectives, so it also closes cycles inside rljax.train: the
    # train-interior contract breaks too.
    ("rljax/objectives/kl.py", "import rljax.train  # noqa", "Layers of docs/design.md",
     "rljax.objectives.kl -> rljax.train", 2),
    # A leaf importing the other leaf: rewards and data are independent.
    ("rljax/data/arithmetic.py", "from rljax.rewards import math_equal  # noqa",
     "Leaves: rewards and data never import each other",
     "rljax.data.arithmetic -> rljax.rewards", 1),
    # A leaf importing a layer below train that is still not objectives.
    ("rljax/rewards/answers.py", "import rljax.sharding  # noqa",
     "Leaves: rewards and data import only rljax.objectives",
     "rljax.rewards.answers -> rljax.sharding", 1),
    # Environments are host side: no device code, though sampling is below them.
    ("rljax/envs/tools.py", "import rljax.sampling  # noqa", "Environments are host side",
     "rljax.envs.tools -> rljax.sampling", 1),
    # Inside rljax.train: the learning program importing a rollout source (the cycle
    # learn -> rollout -> programs -> learn that the train-interior contract rules out).
    ("rljax/train/learn/micro.py", "import rljax.train.sources  # noqa",
     "Inside rljax.train", "rljax.train.learn.micro -> rljax.train.sources", 1),
])
def test_added_import_breaks_the_named_contract(tmp_path, lint_available, module, line,
                                                contract, edge, broken):
    root = _copy(tmp_path)
    _add_import(root, module, line)
    res = _lint(root)
    assert res.returncode != 0, res.stdout
    assert contract in res.stdout.split("Broken contracts")[-1], res.stdout
    assert f"{broken} broken" in res.stdout, res.stdout
    assert edge in res.stdout, res.stdout


# What `import rljax` pulls in: each process (the CLI, every process of a multi-process run)
# pays for it. torch (transformers' AutoTokenizer and tensorboardX import it when it is
# installed, ~1.2 s) and matplotlib load where they are used; a run's TensorBoard lines
# load tensorboardX without torch (rljax.run.run_writers).
_HEAVY = ("torch", "matplotlib", "tensorboardX")
_PROBE = ("import sys\n"
          "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules} & set(%r))\n"
          "import rljax.models, rljax.train, rljax.run.runner, rljax.run.seed_runs, rljax.cli\n"
          "print(heavy())\n"
          "import tempfile; from etils import epath\n"
          "from rljax.run.run_writers import TensorBoardRuns\n"
          "TensorBoardRuns(epath.Path(tempfile.mkdtemp())).log({'rl/loss': 1.0}, 1, None)\n"
          "print(heavy())\n"
          "from transformers import AutoTokenizer  # the control: the probe sees torch\n"
          "print(heavy())\n") % (_HEAVY,)


def test_importing_rljax_and_logging_load_no_torch_or_plotting():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    after_rljax, after_logging, after_control = out.stdout.strip().splitlines()[-3:]
    assert after_rljax == "[]", after_rljax
    assert after_logging == "['tensorboardX']", after_logging
    assert "torch" in after_control, after_control  # torch is installed: the check is live


def test_a_reward_worker_unpickling_a_task_verifier_imports_no_jax():
    """What a reward worker process unpickles for a run's accuracy (the `Verifier` that
    `build_reward` makes, around e.g. `check_arithmetic`) loads no JAX: each worker's
    start-up is that import (2-3 s with JAX, 0.3 s without), paid again by every run that
    starts a pool and by every worker a time limit replaces."""
    import base64
    import pickle

    from rljax.run.builders import build_reward
    from rljax.run.experiment_files import load_experiment
    from rljax.rewards.device import DeviceReward

    _, verifier = build_reward(load_experiment("arithmetic_grpo", ["smoke=true"]))
    probe = ("import base64, pickle, sys\n"
             "for data in sys.argv[1:]:\n"
             "    pickle.loads(base64.b64decode(data))\n"
             "    print('jax' in sys.modules)\n")
    # the control, unpickled second: the device rewards' class loads JAX
    args = [base64.b64encode(pickle.dumps(x)).decode()
            for x in (verifier, DeviceReward)]
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout


def private_uses(source: str) -> list[str]:
    """Where `source` reaches into another rljax module's private names: `from rljax.x
    import _name`, `mod._name` on an imported rljax module, and `obj.attr._name` (another
    object's private attribute). JAX's `_cache_size` (jitted functions count their
    executables only there) is allowed."""
    import ast

    tree, modules, found = ast.parse(source), set(), []
    private = lambda n: n.startswith("_") and not n.startswith("__") and n != "_cache_size"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rljax"):
            found += [f"{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if private(a.name)]
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name.startswith("rljax"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            v = node.value
            if isinstance(v, ast.Attribute) or (isinstance(v, ast.Name) and v.id in modules):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_uses_another_modules_private_names():
    """Issue 41: what one module needs of another is public (documented) in it."""
    root = pathlib.Path(__file__).resolve().parents[1] / "rljax"
    found = {str(p.relative_to(root)): hits for p in sorted(root.rglob("*.py"))
             if (hits := private_uses(p.read_text()))}
    assert not found, found
    # Controls: each form is caught.
    assert private_uses("from rljax.train.rl import _Phase") == [
        "1: from rljax.train.rl import _Phase"]
    assert private_uses("from rljax.train import rl\nrl._Phase()") == ["2: rl._Phase"]
    assert private_uses("self.tr._learn_program()") == ["1: self.tr._learn_program"]
    assert private_uses("self._own()\nf._cache_size()") == []
