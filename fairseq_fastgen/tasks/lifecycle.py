"""How the generate pipeline's processes end.

* A worker dies with the process that forked it, however that process ends (SIGTERM,
  SIGINT, SIGKILL, an exception): :func:`die_with_parent` asks Linux for a signal when the
  parent goes (``prctl(PR_SET_PDEATHSIG)``), and the worker loop also checks
  :func:`orphaned` between batches (other platforms, and the moment before the request).
  Without both, an orphaned worker kept decoding its queued batches, filled the results
  pipe (a sibling still holds its read end) and then waited forever on the queue's feeder
  thread (issue 18).  The check alone cannot end a worker blocked reading a task that its
  parent died while writing (a batch larger than the pipe); the kernel's signal does.
* The main process turns SIGTERM and SIGINT into an exception for the run
  (:class:`StopOnSignals`): the run's ``except`` path ends the workers at once, the written
  lines are whole (a batch's lines are written with the signal deferred,
  :meth:`StopOnSignals.deferred`) and flushed, and the process exits with the status a shell
  shows for the signal: 143 (SIGTERM), 130 (SIGINT).  The previous handlers come back
  when the run ends.
* A torchrun rank stops as on SIGTERM when its launcher is gone (:func:`watch_parent`).
"""
import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from typing import Optional

logger = logging.getLogger("fairseq_fastgen.generate")

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _prctl(option: int, arg) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the between-batches check remains
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """In a forked worker: have the kernel send ``sig`` when the parent ends.

    SIGKILL by default: a worker has nothing to save once its parent, which alone writes
    the output, is gone.  Linux ties the request to the parent *thread* that forked us,
    so the pool is created from the thread that runs the generate loop.  The parent may
    have ended between the fork and the request; then this process ends now.
    Returns whether the request was taken (False off Linux).
    """
    ok = _prctl(_PR_SET_PDEATHSIG, int(sig))
    if orphaned(parent_pid):
        os._exit(1)
    return ok


def watch_parent(sig: int = signal.SIGTERM, interval: float = 0.5) -> threading.Thread:
    """In a process we did not start (a torchrun rank): send ourselves ``sig`` once the
    parent is gone, so that the run stops as on that signal (whole lines, workers ended).

    A thread that polls, not ``PR_SET_PDEATHSIG``: the kernel ties that to the parent
    thread that started us, which in a launcher may end long before the launcher does.
    torchrun starts each rank in a session of its own, so a killed launcher would
    otherwise leave its ranks running."""
    parent = os.getppid()

    def watch():
        while not orphaned(parent):
            time.sleep(interval)
        logger.warning("the launcher (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), sig)

    t = threading.Thread(target=watch, name="fastgen-parent-watch", daemon=True)
    t.start()
    return t


def orphaned(parent_pid: int) -> bool:
    """The parent that forked this process is gone (we were re-parented)."""
    return os.getppid() != parent_pid


def set_process_name(name: str) -> None:
    """What ``ps -e``, ``top`` and /proc/PID/comm show for this process (15 bytes at most):
    forked workers otherwise all look like their parent."""
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


class StopSignal(SystemExit):
    """The run was stopped by SIGTERM; exits with 128 + the signal's number, as a shell
    shows a process killed by it, and without a traceback."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StopInterrupt(StopSignal, KeyboardInterrupt):
    """The run was stopped by SIGINT (Ctrl-C): still a ``KeyboardInterrupt`` for a caller
    that catches one, exit status 130 otherwise."""


class StopOnSignals:
    """For one run (a context manager, main thread only; elsewhere it does nothing):
    SIGTERM and SIGINT raise :class:`StopSignal` / :class:`StopInterrupt` in the main
    thread, once; repeats while the run stops are ignored (the stop is bounded: workers
    are terminated, not drained).  Inside :meth:`deferred` a signal waits for the block's
    end, so that a batch's lines are written whole."""

    def __init__(self):
        self.previous = {}
        self.received: Optional[int] = None
        self._depth = 0
        self._pending: Optional[int] = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        return False

    def _handle(self, signum, frame):
        if self.received is not None:
            return  # already stopping
        if self._depth:
            self._pending = signum
            return
        self._raise(signum)

    def _raise(self, signum):
        self.received = signum
        raise StopInterrupt(signum) if signum == signal.SIGINT else StopSignal(signum)

    @contextlib.contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._pending is not None and self.received is None:
            signum, self._pending = self._pending, None
            self._raise(signum)
