"""``fairseq-generate`` over torchrun's ranks: each rank decodes its share, rank 0 writes.

    torchrun --nproc-per-node N $(command -v fairseq-generate) DATA ... --user-dir fairseq_fastgen

The plugin reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``LOCAL_RANK``) and joins the process group (gloo on CPU; on a GPU, NCCL with objects on a
gloo group, each rank on its ``LOCAL_RANK`` device); stock fairseq-generate on CPU ignores
torchrun and runs the whole data set on every rank.

Sharing: every rank builds the same batches (fairseq's ordering by length, one seed) and
fairseq's iterator gives rank r the batches r, r + N, r + 2N, ... (``num_shards``/
``shard_id``), padding with empty batches so that every rank has as many.  Neighbouring
batches have neighbouring lengths, so the shares cost about the same.  Each rank runs the
pipeline on its share (decoding as in one process, so every hypothesis is the one a single
process computes), and every :data:`WINDOW` local batches the ranks hand their written
batches to rank 0 (one ``gather_object``), which writes them in the single process's batch
order and feeds the scorer in that order.  The exchange lags one window behind the
decoding, so that a rank rarely waits for its own pipeline; it does wait for the slowest
rank, which the closing log line reports (per window and at the end).

Cores: with ``L`` ranks on a machine each rank takes ``cores // L`` torch threads (one
rule, logged); decoding workers are then planned from that count as in one process.  In
bitwise mode every rank keeps one process's count (all cores: byte-identical output, the
cores shared by the ranks).
"""
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch

logger = logging.getLogger("fairseq_fastgen.generate")

WINDOW = 16  # local batches per exchange: few collectives, little text held
FAULT_ENV = "FAIRSEQ_FASTGEN_RANK_FAULT"  # test hook: "R" makes rank R raise at its first batch


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def from_env(environ=os.environ) -> Optional["Ranks"]:
    """torchrun's ranks, or None when not launched by it (or with one process)."""
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    try:
        world = int(environ["WORLD_SIZE"])
        rank = int(environ["RANK"])
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
        local_rank = int(environ.get("LOCAL_RANK", rank % max(local_world, 1)))
    except ValueError as e:
        raise ValueError(f"fairseq-fastgen: torchrun's environment is not numbers ({e}); "
                         "launch with torchrun or unset RANK/WORLD_SIZE") from None
    if world <= 1:
        return None
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise ValueError(f"fairseq-fastgen: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK="
                         f"{local_rank}, LOCAL_WORLD_SIZE={local_world} do not fit together")
    return Ranks(rank, world, local_rank, local_world)


def join(ranks: Ranks, use_cuda: bool):
    """Join torchrun's process group (unless fairseq already did); returns the group that
    carries the text (gloo)."""
    import torch.distributed as dist

    from .lifecycle import watch_parent

    watch_parent()  # a killed torchrun leaves no rank behind
    if dist.is_initialized():  # fairseq's call_main did, on GPUs (NCCL)
        if dist.get_world_size() != ranks.world or dist.get_rank() != ranks.rank:
            raise RuntimeError("fairseq-fastgen: the process group does not match torchrun's "
                               f"RANK/WORLD_SIZE ({dist.get_rank()}/{dist.get_world_size()} vs "
                               f"{ranks.rank}/{ranks.world})")
        return dist.new_group(backend="gloo")
    if use_cuda:
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if use_cuda else "gloo",
                            init_method="env://", rank=ranks.rank, world_size=ranks.world)
    return None  # the default group: gloo for CPU tensors


def leave(group) -> None:
    """The run's last collective: every rank waits for the others, then closes its
    connections (a rank that exits while another still talks to it can make gloo abort
    that one at exit)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=group)
        dist.destroy_process_group()


def threads_per_rank(ranks: Ranks, cores: int, bitwise: bool = False) -> int:
    """``cores // L`` for L ranks on the machine; in bitwise mode the thread count of one
    process (BLAS splits a GEMM by thread count, and with it the last bits)."""
    if bitwise:
        return max(1, cores)
    return max(1, cores // ranks.local_world)


def shard(cfg, ranks: Ranks) -> None:
    """fairseq's own sharding of the batches: rank r gets r, r + N, ..."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.distributed_training.distributed_world_size = ranks.world
        cfg.distributed_training.distributed_rank = ranks.rank


def quiet_logging() -> None:
    """A rank other than 0 writes nothing to stdout: its warnings go to stderr."""
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", level=logging.WARNING, stream=sys.stderr)
    logging.getLogger().setLevel(logging.WARNING)


def planted_fault(ranks: Ranks) -> None:
    """Test hook: raise on the rank that ``FAULT_ENV`` names."""
    if os.environ.get(FAULT_ENV) == str(ranks.rank):
        raise RuntimeError(f"planted fault on rank {ranks.rank} ({FAULT_ENV})")


def gather_ordered(mine: List[Any], ranks: Ranks, group) -> Optional[List[Any]]:
    """Every rank's window of items to rank 0, in the order one process has them: round j
    of every rank before round j + 1, rank by rank (global item ``j * N + r``); a rank's
    None (a round with nothing of its) is left out.  Collective; None on the other ranks."""
    import torch.distributed as dist

    if ranks.world == 1:
        gathered = [mine]
    else:
        gathered = [None] * ranks.world if ranks.leader else None
        dist.gather_object(mine, gathered, dst=0, group=group)
    if not ranks.leader:
        return None
    return [part[j] for j in range(max(len(p) for p in gathered)) for part in gathered
            if j < len(part) and part[j] is not None]


class Exchange:
    """Stands in for the :class:`Writer` on every rank: keeps this rank's written batches,
    hands them to rank 0 a window at a time, where ``writer`` writes them in order."""

    def __init__(self, ranks: Ranks, group, writer=None, resume=None):
        self.ranks = ranks
        self.group = group
        self.writer = writer  # rank 0's Writer
        self.resume = resume  # rank 0's resume.ResumeDir, or None
        self.index = 0  # the next window's number
        self.records: List[tuple] = []  # (result, side) in local batch order, not yet sent
        self.waited = 0.0  # seconds in exchanges (waiting for the slowest rank)
        self.waited_end = 0.0  # of which in the last one

    def write(self, result, side, stats=None) -> None:
        self.records.append((result, side))

    def flush(self, has_record: List[bool], last: bool = False) -> None:
        """One window: has_record[j] says whether local batch j wrote a record (the
        padding batches, and batches without input, do not).  Collective: every rank
        calls it for the same windows."""
        n = sum(has_record)
        mine, self.records = self.records[:n], self.records[n:]
        assert len(mine) == n, f"rank {self.ranks.rank}: {len(mine)} of {n} batches written"
        it = iter(mine)
        payload = [next(it) if has else None for has in has_record]
        t0 = time.perf_counter()
        ordered = gather_ordered(payload, self.ranks, self.group)
        dt = time.perf_counter() - t0
        self.waited += dt
        if last:
            self.waited_end = dt
        if self.ranks.leader:
            if self.resume is not None:
                self.resume.save(self.index, ordered)  # durable before it is written
            for rec in ordered:
                self.writer.write(*rec)
        self.index += 1

    def replay(self):
        """Resume: rank 0 writes the saved windows; every rank learns how many there are.
        Returns (windows, sentences, tokens, has_target) of what was replayed."""
        from . import resume as resume_mod

        n, totals = 0, (0, 0, False)
        if self.ranks.leader and self.resume is not None:
            for window in self.resume.saved():
                for rec in window:
                    self.writer.write(*rec)
                c = resume_mod.counts(window)
                n, totals = n + 1, (totals[0] + c[0], totals[1] + c[1], totals[2] or c[2])
            if n:
                logger.info("resume: %d window(s) of %d batch(es) per rank already written "
                            "(%d sentence(s)), decoding from window %d", n, WINDOW, totals[0], n)
        if self.ranks.world > 1:
            import torch.distributed as dist

            box = [n]
            dist.broadcast_object_list(box, src=0, group=self.group)
            n = box[0]
        self.index = n
        return (n,) + tuple(totals)


class Share:
    """This rank's batches, in order (iterate it in place of the progress bar), and the
    exchanges with the other ranks: while window w is decoded, window w - 2 (written by
    then, almost always; else at a later window) goes to rank 0; :meth:`finish` sends the
    rest."""

    def __init__(self, progress, pool, exchange: Exchange, window: int = WINDOW,
                 skip_windows: int = 0):
        self.progress = progress
        self.skip = skip_windows * window  # local batches a resumed run does not decode
        self.pool = pool
        self.exchange = exchange
        self.ranks = exchange.ranks
        self.window = window
        self.windows: List[List[bool]] = []  # per window not yet flushed: has_record flags
        self.flushed = 0  # records of the windows flushed
        self.batches = 0

    def log(self, stats) -> None:
        self.progress.log(stats)

    def __iter__(self) -> Iterator:
        for j, sample in enumerate(self.progress):
            j -= self.skip
            if j < 0:
                continue  # written by the run this one resumes
            if j == 0:
                planted_fault(self.ranks)
            if j % self.window == 0:
                # window w - 2 once each of its batches reached the pool; with continuous
                # batching a long sentence can hold its batch back: the window then goes
                # at a later boundary (every rank still flushes every window, in order)
                while len(self.windows) >= 2 and (
                        self.pool.submitted >= self.flushed + sum(self.windows[0])):
                    self._flush(self.windows.pop(0), last=False)
                self.windows.append([])
            self.windows[-1].append("net_input" in sample)
            self.batches += "net_input" in sample
            yield sample

    def finish(self) -> None:
        """After this rank's last batch: the windows not yet sent (every rank has as many
        windows: fairseq pads the shares to one length)."""
        while self.windows:
            self._flush(self.windows.pop(0), last=not self.windows)

    def _flush(self, flags: List[bool], last: bool) -> None:
        self.flushed += sum(flags)
        self.pool.finish(upto=self.flushed)
        self.exchange.flush(flags, last=last)


def totals(ranks: Ranks, group, sentences: int, tokens: int, seconds: float,
           has_target: bool, exchange: Exchange, batches: int):
    """Sums over the ranks (sentences, tokens, has_target) and the longest generation
    time; rank 0 logs each rank's share and waits."""
    import torch.distributed as dist

    mine = (sentences, tokens, seconds, bool(has_target), batches, exchange.waited,
            exchange.waited_end)
    if ranks.world == 1:
        return sentences, tokens, seconds, has_target
    every = [None] * ranks.world if ranks.leader else None
    dist.gather_object(mine, every, dst=0, group=group)
    if not ranks.leader:
        return sentences, tokens, seconds, has_target
    for r, (s, _, sec, _, b, w, we) in enumerate(every):
        logger.info("rank %d: %d batch(es), %d sentence(s), %.1fs generating, %.1fs waiting "
                    "for other ranks (%.1fs at the end)", r, b, s, sec, w, we)
    return (sum(e[0] for e in every), sum(e[1] for e in every), max(e[2] for e in every),
            any(e[3] for e in every))
