"""A decoding worker that decodes the batches it takes as one stream (continuous batching).

With decoding workers (decode_workers.py) and the continuous-batching engine
(search/continuous), each worker runs the engine over the batches it takes from the
shared task queue: when one of its sentences finishes, the next sentence takes its rows,
and a batch goes back (decoded and turned into text) as soon as all of its sentences are
done, tagged with its index so that the main process writes batches in order.

No deadlock, no stall: the main process sends a batch only while fewer than
``max_in_flight`` are unwritten, and waits for the oldest.  A worker waits on the queue
only when it has nothing in flight; with sentences in flight it only looks (``take(wait=
False)``) and otherwise steps them.  So every batch a worker holds is finished without
more input, and the oldest unwritten batch is either held by a worker (it finishes) or
queued (the first worker with room takes it).

A batch's ``DecodeStats.seconds`` is the worker's time since its previous batch went
out, the time it waited for input excluded (batches in flight share steps, so a batch
has no decoding time of its own); their sum is the worker's busy time.
"""
import pickle
import queue
import time
from collections import deque
from typing import Any, Deque, Dict, Optional, Tuple

from . import lifecycle, workers
from .records import DecodeStats, WorkerResult
from .text import process_batch


_EMPTY = object()


class Orphaned(Exception):
    """The main process is gone: the worker ends without decoding more."""


class TaskFeed:
    """The engine's feed (search.continuous.Feed) over a worker's task queue."""

    def __init__(self, tasks, parent_pid: int, job, fault=None):
        self.tasks = tasks
        self.parent_pid = parent_pid
        self.job = job
        self.fault = fault
        self.index_of: Dict[int, int] = {}  # id(sample) -> batch index
        self.open: Deque[int] = deque()  # indices taken and not yet out, in order
        self.waited = 0.0  # seconds spent waiting for a task

    def take(self, wait: bool) -> Optional[Tuple[Dict[str, Any], Any]]:
        while True:
            t0 = time.perf_counter()
            try:
                item = self.tasks.get(timeout=1.0) if wait else self.tasks.get_nowait()
            except queue.Empty:
                item = _EMPTY
            finally:
                self.waited += time.perf_counter() - t0
            # checked at every look, not only when idle: an orphan must not go on decoding
            if lifecycle.orphaned(self.parent_pid):
                raise Orphaned()
            if item is _EMPTY:
                if not wait:
                    return None
                continue
            if item is None:  # Pool.close: no more batches
                raise StopIteration
            idx, payload = item
            self.open.append(idx)
            if self.fault is not None:
                self.fault()
            sample = pickle.loads(payload)
            self.index_of[id(sample)] = idx
            return sample, self.job.prefix(sample)

    def done(self, sample) -> int:
        idx = self.index_of.pop(id(sample))
        self.open.remove(idx)
        return idx


def stream_loop(st, tasks, results, parent_pid: int, job, engine, fault=None) -> None:
    """Decode every batch this worker takes through ``engine``; results as _worker_loop's."""
    feed = TaskFeed(tasks, parent_pid, job, fault)
    busy_from = time.perf_counter()
    waited = 0.0
    try:
        for sample, hypos in engine.run(feed):
            idx = feed.done(sample)
            now = time.perf_counter()
            seconds = now - busy_from - (feed.waited - waited)
            busy_from, waited = now, feed.waited
            rec = job.pack(sample, hypos)
            tokens = sum(len(h[0]["tokens"]) for h in hypos)
            stats = DecodeStats(tokens, seconds, sample["id"].numel())
            results.put((idx, True, WorkerResult(process_batch(st, rec), rec.scoring_inputs(),
                                                 stats)))
    except Orphaned:
        results.cancel_join_thread()
    except BaseException:
        idx = feed.open[0] if feed.open else -1
        results.put((idx, False, workers.failure()))
