"""The user's own code (reward functions, environments, tools, task modules): imported by module name
or from a file, and pointed at, at the user's file and line, when it fails.

A traceback's frames are sorted by whose code they run: tidal's (its modules are `tidal.*`, the
actor's and learner's folders included), Python's standard library, installed libraries
(site-packages), and the user's own (everything else). An error is reported at the user's frame,
named after the user's function or method (`LookupEnv.step`), never after tidal's wrapper around it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, TracebackType

from tidal.config import ConfigError

MESSAGE_CHARS = 300  # an error's message kept in a report: the file and line after it must survive a cut
STDLIB = sysconfig.get_paths()["stdlib"] + os.sep  # Python's own modules, the base's under a venv


# ---- importing ---------------------------------------------------------------------------------


def import_module(name: str, key: str) -> ModuleType:
    """Module `name`, with the working folder importable (as `python -m` makes it); ConfigError
    starting with `key` when it is missing, has a syntax error, or raises as it is imported."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        # appended, not prepended: a folder of the user's never shadows an installed package
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):  # not a module it imports
            raise ConfigError(
                f"{key}: cannot import {name} ({err}; run from its folder, or put that folder on PYTHONPATH)"
            ) from None
        raise import_failed(err, key, name) from None
    except Exception as err:
        raise import_failed(err, key, name) from None


def import_file(path: str, key: str) -> ModuleType:
    """The Python file at `path` as a module (imported once, however many functions are named from it);
    its folder importable, as `python FILE` makes it. ConfigError starting with `key` as import_module."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{key}: no such file {file}")
    name = module_name_of(file)
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise import_failed(err, key, str(file)) from None
    return module


def import_failed(err: Exception, key: str, what: str) -> ConfigError:
    """A module that did not import: a syntax error as `FILE:LINE: MESSAGE`, an error its own code
    raised at the user's line."""
    if isinstance(err, SyntaxError):
        return ConfigError(f"{key}: {err.filename}:{err.lineno}: {err.msg} (a syntax error)")
    return ConfigError(f"{key}: importing {what} raised {one_line(err)}\n{where_raised(err)}")


def module_name_of(file: Path) -> str:
    """The file's stem, unless another module holds that name (then the stem and a digest of the path)."""
    held = sys.modules.get(file.stem)
    if held is None or getattr(held, "__file__", None) == str(file):
        return file.stem
    return f"{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"


# ---- where it failed ---------------------------------------------------------------------------


def one_line(err: BaseException) -> str:
    """`Type: message` on one line, the message cut at MESSAGE_CHARS."""
    message = " ".join(str(err).split())
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + "..."
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def whose(frame) -> str:
    """tidal, library, stdlib or user: whose code a frame runs (by its module for tidal's, whose folders
    are not all under tidal/; by its file for the others, so a user's module may share a stdlib name)."""
    module = frame.f_globals.get("__name__", "") or ""
    filename = frame.f_code.co_filename
    if module == "tidal" or module.startswith("tidal."):
        return "tidal"
    if f"{os.sep}site-packages{os.sep}" in filename or f"{os.sep}dist-packages{os.sep}" in filename:
        return "library"  # before the stdlib: a Python without a venv keeps site-packages inside it
    if filename.startswith((STDLIB, "<frozen")):
        return "stdlib"
    return "user"


def frames_of(tb: TracebackType | None) -> list[tuple]:
    """(frame, line) of each traceback entry, outermost first."""
    return list(traceback.walk_tb(tb))


def format_frame(frame, line: int) -> str:
    return printed(frame.f_code.co_filename, line, frame.f_code.co_name)


def printed(filename: str, line: int, name: str) -> str:
    """A place as Python prints a frame: `  File "...", line N, in name` and its source line."""
    return "".join(traceback.format_list([traceback.FrameSummary(filename, line, name)])).rstrip()


def where_raised(err: BaseException, fn: Callable | None = None) -> str:
    """The user's frame of a traceback, as Python prints a frame: the deepest one in `fn`'s file, else
    the deepest of the user's, else of a library's (the frames that ran it say nothing the user can fix)."""
    frames = frames_of(err.__traceback__)
    own_file = getattr(getattr(inspect.unwrap(fn), "__code__", None), "co_filename", None) if fn else None
    tiers = (
        [f for f in frames if f[0].f_code.co_filename == own_file] if own_file else [],
        [f for f in frames if whose(f[0]) == "user"],
        [f for f in frames if whose(f[0]) == "library"],
        frames[-1:],
    )
    chosen = next((tier for tier in tiers if tier), [])
    return format_frame(*chosen[-1]) if chosen else ""


def raised_by(err: BaseException) -> tuple[str | None, str]:
    """(the user's function or method the error came out of, e.g. `LookupEnv.step`; where it was
    raised): the outermost of the user's frames names it, the deepest says where. A library's frames
    stand in where no frame is the user's; (None, "") where only tidal's and Python's ran."""
    frames = frames_of(err.__traceback__)
    for kind in ("user", "library"):
        theirs = [f for f in frames if whose(f[0]) == kind]
        if theirs:
            code = theirs[0][0].f_code
            name = code.co_qualname
            if "." not in name or kind == "library":  # a plain function: its module says whose it is
                name = f"{theirs[0][0].f_globals.get('__name__', '?')}.{name}"
            return name, format_frame(*theirs[-1])
    return None, ""


def failure(err: BaseException, fallback: str) -> str:
    """`<who> raised <Type>: <message>` and, on the next line, where: the user's function and line
    (`fallback` names what raised where none of the frames is the user's or a library's)."""
    who, where = raised_by(err)
    return f"{who or fallback} raised {one_line(err)}" + (f"\n{where}" if where else "")


def defined_at(fn: Callable) -> str:
    """Where a function is defined, as Python prints a frame ("" for one without Python source)."""
    code = _code_of(fn)
    return printed(code.co_filename, code.co_firstlineno, code.co_name) if code is not None else ""


def def_line(fn: Callable) -> str:
    """`FILE:LINE` of a function's def ("" for one without Python source)."""
    code = _code_of(fn)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _code_of(fn: Callable):
    target = inspect.unwrap(fn)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target).__call__  # a callable object: its __call__
    return getattr(target, "__code__", None)
