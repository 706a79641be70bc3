"""A signal that ends a command ends every process it started and removes every temporary file it wrote.

Each test runs the real entry point in a fresh process with ``TMPDIR`` pointing at a folder of its own
(so a leftover is this command's, and nothing else's), waits until the work it means to interrupt has
begun — the ranks of ``shard --run`` exist, or ``pareto`` has spent seconds of work past its imports —
sends the signal, and checks the exit status, the processes and the folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainledger.signals import child_pids

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("signals_not_ignored"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds child processes through /proc"),
]

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper other than us counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


@contextlib.contextmanager
def _running(argv: list[str], tmp: Path) -> Iterator[subprocess.Popen[str]]:
    """The command in a fresh process, killed and reaped (pipes closed) whatever the test found."""
    env = {**os.environ, "TMPDIR": str(tmp), "TMP": str(tmp), "TEMP": str(tmp)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainledger.cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def _wait_for(proc: subprocess.Popen[str], ready: Callable[[], bool], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the command ended before it could be interrupted: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "the work to interrupt never began"
        time.sleep(0.01)  # the solver's model file lives a fraction of a second


def _all_gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _interrupt(proc: subprocess.Popen[str], signum: int) -> str:
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    # 130, 143, 129 as shells report it; or ended by the signal itself, which Python does after a
    # KeyboardInterrupt it saw while shutting down (a shell reports that as 130 too)
    assert proc.returncode in (128 + signum, -signum), err
    assert "Traceback" not in err
    return err


SHARD_RUN = ["shard", "--model", "gpt-tiny", "--world", "2", "--stage", "3", "--run"]


def _ranks_started(proc: subprocess.Popen[str], tmp: Path) -> bool:
    return len(child_pids(proc.pid)) == 2 and any(tmp.glob("trainledger-shard-*/rank1.stage"))


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_shard_run_leaves_no_rank_and_no_folder(tmp_path, signum):
    with _running(SHARD_RUN, tmp_path) as proc:
        _wait_for(proc, lambda: _ranks_started(proc, tmp_path))
        ranks = child_pids(proc.pid)
        _interrupt(proc, signum)
    assert _all_gone(ranks) == []
    assert list(tmp_path.iterdir()) == []


def test_ranks_exit_when_their_parent_is_killed(tmp_path):
    """SIGKILL runs no cleanup at all: the ranks notice their parent is gone and exit by themselves (the
    folder is then left behind; nothing can remove it)."""
    with _running(SHARD_RUN, tmp_path) as proc:
        _wait_for(proc, lambda: _ranks_started(proc, tmp_path))
        ranks = child_pids(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
        assert _all_gone(ranks) == []


def _cpu_seconds(pid: int) -> float:
    """User and system time the process has used (``/proc/<pid>/stat`` fields 14 and 15, in clock ticks)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_pareto_leaves_no_solver_process_and_no_temporary_file(tmp_path, signum):
    with _running(["pareto", "--model", "gpt-tiny", "--budgets", "8", "--verify"], tmp_path) as proc:
        _wait_for(proc, lambda: _cpu_seconds(proc.pid) > 4)  # tracing, planning or verifying by then
        children = child_pids(proc.pid)
        _interrupt(proc, signum)
    assert _all_gone(children) == []
    # torch's compiler cache (``torchinductor_<user>``) is kept across runs on purpose: not a temporary file
    assert [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []


_ENTRY = "from trainledger.cli import entry; raise SystemExit(entry())"


@pytest.mark.parametrize("delay", [0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
def test_ctrl_c_while_the_command_line_starts_is_one_line_and_status_130(tmp_path, delay):
    """While torch and the command's modules load, before any handler of the command's own: before, a
    KeyboardInterrupt traceback from inside torch's import and death by the signal; then, inside torch's or numpy's
    import, an abort, numpy's "cannot load module more than once", or the signal swallowed and the command run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", _ENTRY, "trace", "--model", "gpt-tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
        text=True,
    )
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().splitlines() == ["trainledger: interrupted"], err


def test_estimate_imports_no_torch(tmp_path):
    """The closed form reads the JSON itself: the command starts in a fraction of the time torch takes to load."""
    config = Path(__file__).parent / "fixtures" / "hf" / "llama-3-8b.json"
    check = "import sys\nfrom trainledger.cli import entry\ncode = entry()\n"
    check += "assert 'torch' not in sys.modules\nraise SystemExit(code)"
    done = subprocess.run(
        [sys.executable, "-c", check, "estimate", "--hf-config", str(config), "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
