"""Fork server for the benchmark suite: ``fairseq-generate`` runs without paying the imports.

Importing torch + fairseq takes seconds (about 7 s on the project's 2-core machine, see
benchmarks/results/NOTES.md, "Import time of torch + fairseq"); a suite of ~150 short runs
would spend a large share of its time importing.  A server imports once (stock fairseq, or fairseq
with the plugin loaded through ``--user-dir`` exactly as the CLI loads it, or stock with
fairseq #4709 fixed), then forks one child per request that runs fairseq's own
``fairseq_cli.generate.cli_main`` with the request's argv, stdout and stderr redirected to
files.  The child is a full ``fairseq-generate`` process minus the import time; its peak RSS
(``os.wait4``) includes the inherited imports, as a fresh process's would.  CPU only: nothing
here initializes CUDA or an OpenMP pool before forking (both are not fork-safe).

Protocol: one JSON request per stdin line ``{"argv": [...], "stdout": path, "stderr": path}``
and optionally ``"stdin": path`` (default: /dev/null) and ``"env": {...}`` (the child's whole
environment; its ``OMP_NUM_THREADS`` sets the child's torch threads, as it would a fresh
process's); one JSON reply per stdout line ``{"code": int, "maxrss_mb": float, "wall": float}``.

    python benchmarks/fork_server.py stock|plugin|fixed [generate|interactive]

The second argument picks the CLI (default generate); one server serves one, since each
configures logging as it is imported.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# fairseq_fastgen.compare.PLUGIN_DIR, not imported from there: importing the package installs
# the plugin, which the stock and fixed servers must not have
PLUGIN_DIR = str(ROOT / "fairseq_fastgen")


def _prepare(mode: str, entry: str) -> None:
    import importlib

    importlib.import_module(f"fairseq_cli.{entry}")  # the import being amortized
    from fairseq import utils

    if mode in ("plugin", "stock-routed"):
        # the same import fairseq does for --user-dir, so the child's own --user-dir is a no-op
        utils.import_user_module(argparse.Namespace(user_dir=PLUGIN_DIR))
    elif mode == "fixed":
        # the reference script patches fairseq's CPU n-gram loop on import (and nothing else)
        import importlib.util

        script = ROOT / "tests" / "scripts" / "stock_generate_fixed_ngram.py"
        spec = importlib.util.spec_from_file_location("stock_generate_fixed_ngram", script)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _child(req, entry: str) -> None:
    code = 0
    try:
        if "env" in req:
            os.environ.clear()
            os.environ.update(req["env"])
            if req["env"].get("OMP_NUM_THREADS"):
                import torch

                torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        sys.stdin = open(req.get("stdin") or os.devnull)
        sys.argv = [f"fairseq-{entry}", *req["argv"]]
        import importlib

        importlib.import_module(f"fairseq_cli.{entry}").cli_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
    except BaseException:  # noqa: BLE001  (report like an uncaught exception would)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # as at a fresh process's exit (multiprocessing's, logging's)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(mode: str, entry: str = "generate") -> None:
    # replies go to the original stdout; anything the imports print goes to stderr
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _prepare(mode, entry)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            _child(req, entry)
        _, status, usage = os.wait4(pid, 0)
        reply.write(json.dumps(dict(code=os.waitstatus_to_exitcode(status),
                                    maxrss_mb=usage.ru_maxrss / 1024,
                                    wall=time.perf_counter() - t0)) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve(*sys.argv[1:3])
