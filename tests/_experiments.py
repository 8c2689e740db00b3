"""Import ``experiments/<name>.py`` by path in tests (experiments/ is not a package)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_experiment(name):
    """The module ``experiments/<name>.py``, imported once per test session."""
    mod_name = f"_rljax_experiment_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module
