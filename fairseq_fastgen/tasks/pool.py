"""The generate pipeline's worker processes and the in-order hand-over of their results.

At most ``2 * workers + 2`` batches are in flight (memory stays flat on any input size).
A worker that raises or dies stops the run with an error naming it (no hang); on an
error, SIGTERM or Ctrl-C the caller ends the workers at once (``close(abort=True)``), and
a worker whose parent is gone ends by itself (lifecycle.py).

While the workers live, the main process's Python objects are frozen out of the garbage
collector (:func:`freeze_for_fork`): a collection writes to the header of every object it
visits, which copies each page it touches, in the worker and in the main process alike,
and a forked worker then holds private copies of pages of objects it never uses.
"""
import gc
import multiprocessing as mp
import os
import pickle
import queue
from typing import Any, Callable, Dict, Optional

import torch

from . import lifecycle, workers
from .records import WorkerResult
from .text import WorkerState, process_batch
from .workers import PipelineWorkerError  # noqa: F401 (the error callers catch)

WORKER_NICE = 10  # niceness increment of workers when decoding uses every core

# Called in a worker before each batch; a test hook (see generate.planted_fault).
Fault = Optional[Callable[[], None]]
_IDLE = object()  # the worker's wait for a task timed out


def default_workers(use_cuda: bool = False) -> int:
    """Postprocessing workers when ``--fastgen-tune pipeline_workers`` is 0 (auto).

    The cores that decoding does not use (on CPU: ``torch.get_num_threads()`` of them;
    on a GPU: one for the driving thread), at least 1 and at most 4: one worker keeps up
    with decoding in all but the lightest setups, and on a 2-core machine a single worker
    is what does not take cores away from the decoder.
    """
    busy = 1 if use_cuda else torch.get_num_threads()
    return max(1, min(4, cores() - busy))


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def freeze_for_fork() -> bool:
    """Before forking: collect once, then keep every object alive now out of later
    collections (here and in the children), so the pages they live on stay shared.
    Returns whether this call froze (not when someone else already froze objects)."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True


def _worker_loop(st: WorkerState, tasks, results, parent_pid: int, nice: int,
                 job=None, threads: int = 1, fault: Fault = None, engine=None):
    workers.enter(parent_pid, threads, nice)
    if engine is not None:  # continuous batching over the batches this worker takes
        from .stream_worker import stream_loop

        return stream_loop(st, tasks, results, parent_pid, job, engine, fault)
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            item = _IDLE
        # Checked between batches too, not only when idle: an orphan must not decode the
        # batches still queued, nor wait at exit to hand results to no one.
        if lifecycle.orphaned(parent_pid):
            results.cancel_join_thread()
            return
        if item is _IDLE:
            continue
        if item is None:
            return
        idx, payload = item
        try:
            if fault is not None:
                fault()
            if job is None:  # postprocessing only: the record was decoded in the main process
                result = WorkerResult(process_batch(st, pickle.loads(payload)), None, None)
            else:  # decode the batch here, then postprocess it
                rec, stats = job(pickle.loads(payload))
                result = WorkerResult(process_batch(st, rec), rec.scoring_inputs(), stats)
            results.put((idx, True, result))
        except BaseException:
            results.put((idx, False, workers.failure()))
            return


class Pool:
    """Worker processes and the in-order hand-over of their results.

    Without ``job`` the workers postprocess records decoded in the main process
    (:meth:`submit`); with one (:class:`~fairseq_fastgen.tasks.decode_workers.DecodeJob`)
    each worker decodes the samples it is given (:meth:`submit_sample`) with ``threads``
    torch threads and postprocesses them; with ``engine`` (a
    :class:`~fairseq_fastgen.search.continuous.ContinuousBeamSearch`) each worker decodes
    the batches it takes as one stream (stream_worker.py).  ``on_result(text, scoring,
    stats)`` sees results strictly in submission order.  ``fault`` (tests only) runs in a
    worker before each batch.
    """

    def __init__(self, state: WorkerState, n_workers: int, on_result, use_cuda=False,
                 max_in_flight=None, job=None, threads: int = 1, fault: Fault = None,
                 engine=None):
        ctx = mp.get_context("fork")
        # a streaming worker holds up to two batches while its neighbour finishes the
        # oldest: more in flight keeps the others fed meanwhile
        self.max_in_flight = max_in_flight or (4 if engine is not None else 2) * n_workers + 2
        self.tasks = ctx.Queue(maxsize=self.max_in_flight)
        self.results = ctx.Queue()
        self.on_result = on_result
        self.submitted = 0
        self.written = 0
        self.pending: Dict[int, WorkerResult] = {}
        self.side: Dict[int, Any] = {}
        self.procs = []
        # When decoding already occupies every core (CPU decoding with as many torch threads
        # as cores), workers run at a lower priority: they fill the gaps instead of
        # preempting one of the decoder's OpenMP threads (which stalls all of them).
        nice = WORKER_NICE if (job is None and torch.get_num_threads() >= cores()
                               and not use_cuda) else 0
        kind = "post" if job is None else "dec"  # names of 15 bytes at most (lifecycle)
        self.froze = freeze_for_fork()
        self.kind = "postprocessing worker" if job is None else "decoding worker"
        try:
            for wid in range(n_workers):
                self.procs.append(workers.start(
                    _worker_loop, f"fastgen-{kind}-{wid}",
                    (state, self.tasks, self.results, os.getpid(), nice, job, threads, fault,
                     engine)))
        except BaseException:  # no pool for the caller to close: end what started, unfreeze
            self.close(abort=True)
            raise

    def submit(self, rec) -> None:
        """A batch decoded here (a :class:`BatchRecord`): a worker writes its text."""
        self._put(rec, side=rec.scoring_inputs())  # what only the writer needs stays here

    def submit_sample(self, sample: Dict[str, Any]) -> None:
        """A batch for a decoding worker (host tensors)."""
        self._put(sample, side=None)

    def _put(self, payload, side) -> None:
        while self.submitted - self.written >= self.max_in_flight:
            self._collect(block=True)
        idx = self.submitted
        if side is not None:
            self.side[idx] = side
        self.tasks.put((idx, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)))
        self.submitted += 1
        self._collect(block=False)
        self._check_alive()

    def finish(self, upto: Optional[int] = None) -> None:
        """Wait until every batch submitted (or the first ``upto``) is written."""
        target = self.submitted if upto is None else min(upto, self.submitted)
        while self.written < target:
            self._collect(block=True)

    def _collect(self, block: bool) -> None:
        while True:
            try:
                if block:
                    item = workers.receive(self.results, self.procs, "generate pipeline",
                                           timeout=0.2)
                else:
                    item = self.results.get_nowait()
            except queue.Empty:
                return
            except PipelineWorkerError as e:
                raise PipelineWorkerError(f"{e}; stopping ({self.submitted - self.written} "
                                          f"batch(es) not written)") from None
            idx, ok, result = item
            if not ok:
                raise PipelineWorkerError(
                    f"fairseq-fastgen generate pipeline: a {self.kind} failed on batch "
                    f"{idx}; stopping.\n{result}")
            self.pending[idx] = result
            progressed = False
            while self.written in self.pending:
                idx = self.written
                done = self.pending.pop(idx)
                self.on_result(done.text, self.side.pop(idx, done.scoring), done.stats)
                self.written += 1
                progressed = True
            if block and progressed:
                return

    def _check_alive(self) -> None:
        """A dead worker stops the run now, not when its batch is waited for."""
        if any(p.exitcode is not None for p in self.procs):
            while True:  # what it sent first; then its failure, or how it died, raises
                self._collect(block=True)

    def close(self, abort: bool = False) -> None:
        """Stop the workers: after their queued batches, or at once (``abort``)."""
        if not abort:
            for p in self.procs:
                if p.is_alive():
                    try:
                        self.tasks.put_nowait(None)
                    except (queue.Full, ValueError, OSError):
                        pass
            for p in self.procs:
                p.join(timeout=5.0)
        workers.stop(self.procs, (self.tasks, self.results))
        if self.froze:  # the workers are gone: the main process collects all again
            gc.unfreeze()
            self.froze = False
