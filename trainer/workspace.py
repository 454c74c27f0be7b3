"""The job's workspace on the trainer side: the folder the worker unpacked the user's upload into.

`python -m trainer --workspace DIR` sets it once per process (every rank gets the flag). It goes on
the import path, relative `data.path`s resolve against it, and entry points `package.module:function`
named in the spec are imported from it.
"""

from __future__ import annotations

import importlib
import site
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobrules.spec import SpecError

_ROOT: list[Path] = []


class UserCodeError(RuntimeError):
    """The user's own code failed (import error, exception, wrong return type); the message says
    which entry point, and the traceback is in the logs."""


def set_workspace(path: Path | None) -> None:
    """Make `path` this process's workspace (None: no workspace) and put it first on sys.path."""
    _ROOT.clear()
    if path is None:
        return
    path = path.resolve()
    if not path.is_dir():
        # the worker leaves its reason in the job's folder (workers/workspace.py): beside the
        # folder it could not fill, or two up from `workspace/tree` (a spare's, workers/spare.py)
        found = [p / "workspace.error" for p in path.parents[:2] if (p / "workspace.error").is_file()]
        reason = found[0].read_text().strip() if found else "the worker could not unpack the job's workspace"
        raise SpecError(f"workspace folder {path} does not exist: {reason}")
    _ROOT.append(path)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    importlib.invalidate_caches()


def add_environment(path: Path | None) -> None:
    """Append the job's own packages (`--pyenv DIR`, the environment the worker built from its
    requirements) to sys.path, after the trainer's own: torch, numpy and the project's packages
    stay the ones that run. Called after the fork in a warm run, so it needs no fresh process."""
    if path is None:
        return
    if not path.is_dir():
        raise SpecError(f"environment folder {path} does not exist (the worker's build left none)")
    site.addsitedir(str(path))  # its .pth files too, as in any site-packages
    importlib.invalidate_caches()


def workspace() -> Path | None:
    return _ROOT[0] if _ROOT else None


def resolve_path(raw: str, *, field: str) -> Path:
    """An absolute path as given, a relative one inside the workspace (never outside it)."""
    p = Path(raw).expanduser()
    if p.is_absolute():
        return p
    root = workspace()
    if root is None:
        raise SpecError(f"{field} ({raw!r}) is relative but the job has no workspace")
    full = (root / p).resolve()
    if not full.is_relative_to(root):
        raise SpecError(f"{field} ({raw!r}) points outside the workspace")
    return full


def load_entry(spec: str, *, field: str) -> Callable[..., Any]:
    """Import `package.module:function` (from the workspace first). Errors in the user's module
    come back as UserCodeError chained to the original exception, so its traceback is printed."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{field} must look like 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            where = f"workspace {workspace()}" if workspace() else "the import path (no workspace given)"
            raise UserCodeError(f"{field}: no module {e.name!r} in {where}") from e
        raise UserCodeError(f"{field}: importing {module_name} failed: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise UserCodeError(f"{field}: importing {module_name} failed: {type(e).__name__}: {e}") from e
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise UserCodeError(f"{field}: module {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise UserCodeError(f"{field}: {spec} is not callable")
    return fn


def call_entry(fn: Callable[..., Any], *, field: str, **kwargs: Any) -> Any:
    """Call a user entry point; an exception inside it becomes a UserCodeError naming it."""
    try:
        return fn(**kwargs)
    except Exception as e:
        raise UserCodeError(
            f"{field}: calling {fn.__module__}.{fn.__qualname__} raised {type(e).__name__}: {e}"
        ) from e
