"""docs/environments.md's python blocks run as written (its two `rljax train` files run in
tests/test_cli_multiturn.py): the guide is a reference a user copies from."""

import os
import pathlib
import subprocess
import sys

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def _run_block(tmp_path, code: str, name: str) -> str:
    """A guide block run as a script (no JAX devices set up); its stdout."""
    (tmp_path / name).write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, str(tmp_path / name)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_guides_example_runs_and_imports_no_jax(tmp_path):
    example = GUIDE.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    stdout = _run_block(tmp_path, example + "import sys\nprint('jax' in sys.modules)\n",
                        "example.py")
    *_, result, jax_loaded = stdout.strip().splitlines()
    assert result == "True [1. 0.] 1", stdout
    assert jax_loaded == "False", "rljax.envs (or its example) imported jax"


def test_the_guides_other_blocks_run_as_written(tmp_path):
    """Every python block of the guide runs as written: the loop above, the two files of
    its `rljax train` section in tests/test_cli_multiturn.py, the others here."""
    blocks = [b.split("```", 1)[0] for b in GUIDE.read_text().split("```python\n")[2:]]
    rest = [b for b in blocks if not b.startswith(("# my_env.py\n", "# my_experiment.py\n"))]
    assert len(blocks) - len(rest) == 2 and len(rest) == 2
    assert _run_block(tmp_path, rest[0], "protocol.py").split() == ["True"]
    assert _run_block(tmp_path, rest[1], "tool.py").split() == ["7006652", "calculator"]
