"""Signals that end a command: every one of them runs the command's cleanup, then exits conventionally.

Python turns SIGINT (Ctrl-C) into :class:`KeyboardInterrupt`, so ``finally`` blocks run and temporary
files go; SIGTERM (``kill``, a job scheduler) and SIGHUP (a closed terminal) would end the process at
once, leaving processes it started and files it wrote. :func:`terminating_signals_raise` makes those two
raise :class:`Terminated` the same way; the first signal also sets all three to be ignored, so that a
repeated Ctrl-C cannot cut the cleanup short. :func:`stop_children` then ends any process the command
started that is still running (a MILP solver's process, for one).

A signal that arrives while a module is being imported is acted on as soon as the import is done: raised inside a
C extension's initialization (torch's, numpy's) an exception can abort the process or break the module.

The command line exits with ``128 + signal number`` (130, 143, 129), as shells report a process ended by
a signal. No torch import.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

TERMINATING: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (a ``BaseException``, like ``KeyboardInterrupt``: ``except Exception``
    does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(signum: int) -> int:
    """The conventional exit status of a process ended by ``signum``: 128 + its number."""
    return 128 + int(signum)


_received: list[int] = []
"""The signal that arrived within :func:`terminating_signals_raise`'s block, if one did."""


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _loading() -> bool:
    """Whether a module is being imported. A C extension's initialization may run Python code, and an exception a
    signal handler raises there ends the process with ``abort()`` (torch's pybind11 code: "terminate called after
    throwing an instance of 'pybind11::error_already_set'"), leaves a half-loaded extension that cannot be imported
    again (numpy: "cannot load module more than once per process"), or is swallowed by a ``try`` around an optional
    import, and the command then runs to its end."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False) for m in list(sys.modules.values()))


def _send_again_when_loaded(signum: int) -> None:
    while _loading():
        time.sleep(0.01)
    os.kill(os.getpid(), signum)


def _deferred_while_loading(signum: int) -> bool:
    """Whether a signal that arrived while a module is being imported was put off: it is sent again as soon as no
    import is under way, and acted on then."""
    if not _loading():
        return False
    threading.Thread(target=_send_again_when_loaded, args=(signum,), name="trainledger-signal", daemon=True).start()
    return True


def _raise(signum: int, _frame: FrameType | None) -> None:
    if _received:  # the cleanup that follows must not be cut short by a second signal
        return
    if _deferred_while_loading(signum):
        return
    _received.append(signum)
    raise _exception(signum)


@contextlib.contextmanager
def terminating_signals_raise() -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and SIGTERM and SIGHUP raise
    :class:`Terminated`, once; later signals are ignored until the block ends. A signal the process was started
    ignoring (``nohup``'s SIGHUP) stays ignored. A signal whose exception
    Python swallowed (it arrived while a weak-reference callback or a finalizer ran) is raised again
    when the block ends. Only the main thread can
    set handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in TERMINATING}
    _received.clear()
    try:
        for s in TERMINATING:
            if previous[s] is not signal.SIG_IGN:  # ignored as the process began (nohup's SIGHUP): it stays so
                signal.signal(s, _raise)
        yield
        if _received:
            # raised where Python could not pass it on (a weak-reference callback, a finalizer, which only
            # print what they raise): the work went on to its end, and the signal is acted on now
            raise _exception(_received[0])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def interrupts_wait_for_imports() -> Iterator[None]:
    """Within the block, Ctrl-C raises ``KeyboardInterrupt`` as Python's own handler does, except while a module is
    being imported (torch and numpy load for a second or more as a command starts): then as soon as the import is
    done. For the command line's start, before :func:`terminating_signals_raise`'s block; where SIGINT does not
    raise ``KeyboardInterrupt`` (ignored, or a handler of the caller's), or off the main thread, this does nothing."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        if not _deferred_while_loading(signum):
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def child_pids(pid: int | None = None) -> list[int]:
    """The live child processes of ``pid`` (default: this process), from ``/proc`` (Linux; elsewhere none)."""
    pid = os.getpid() if pid is None else pid
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in task.read_text().split()]
    return children


def stop_children(grace_seconds: float = 2.0) -> None:
    """End every process this one started that still runs: SIGTERM, then SIGKILL after ``grace_seconds``."""
    children = child_pids()
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while children and time.monotonic() < deadline:
        children = [pid for pid in children if not _reaped(pid)]
        time.sleep(0.05)
    for pid in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        _reaped(pid, block=True)


def _reaped(pid: int, *, block: bool = False) -> bool:
    """Reap ``pid`` if it has exited (it is our child); ``True`` once it is gone."""
    try:
        done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:  # already reaped (by its Popen object, say)
        return True
    return done == pid
