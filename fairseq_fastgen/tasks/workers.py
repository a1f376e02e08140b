"""Forked worker processes: the one core every kind of worker runs on.

Generate's postprocessing and decoding workers (pool.py, with stream_worker.py's
continuous-batching loop) and fairseq-interactive's decoding workers
(interactive_workers.py) differ only in what they do with a task.  How they start, die,
report and stop is here, once:

* :func:`start` forks a named daemon process; :func:`enter`, its first call, ties it to
  its parent (it dies with it, lifecycle.py), names it for ``ps`` and error messages,
  leaves Ctrl-C and SIGTERM to the main process and sets its torch threads and niceness.
* A worker that raises sends :func:`failure` (its name, pid and traceback) on its result
  queue and ends; the main process raises :class:`PipelineWorkerError` with it.
* :func:`receive` waits for a worker's message while watching it: a worker dead without
  one is an error naming how it died (:func:`death`), never a hang.
* :func:`stop` ends workers at once (SIGTERM, then SIGKILL): ~2 s at most for all of them.
"""
import multiprocessing as mp
import os
import queue
import signal
import traceback
from typing import Callable, Iterable, Sequence

import torch

from . import lifecycle


class PipelineWorkerError(RuntimeError):
    """A decoding or postprocessing worker raised or died."""


def start(target: Callable, name: str, args: tuple) -> mp.Process:
    """Fork and start a daemon worker named ``name`` (15 bytes at most: lifecycle)."""
    p = mp.get_context("fork").Process(target=target, name=name, args=args, daemon=True)
    p.start()
    return p


def enter(parent_pid: int, threads: int, nice: int = 0) -> None:
    """A worker's first call: die with the main process however it ends; Ctrl-C and
    SIGTERM are the main process's to handle (it ends the workers)."""
    lifecycle.die_with_parent(parent_pid)
    lifecycle.set_process_name(mp.current_process().name)  # what ps and errors call us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the run's handler, inherited by fork
    torch.set_num_threads(threads)
    if nice:
        try:
            os.nice(nice)
        except OSError:  # pragma: no cover
            pass


def failure() -> str:
    """In a worker, inside ``except``: who failed and how, for the main process."""
    return f"{mp.current_process().name} (pid {os.getpid()}):\n{traceback.format_exc()}"


def death(exitcode: int) -> str:
    """How a worker ended, from ``Process.exitcode`` (negative: the signal that killed it)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"died with exit code {exitcode}"


def receive(q, procs: Sequence[mp.Process], what: str, timeout: float = 0.5):
    """The next message on ``q``, which ``procs`` write; :class:`PipelineWorkerError` as
    soon as one of them is dead and ``q`` stays empty (a worker that raised has sent its
    failure before exiting, so that message is still read first).  ``what``: how the
    error names the run, e.g. ``"generate pipeline"``."""
    while True:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            dead = next((p for p in procs if p.exitcode is not None), None)
            if dead is None:
                continue
            try:
                return q.get(timeout=timeout)
            except queue.Empty:
                raise PipelineWorkerError(
                    f"fairseq-fastgen {what}: {kind_of(dead)} {dead.name} (pid {dead.pid}) "
                    f"{death(dead.exitcode)}") from None


def kind_of(p: mp.Process) -> str:
    return "postprocessing worker" if p.name.startswith("fastgen-post") else "decoding worker"


def stop(procs: Iterable[mp.Process], queues: Iterable = ()) -> None:
    """End ``procs`` at once (SIGTERM to all, then wait; SIGKILL what is stuck) and close
    ``queues`` without waiting for their feeder threads."""
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():  # pragma: no cover - a worker stuck in the kernel
            p.kill()
            p.join(timeout=1.0)
    for q in queues:
        q.cancel_join_thread()
        q.close()
