"""The step tracer's per-op path, compiled on first use: where it comes from, and whether this process has it.

A Python dispatch mode costs about 5 µs an op before it records anything (PyTorch converts the op's arguments to
Python objects, calls ``__torch_dispatch__``, which calls the op again from Python, and converts the results back),
and the tracer's bookkeeping is Python on top of that. ``_native.cpp`` registers a kernel at the dispatcher's
Python key for every aten op while a tracer is attached; for the ops that need nothing but the common bookkeeping
(most of a step's), it records the event and the storages into the tracer's own Python objects without leaving C++,
and runs the op below the mode. What it cannot take goes to ``__torch_dispatch__`` as before, so a trace is the same
either way (``tests/test_native_tracer.py`` compares them event by event and entry by entry).

The source is built once per torch version and Python (``torch.utils.cpp_extension``: a C++ compiler, Python's
headers and ninja; about 20 s) into ``$TRAINLEDGER_CACHE_DIR`` (default ``~/.cache/trainledger``), and loaded from
there after. Where it cannot be built or loaded, or ``TRAINLEDGER_NATIVE=0``, every op goes through the Python hook,
slower and otherwise the same; :func:`status` says which, and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("_native.cpp")
NAME = "trainledger_native"
CFLAGS = ("-O2", "-DNDEBUG")  # NDEBUG: pybind11 otherwise checks that the GIL is held at every reference count change
TORCH_VERSIONS = frozenset({(2, 13)})
"""The torch releases whose Python fallback (``aten/src/ATen/core/PythonFallbackKernel.cpp``) and mode stack the
kernel was checked against: built for these only; any other torch traces through the Python hook."""
STALE_LOCK_SECONDS = 600
"""A build lock older than this was left by a build that was killed (a build takes well under a minute here)."""

_UNTRIED = object()
_module: ModuleType | object | None = _UNTRIED
_reason = ""


def module() -> ModuleType | None:
    """The compiled module, built or loaded on the first call of the process; ``None`` where it is not available
    (:func:`status` says why)."""
    global _module, _reason
    if _module is _UNTRIED:
        _module = None
        try:
            _module = _load()
        except Exception as exc:  # no compiler, no headers, no ninja, a torch it does not compile against
            _reason = f"could not be built: {type(exc).__name__}: {_first_line(exc)}"
    return _module if isinstance(_module, ModuleType) else None


def status() -> str:
    """``"compiled"``, or why ops go through the Python hook (building the module first where it is not yet)."""
    return "compiled" if module() is not None else _reason


def ready() -> bool:
    """Whether :func:`module` returns without building: tried in this process already, or built before (or not
    to be built: turned off, a torch too old)."""
    if _module is not _UNTRIED or os.environ.get("TRAINLEDGER_NATIVE", "1").strip() in _OFF:
        return True
    return _torch_version() not in TORCH_VERSIONS or (build_directory() / "ready").exists()


def _load() -> ModuleType | None:
    global _reason
    if os.environ.get("TRAINLEDGER_NATIVE", "1").strip() in _OFF:
        _reason = "turned off (TRAINLEDGER_NATIVE=0)"
        return None
    if _torch_version() not in TORCH_VERSIONS:
        known = ", ".join(".".join(map(str, v)) for v in sorted(TORCH_VERSIONS))
        _reason = f"built for torch {known} only (this is {torch.__version__})"
        return None
    folder = build_directory()
    built = folder / f"{NAME}.so"
    ready = folder / "ready"
    if not (ready.exists() and built.exists()):
        folder.mkdir(parents=True, exist_ok=True)
        _build(folder)
        ready.write_text(torch.__version__ + "\n")
    return _import(built)


_OFF = ("0", "off", "no", "false")


def _torch_version() -> tuple[int, ...]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())


def build_directory() -> Path:
    """Where this torch's build of the current source lives (a new source, flags or torch get a folder of their own)."""
    root = os.environ.get("TRAINLEDGER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "trainledger"
    )
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    return Path(root) / "native" / tag


def _build(folder: Path) -> None:
    from torch.utils import cpp_extension

    lock = folder / "lock"  # torch's build lock: a process killed while building leaves it, and every later one waits
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()

    path = os.environ.get("PATH", "")
    with contextlib.suppress(ImportError):  # the ninja package's binary, where the environment's bin is not on PATH
        import ninja

        os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpp_extension.load(
                name=NAME,
                sources=[str(SOURCE)],
                build_directory=str(folder),
                extra_cflags=list(CFLAGS),
                verbose=False,
            )
    finally:
        os.environ["PATH"] = path


def _import(path: Path) -> ModuleType:
    existing = sys.modules.get(NAME)
    if existing is not None:
        return existing
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path.name}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    sys.modules[NAME] = loaded
    return loaded


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
