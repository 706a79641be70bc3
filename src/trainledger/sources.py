"""Where workloads come from: the ``--model`` spec of the command line.

A spec names a built-in example (``gpt-tiny``, see :mod:`trainledger.examples`) or a user's
``path/to/file.py:factory`` whose ``factory()`` returns a :class:`~trainledger.workload.Workload`. Hugging
Face architectures come from :mod:`trainledger.hf`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

from trainledger import examples
from trainledger.checks import describe
from trainledger.errors import InputError
from trainledger.workload import Workload


@contextlib.contextmanager
def _folder_on_path(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` for the duration (as ``python file.py`` puts the script's folder),
    then removed again, whatever happened. No ``__pycache__`` is written into the user's folder meanwhile:
    reading a model must not add files beside it."""
    entry = str(folder)
    sys.path.insert(0, entry)
    no_bytecode = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = no_bytecode
        for i, item in enumerate(sys.path):
            if item is entry:  # the very entry added, even if the user's code added an equal one
                del sys.path[i]
                break


@contextlib.contextmanager
def _users_code(what: str) -> Iterator[None]:
    """The user's file or factory: an exception, or a ``sys.exit()``, becomes one line that says whose
    doing it was (an interrupt still interrupts)."""
    try:
        yield
    except InputError:
        raise
    except SystemExit as exc:
        raise InputError(
            f"{what} called sys.exit({exc.code!r}); a model file and its factory must return, not exit"
        ) from None
    except Exception as exc:
        message = " ".join(str(exc).split())[:300]
        raise InputError(f"{what} raised {type(exc).__name__}: {message}; fix it and try again") from exc


def load_workload(spec: str) -> Workload:
    """A built-in example by name (``gpt-tiny``) or a user's ``path/to/file.py:factory``.

    ``factory()`` is called with no arguments and must return a :class:`Workload`.
    """
    if not isinstance(spec, str):
        raise InputError(f"model {describe(spec)}: give a built-in example's name or 'path/to/file.py:factory'")
    if spec in examples.EXAMPLES:
        return examples.build(spec)
    if ":" not in spec:
        known = ", ".join(examples.EXAMPLES)
        raise InputError(f"unknown model {spec!r}; use a built-in example ({known}) or path/to/file.py:factory")
    path_text, _, factory_name = spec.rpartition(":")
    path = Path(path_text)
    if path.is_dir():
        raise InputError(f"model file {path_text!r} is a folder; give the Python file in it: path/to/file.py:factory")
    if not path.is_file():
        raise InputError(f"model file {path_text!r} does not exist; give path/to/file.py:factory")
    if not factory_name.isidentifier():
        raise InputError(f"factory name {factory_name!r} in {spec!r} is not a Python name; give a function's name")
    module_name = f"_trainledger_user_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise InputError(f"cannot import {path_text!r}; it must be a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    with _folder_on_path(path.resolve().parent):  # sibling imports work as with `python file.py`
        try:
            with _users_code(f"importing {path_text!r}"):
                module_spec.loader.exec_module(module)
        except InputError:
            sys.modules.pop(module_name, None)
            raise
        factory = getattr(module, factory_name, None)
        if not callable(factory):
            what = (
                f"has no function {factory_name!r}"
                if factory is None
                else f"has {factory_name!r} as {describe(factory)}, not a function"
            )
            raise InputError(f"{path_text!r} {what}; give file.py:NAME where NAME() returns a Workload")
        with _users_code(f"{factory_name}()"):
            workload = factory()
    if not isinstance(workload, Workload):
        hint = ""
        if inspect.iscoroutine(workload):
            workload.close()  # never awaited: closed, so Python prints no warning of its own
            hint = " (an async def factory returns a coroutine: make it a plain def)"
        raise InputError(
            f"{factory_name}() returned {type(workload).__name__}; "
            f"it must return trainledger.Workload(model, batch, ...){hint}"
        )
    workload.name = workload.name or f"{path.name}:{factory_name}"
    return workload
