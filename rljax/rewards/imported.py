"""A user's function named by import path (`"pkg.mod:fn"`), as Python's `-m` finds it.

`load_function` imports it the way `python -m` would: the current directory is searched
first, so `./my_reward.py` is `"my_reward:score"` with no `PYTHONPATH`. A module that is
not found, one that fails while importing (its traceback shown) and a name the module
lacks are errors that say which. `ImportedFunction` is the same function as a small
picklable value (path, directory searched, the module's file): a reward worker process
(`rljax.rewards.RewardPool`) imports it again from those, including modules registered
under a name no search finds (an experiment file, `rljax_experiment_<stem>`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import traceback
from typing import Any, Callable

__all__ = ["ImportedFunction", "load_function"]

_LOADED: dict[tuple, Callable] = {}  # ImportedFunction -> the function, per process


def _user_traceback(e: BaseException) -> str:
    """The traceback of `e` without the import machinery's frames."""
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    return "".join(ln for ln in lines if "<frozen importlib" not in ln)


def _same_file(module, file: str | None) -> bool:
    where = getattr(module, "__file__", None)
    return file is None or (where is not None
                            and os.path.realpath(where) == os.path.realpath(file))


def _module(name: str, search_dir: str | None, file: str | None):
    if file is None and search_dir is not None and "." not in name:
        found = importlib.machinery.PathFinder.find_spec(name, [search_dir])
        file = found.origin if found is not None else None  # the file `python -m` finds
    cached = sys.modules.get(name)
    if cached is not None and _same_file(cached, file):
        return cached
    if cached is not None:  # a module of that name from elsewhere (a long-lived reward
        del sys.modules[name]  # worker serving another run): import this one
        if search_dir is not None and search_dir in sys.path:
            sys.path.remove(search_dir)  # put it first again below
    if search_dir is not None and search_dir not in sys.path:
        sys.path.insert(0, search_dir)  # what `python -m` does with the current directory
    try:
        module = importlib.import_module(name)
        if _same_file(module, file):
            return module
        del sys.modules[name]  # the search found another file of that name: load `file`
    except ModuleNotFoundError as e:
        if file is None or e.name != name.split(".")[0] and e.name != name:
            raise
    spec = importlib.util.spec_from_file_location(name, file)  # e.g. an experiment file
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_function(path: str, field: str = "function", *, search_dir: str | None = None,
                  file: str | None = None) -> Callable:
    """The callable at `path` ("pkg.mod:name"), imported with `search_dir` (default: the
    current directory) first on the module search path, as `python -m` puts it; `file`:
    the module's file, for a module no search finds by name. `field` names the setting
    in errors (ValueError for a bad path or a missing name, ImportError for a module not
    found or failing to import, with its traceback)."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{field}={path!r}: expected an import path 'module:function' "
                         "(e.g. 'my_reward:score' for ./my_reward.py)")
    name, attr = path.split(":")
    search_dir = os.getcwd() if search_dir is None else search_dir
    try:
        module = _module(name, search_dir, file)
    except Exception as e:  # the user's module raised while importing: show where
        if isinstance(e, ModuleNotFoundError) and e.name in (name, name.split(".")[0]):
            raise ImportError(
                f"{field}={path!r}: no module {name!r} in the current directory "
                f"({search_dir}) or on the module search path; a function in "
                f"./my_reward.py is 'my_reward:NAME'") from None
        raise ImportError(f"{field}={path!r}: importing {name!r} failed:\n"
                          f"{_user_traceback(e)}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(n for n in vars(module) if not n.startswith("_")
                       and callable(getattr(module, n)))
        raise ValueError(f"{field}={path!r}: module {name!r} ({getattr(module, '__file__', '?')}) "
                         f"has no callable {attr!r}; its callables: {names}")
    return fn


@dataclasses.dataclass(frozen=True)
class ImportedFunction:
    """`load_function(path, search_dir=..., file=...)` as a picklable value that calls it.

    Built with `ImportedFunction.of(path)` in the trainer, which checks it loads; a
    worker process imports it when it unpickles the call (before the call's time limit
    starts) and keeps it."""

    path: str
    search_dir: str | None = None
    file: str | None = None

    @classmethod
    def of(cls, path: str, field: str = "function") -> "ImportedFunction":
        """Load `path` now (errors as `load_function`) and record where it came from."""
        search_dir = os.getcwd()
        load_function(path, field, search_dir=search_dir)
        module = sys.modules[path.split(":")[0]]
        return cls(path, search_dir, getattr(module, "__file__", None))

    @property
    def name(self) -> str:
        """The import path, as reward metrics and errors name the function."""
        return self.path

    def resolve(self) -> Callable:
        """The function (imported once per process)."""
        key = (self.path, self.search_dir, self.file)
        if key not in _LOADED:
            _LOADED[key] = load_function(self.path, search_dir=self.search_dir, file=self.file)
        return _LOADED[key]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __reduce__(self):
        # Unpickling imports the function: a reward worker loads it before it starts the
        # call's clock (importing a module may take seconds; the limit is for the call).
        return _loaded, (self.path, self.search_dir, self.file)


def _loaded(path: str, search_dir: str | None, file: str | None) -> ImportedFunction:
    fn = ImportedFunction(path, search_dir, file)
    fn.resolve()
    return fn
