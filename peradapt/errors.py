"""Errors a user can cause, and the machine's refusals. The CLI prints each as one line and exits with code 2.

The machine refusing a command (a place that cannot be written, a full disk) surfaces as an `OSError` wherever
peradapt or a library it calls writes; `machine_error` says it in one line, with the path and the remedy, and
`refusals_reported` raises that line from every function of the Python API (docs/DESIGN.md, "When the machine says
no").
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class PeradaptError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class ConfigError(PeradaptError):
    """A flag, config file or combination of settings is invalid."""


class PluginError(ConfigError):
    """A method from outside peradapt (`--method module:Class`, an installed entry point) cannot be imported or used:
    the run that names it is intact, and works again once the plugin does."""


class MissingDependency(PeradaptError, ImportError):
    """A package peradapt needs is not installed, found when a module that needs it is imported: an ImportError to
    Python code, one `error:` line naming what to install to the command line."""


class DataError(PeradaptError):
    """A dataset is missing, unreadable or too small for what was asked."""


class WeightsError(PeradaptError):
    """Backbone weights or an adapter checkpoint are missing, unreadable or do not match."""


class RunError(PeradaptError):
    """A run directory is missing, incomplete or belongs to a different configuration."""


class TrainingDiverged(PeradaptError):
    """A loss became NaN or infinite."""


class HubError(PeradaptError):
    """The Hugging Face Hub refused an upload (`export --push-to-hub`) or could not be reached."""


class Interrupted(Exception):
    """Ctrl-C stopped a command; the message says what was kept and how to continue. The CLI exits with 130."""


class MachineError(PeradaptError):
    """The machine refused what a command needs: a place it cannot write, a full disk, a server that does not
    answer. The message names the place and what to do about it."""


# What makes a place unwritable, and what the user can do about it; peradapt writes to --out, the run it works on,
# and $PERADAPT_HOME (backbones, their pinned copies, caches).
_ELSEWHERE = "or give peradapt a writable place instead (another --out, a copy of the run, $PERADAPT_HOME)"
_REFUSALS = {
    errno.EACCES: ("permission denied", f"make it writable for this user {_ELSEWHERE}"),
    errno.EPERM: ("operation not permitted", f"make it writable for this user {_ELSEWHERE}"),
    errno.EROFS: ("a read-only file system", f"remount it writable {_ELSEWHERE}"),
    errno.ENOSPC: ("no space left on the device", f"free space there {_ELSEWHERE}"),
    errno.EDQUOT: ("the disk quota is used up", f"free space there {_ELSEWHERE}"),
}
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error (safetensors) names its errno
_PYTHON_OS_ERROR = re.compile(r"\[Errno (\d+)\]")  # str(OSError), as shutil.Error lists a copy's failures


def machine_error(error: BaseException) -> MachineError | None:
    """`error` said in one line when it is the machine refusing to write (`_REFUSALS`), else None: an `OSError`,
    a `shutil.Error` of a tree copy (its first failure), or a `MachineError` already."""
    if isinstance(error, MachineError):
        return error
    if isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list) and error.args[0]:
        _, target, reason = error.args[0][0]  # copytree's (source, destination, str(OSError)) per failed file
        found = _PYTHON_OS_ERROR.search(str(reason))
        code, path = (int(found.group(1)) if found else None), target
    elif isinstance(error, OSError):
        code, path = error.errno, error.filename2 or error.filename
    else:
        return None
    if code not in _REFUSALS:
        return None
    what, remedy = _REFUSALS[code]
    place = os.fsdecode(path) if path is not None else "a file peradapt writes"
    return MachineError(f"cannot write {place}: {what}: {remedy}")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Inside the block, an error of writing `path` that does not name it is raised as an `OSError` with `path`: a
    write's own `OSError` (a full disk fails `write()`, which has no file name), or a library's error that names
    only the OS error (safetensors: "I/O error: No space left on device (os error 28)")."""
    try:
        yield
    except OSError as exc:
        # errno None: no OS error of its own (shutil.Error lists a tree copy's, each with its file)
        if exc.errno is not None and exc.filename is None and exc.filename2 is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except Exception as exc:
        found = _RUST_OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc


def refusals_reported(function: Callable[P, R]) -> Callable[P, R]:
    """`function`, raising the machine's refusals (`machine_error`) as a `MachineError`: one line for the command
    line's `error:`, a `PeradaptError` for the Python API."""

    @functools.wraps(function)
    def reported(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except (OSError, shutil.Error) as exc:
            refused = machine_error(exc)
            if refused is None:
                raise
            raise refused from exc

    return reported


INTERRUPTED_BEFORE_WRITING = "interrupted: nothing was written"  # Ctrl-C before a command wrote anything


def quiet_interrupts_while_starting() -> None:
    """Where this process is the `peradapt` command (its script, or `python -m peradapt`), Ctrl-C during the seconds
    of imports before `cli.main` runs exits with 130 and one line, not a KeyboardInterrupt traceback from inside
    torch. Nothing is written before `cli.main`, which puts Python's own handler back (`interrupts_raise`)."""
    argv = getattr(sys, "orig_argv", [])  # the interpreter's own arguments: `python -m peradapt ...`
    as_module = "-mperadapt" in argv or any(a == "-m" and b == "peradapt" for a, b in itertools.pairwise(argv))
    if as_module or (sys.argv and Path(sys.argv[0]).stem == "peradapt"):
        signal.signal(signal.SIGINT, _exit_interrupted)


def interrupts_raise() -> None:
    """Ctrl-C raises KeyboardInterrupt again (Python's default), once the command line handles it."""
    if signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_interrupted(signum: int, frame: object) -> None:
    os.write(sys.stderr.fileno(), f"{INTERRUPTED_BEFORE_WRITING}\n".encode())
    os._exit(130)  # in the middle of an import: nothing to clean up, and no exception to print
