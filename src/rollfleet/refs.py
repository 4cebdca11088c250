"""References to a user's code: ``package.module:attribute`` or ``path/to/file.py:attribute``.

Agents (``--agent``, ``rollfleet workers AGENT``) and modes (``--mode``) are named this way. A
module name is imported as Python would, with the directory the command runs in on the path (so
``myfile:make`` finds ``./myfile.py``); a file path is loaded from that file, once per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from rollfleet.errors import InvalidInput

MAX_REF = 512  # characters of a reference: it travels to runners and is stored with rollouts


def is_file(target: str) -> bool:
    """Whether a reference's module part is a file path (``x.py``, ``dir/x.py``) rather than a
    module name (``package.py`` names the module ``py`` of ``package`` only if no such file is
    here)."""
    if not target.endswith(".py"):
        return False
    return "/" in target or "." not in target[:-3] or Path(target).is_file()


def absolute(ref: str) -> str:
    """``ref`` with a file path made absolute (runner processes load it from anywhere)."""
    target, sep, attribute = ref.rpartition(":")
    if sep and is_file(target):
        return f"{Path(target).resolve()}:{attribute}"
    return ref


def load_module(target: str) -> ModuleType:
    """The module ``target`` names: a ``.py`` file, or an importable module; InvalidInput
    naming the file or module, and the error its import raised."""
    if is_file(target):
        return _load_file(Path(target))
    if str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise InvalidInput(f"cannot import {target}: {type(exc).__name__}: {exc}") from None


def _load_file(path: Path) -> ModuleType:
    """A module from a file, executed once per process."""
    if not path.is_file():
        raise InvalidInput(f"no file {path}")
    resolved = path.resolve()
    name = "rollfleet_user_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise InvalidInput(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise InvalidInput(f"cannot import {path}: {type(exc).__name__}: {exc}") from None
    return module


def resolve(ref: str, default_attribute: str | None = None) -> object:
    """The object ``ref`` names (``module:attribute``; ``module`` alone means its
    ``default_attribute``); InvalidInput saying what is missing."""
    if len(ref) > MAX_REF:
        raise InvalidInput(f"a reference of {len(ref)} characters; at most {MAX_REF}")
    target, sep, attribute = ref.rpartition(":")
    if not sep:
        target, attribute = ref, default_attribute or ""
    if not target or not attribute:
        raise InvalidInput(f"{ref!r} is not module:attribute")
    module = load_module(target)
    if not hasattr(module, attribute):
        raise InvalidInput(f"{target} has no attribute {attribute!r}")
    return getattr(module, attribute)
