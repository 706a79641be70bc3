"""The command line's signal handlers, in this process: a signal raises once, a second one is ignored while
the first unwinds, and one whose exception Python swallowed is raised when the block ends."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref

import pytest

from trainledger.signals import Terminated, interrupts_wait_for_imports, terminating_signals_raise

pytestmark = pytest.mark.usefixtures("signals_not_ignored")


class _Thing:
    """An object to hold a weak reference to."""


def _bytecodes() -> int:
    """Some bytecodes to run: Python runs a signal's handler between two of them, not inside ``os.kill``."""
    return sum(1 for _ in range(1000))


def test_a_signal_raises_where_the_work_is():
    with pytest.raises(Terminated) as caught, terminating_signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        _bytecodes()
    assert caught.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the previous handler is back


def test_a_second_signal_does_not_cut_the_first_ones_cleanup_short():
    cleaned = []
    with pytest.raises(KeyboardInterrupt), terminating_signals_raise():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            _bytecodes()
        finally:
            os.kill(os.getpid(), signal.SIGHUP)
            _bytecodes()
            cleaned.append(True)
    assert cleaned == [True]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_swallowed_by_a_weak_reference_callback_is_raised_when_the_block_ends():
    def callback(_ref: object) -> None:  # Python prints what a weak-reference callback raises, and goes on
        os.kill(os.getpid(), signal.SIGHUP)
        _bytecodes()

    finished = []
    with pytest.raises(Terminated) as caught, terminating_signals_raise():
        thing = _Thing()
        ref = weakref.ref(thing, callback)
        del thing
        gc.collect()
        finished.append(ref() is None)  # the work went on past the swallowed signal
    assert finished == [True] and caught.value.signum == signal.SIGHUP


def test_a_signal_ignored_as_the_process_began_stays_ignored():
    """Under ``nohup`` SIGHUP is ignored: a command that hangs up must not end (it did, with status 129)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with terminating_signals_raise():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            _bytecodes()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


_INTERRUPTS_ITS_OWN_IMPORT = """
import os, signal
os.kill(os.getpid(), signal.{name})
RUNS = sum(1 for _ in range(100_000))  # a C extension's initialization running Python code, where raising would abort
LOADED = True
"""


def _module_that_signals_while_it_loads(tmp_path, monkeypatch, name: str, signum: signal.Signals) -> None:
    (tmp_path / f"{name}.py").write_text(_INTERRUPTS_ITS_OWN_IMPORT.format(name=signum.name))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_that_arrives_during_an_import_is_raised_once_the_import_is_done(tmp_path, monkeypatch, signum):
    """Raised inside torch's import, Ctrl-C aborted the process ("terminate called after throwing an instance of
    'pybind11::error_already_set'"), broke numpy's ("cannot load module more than once per process"), or was
    swallowed and the command ran to its end."""
    _module_that_signals_while_it_loads(tmp_path, monkeypatch, "signals_while_loading", signum)
    after_import = []
    with pytest.raises((KeyboardInterrupt, Terminated)) as caught, terminating_signals_raise():
        import signals_while_loading  # noqa: F401

        after_import.append(True)
        time.sleep(5)  # the signal is sent again as the import ends, and interrupts this
    assert after_import == [True] and sys.modules["signals_while_loading"].LOADED
    assert isinstance(caught.value, KeyboardInterrupt) == (signum == signal.SIGINT)


def test_ctrl_c_as_the_command_line_starts_waits_for_the_import_under_way(tmp_path, monkeypatch):
    _module_that_signals_while_it_loads(tmp_path, monkeypatch, "interrupts_while_loading", signal.SIGINT)
    after_import = []
    with pytest.raises(KeyboardInterrupt), interrupts_wait_for_imports():
        import interrupts_while_loading  # noqa: F401

        after_import.append(True)
        time.sleep(5)
    assert after_import == [True] and sys.modules["interrupts_while_loading"].LOADED
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt), interrupts_wait_for_imports():  # no import under way: at once
        os.kill(os.getpid(), signal.SIGINT)
        _bytecodes()
