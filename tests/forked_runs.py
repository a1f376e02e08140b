"""The tests' ``fairseq-generate`` / ``fairseq-interactive`` runs forked from import servers.

Importing torch + fairseq costs seconds per process, and the gate starts a few hundred:
most of its time went to imports.  :class:`ForkedRuns` stands in for
``fairseq_fastgen.compare.run_measured`` (conftest.py swaps it in for the session): a run of
the venv's ``fairseq-generate`` or ``fairseq-interactive`` console script becomes a request
to benchmarks/fork_server.py (one server per CLI and stock/plugin, started at first use),
which forks a child that runs the CLI's ``cli_main`` with the run's argv, environment,
stdin, stdout and stderr; its exit status and peak RSS are the child's.  Any other command
(torchrun, a launcher script, python -c) runs as before.  ``FASTGEN_TEST_FRESH_PROCESSES=1``
turns this off.  Tests that signal or inspect a process tree start their own processes.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence

from fairseq_fastgen.compare import PLUGIN_DIR

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "benchmarks" / "fork_server.py"
BIN = Path(sys.executable).parent
ENTRIES = {str(BIN / "fairseq-generate"): "generate",
           str(BIN / "fairseq-interactive"): "interactive"}
OFF = "FASTGEN_TEST_FRESH_PROCESSES"


class ForkedRuns:
    """``run_measured(cmd, env, stdin)``, with the CLI runs forked from import servers."""

    def __init__(self, fresh):
        self.fresh = fresh  # the replaced run_measured
        self.servers: Dict[tuple, subprocess.Popen] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="fastgen-forked-"))
        self.requests = 0

    def __call__(self, cmd: Sequence[str], env: Dict[str, str], stdin: Optional[str]):
        entry = ENTRIES.get(str(cmd[0]))
        if entry is None:
            return self.fresh(cmd, env, stdin)
        mode = "plugin" if PLUGIN_DIR in cmd else "stock"
        self.requests += 1
        base = self.scratch / str(self.requests)
        paths = {k: f"{base}.{k}" for k in ("stdout", "stderr", "stdin")}
        req = dict(argv=list(cmd[1:]), env=dict(env), stdout=paths["stdout"],
                   stderr=paths["stderr"])
        if stdin is not None:
            Path(paths["stdin"]).write_text(stdin)
            req["stdin"] = paths["stdin"]
        server = self._server(mode, entry)
        server.stdin.write(json.dumps(req) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server {mode} {entry} died")
        rep = json.loads(line)
        out, err = (Path(paths[k]).read_text() for k in ("stdout", "stderr"))
        for p in paths.values():
            Path(p).unlink(missing_ok=True)
        return out, err, rep["code"], rep["maxrss_mb"]

    def _server(self, mode: str, entry: str) -> subprocess.Popen:
        key = (mode, entry)
        if key not in self.servers:
            self.servers[key] = subprocess.Popen(
                [sys.executable, str(SERVER), mode, entry], text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self.servers[key]

    def close(self) -> None:
        for p in self.servers.values():
            p.stdin.close()
            p.wait()
        self.servers = {}
        shutil.rmtree(self.scratch, ignore_errors=True)
