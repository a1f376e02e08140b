"""fairseq-interactive --input FILE in one CPU process with decoding workers
(tasks/interactive_workers.py): stock's lines in input order; a dead worker stops the run."""
import os
import random
import signal
import subprocess
import time

from fairseq_fastgen.compare import generate_command, side_by_side
from test_interactive_ranks import SPANISH, _es_en
from test_ranks_signals import start_until

WORKERS = "fairseq-interactive: 2 decoding worker(s) x 1 torch thread(s)"


def _input(tmp_path, n, seed=0):
    rng = random.Random(seed)
    path = tmp_path / "in.es"
    path.write_text("\n".join(rng.choice(SPANISH) for _ in range(n)) + "\n")
    return path


def test_workers_write_what_stock_writes(tmp_path):
    args = _es_en(_input(tmp_path, 45), ["--beam", "4", "--nbest", "2", "--buffer-size", "7",
                                         "--batch-size", "3", "--max-len-b", "12"])
    res = side_by_side(args, entry="fairseq-interactive", threads=2)
    assert WORKERS in res.plugin[0].stderr
    assert res.comparison.lossless, res.comparison.differences[:5]
    ids = [int(l.split("\t")[0][2:]) for l in res.plugin[0].stdout.splitlines() if l.startswith("S-")]
    assert ids == list(range(45))
    # one worker: fairseq's loop, said once
    one = side_by_side(args, entry="fairseq-interactive", threads=1)
    assert "fairseq-interactive: fairseq's loop, decoding in the main process (one torch thread)" \
        in one.plugin[0].stderr


def test_a_killed_worker_stops_the_run(tmp_path):
    args = _es_en(_input(tmp_path, 400), ["--beam", "2", "--buffer-size", "2", "--batch-size", "2",
                                          "--max-len-b", "6"])
    cmd, env = generate_command(args, plugin=True, entry="fairseq-interactive", threads=2)
    p, out, err = start_until(cmd, env, tmp_path, 10)
    try:
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        workers = [int(k) for k in kids
                   if open(f"/proc/{k}/comm").read().startswith("fastgen-dec-")]
        assert workers, kids
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = p.wait(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    log = err.read_text()
    assert code == 1, log[-2000:]
    assert f"(pid {workers[0]}) was killed by SIGKILL" in log, log[-2000:]
    assert out.read_text().endswith("\n")
    time.sleep(1)
    left = subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert not left
