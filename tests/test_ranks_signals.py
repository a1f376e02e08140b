"""Ctrl-C, SIGTERM and SIGKILL of torchrun: every rank ends, whole lines, in order
(issue 17, item 5).

torchrun starts each rank in a session of its own, so a terminal's Ctrl-C reaches only
the launcher, which passes the signal on to the ranks; a killed launcher passes nothing
(the ranks watch for it, lifecycle.watch_parent).  The ranks are found by a tag in their
environment.
"""
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import bundled
from fairseq_fastgen.compare import generate_command, run_generate

GENERATE = str(Path(sys.executable).parent / "fairseq-generate")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            GENERATE]
# all 1,000 verses, 500 batches of 2, short hypotheses: rank 0 writes from ~100 batches on
ARGS = bundled("es-en").args + ["--beam", "1", "--batch-size", "2",
                                "--required-batch-size-multiple", "1", "--max-len-a", "0",
                                "--max-len-b", "4"]
SURVIVAL_S = 15.0
TAG = "FASTGEN_TEST_TAG"


def _tagged(tag: str):
    """pids of live processes whose environment carries ``TAG=tag``."""
    found = []
    needle = f"{TAG}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if needle in env and state not in "ZX":
            found.append(int(entry))
    return found


def _lines(text: str):
    """Per-sentence lines without scores (ranks have fewer torch threads than one process)."""
    out = []
    for line in text.splitlines():
        if line[:2] in ("S-", "T-", "H-", "D-"):
            f = line.split("\t")
            out.append("\t".join(f[:1] + f[2:]) if f[0][:2] in ("H-", "D-") else line)
    return out


def start_until(cmd, env, tmp_path: Path, hypotheses: int):
    """Start ``cmd`` in a session of its own, output to files; return once ``hypotheses``
    H- lines are written: (process, stdout path, stderr path)."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, start_new_session=True)
    deadline = time.monotonic() + 240
    while out.read_text(errors="replace").count("\nH-") < hypotheses:
        if p.poll() is not None or time.monotonic() > deadline:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(err.read_text()[-3000:])
        time.sleep(0.05)
    return p, out, err


@pytest.fixture(scope="module")
def reference():
    """Stock fairseq-generate's output: the lines a stopped run must have begun with."""
    r = run_generate(ARGS, plugin=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=["ctrl-c", "sigterm", "sigkill"])
def test_signal_to_torchrun_ends_every_rank(reference, tmp_path, signum):
    tag = uuid.uuid4().hex
    cmd, env = generate_command(ARGS, plugin=True, program=TORCHRUN, env={TAG: tag})
    p, out, err = start_until(cmd, env, tmp_path, 100)
    try:
        ranks = [pid for pid in _tagged(tag) if pid != p.pid]
        assert len(ranks) >= 2, ranks
        p.send_signal(signum)
        code = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    ended = time.monotonic()
    while _tagged(tag) and time.monotonic() - ended < SURVIVAL_S:
        time.sleep(0.1)
    survivors = _tagged(tag)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    log = err.read_text(errors="replace")
    assert not survivors, (survivors, log[-3000:])
    assert code != 0
    text = out.read_text()
    assert text.endswith("\n"), text[-200:]
    got, want = _lines(text), _lines(reference)
    assert 100 <= len(got) < len(want) and got == want[:len(got)]
    if signum == signal.SIGKILL:
        assert "the launcher (pid" in log
    else:  # torchrun passed the signal on: the ranks stopped with whole lines
        name = signal.Signals(signum).name
        assert re.search(rf"stopped by {name}; workers ended", log), log[-3000:]
