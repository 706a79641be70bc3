"""The command line's signal handlers, in this process: a signal raises once, a second one is ignored while
the first unwinds, and one whose exception Python swallowed is raised when the block ends."""

from __future__ import annotations

import gc
import os
import signal
import weakref

import pytest

from trainledger.signals import Terminated, terminating_signals_raise


class _Thing:
    pass


def test_a_signal_raises_where_the_work_is():
    with pytest.raises(Terminated) as caught, terminating_signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between two bytecodes
            pass
    assert caught.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the previous handler is back


def test_a_second_signal_does_not_cut_the_first_ones_cleanup_short():
    cleaned = []
    with pytest.raises(KeyboardInterrupt), terminating_signals_raise():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        finally:
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(1000):
                pass
            cleaned.append(True)
    assert cleaned == [True]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_swallowed_by_a_weak_reference_callback_is_raised_when_the_block_ends():
    def callback(_ref: object) -> None:  # Python prints what a weak-reference callback raises, and goes on
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(1000):
            pass

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
            for _ in range(1000):
                pass
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
