"""Resumable ``fairseq-generate`` (``--fastgen-resume-dir DIR``): finished windows of
batches are kept as they are written; the same command started again skips them.

The unit is the exchange window of ranks.py (each rank's next ``WINDOW`` batches; one
process is one rank).  Rank 0, when it writes a window, first saves its records (text and
scorer inputs, in output order) as ``DIR/window-NNNNNN.pkl``: written to a temporary file,
fsync'ed, renamed, the directory fsync'ed, so a window file is whole or absent however the
run ends.  A restart replays the saved windows (output and scorer, as if decoded), tells
every rank how many there are, and the ranks decode from the first window missing; the
final output equals an uninterrupted run's, with no line lost, doubled or moved.

``DIR/run.json`` holds what must not change between the runs: the options that decide the
batches and the hypotheses (task, data, generation, fastgen), the checkpoint and data files
(size and modification time), the number of ranks and the window size.  A restart whose
command differs is refused, naming the keys that differ; start with an empty directory for
a new run.  Only rank 0 reads and writes the directory (other machines need no shared file
system).
"""
import glob
import itertools
import json
import os
import pickle
from typing import Any, Dict, Iterator, List, Tuple

RUN_FILE = "run.json"
WINDOW_FILE = "window-{:06d}.pkl"

# cfg sections (and keys dropped from them) that do not change the output's lines
_NOT_OUTPUT = {"dataset": {"num_workers", "data_buffer_size"},
               "common_eval": {"results_path"},
               "common": {"log_format", "log_interval", "log_file", "no_progress_bar",
                          "tensorboard_logdir", "wandb_project", "aim_repo", "aim_run_hash",
                          "azureml_logging"}}
_SECTIONS = ("task", "dataset", "generation", "common_eval", "common", "scoring", "bpe",
             "tokenizer")


class ResumeMismatch(RuntimeError):
    """The resume directory belongs to another command."""


def _files(paths: List[str]) -> Dict[str, List[int]]:
    out = {}
    for p in paths:
        try:
            st = os.stat(p)
            out[os.path.abspath(p)] = [st.st_size, st.st_mtime_ns]
        except OSError:
            out[os.path.abspath(p)] = [-1, -1]
    return out


def fingerprint(cfg, fastgen, world: int, window: int) -> Dict[str, Any]:
    """What a restart must share with the run that wrote the directory (JSON-able)."""
    from omegaconf import OmegaConf

    fp: Dict[str, Any] = {}
    for name in _SECTIONS:
        sec = cfg.get(name) if hasattr(cfg, "get") else None
        if sec is None:
            continue
        d = OmegaConf.to_container(sec, resolve=True) if OmegaConf.is_config(sec) else sec
        if isinstance(d, dict):
            for k in _NOT_OUTPUT.get(name, ()):
                d.pop(k, None)
        fp[name] = d
    fp["fastgen"] = {k: v for k, v in fastgen.to_dict().items()
                     if k not in ("resume_dir", "log_fallbacks", "pipeline_workers")}
    data = str(cfg.task.data).split(os.pathsep)[0] if cfg.task.get("data") else ""
    subset = cfg.dataset.gen_subset
    fp["checkpoints"] = _files(str(cfg.common_eval.path).split(os.pathsep))
    fp["data_files"] = _files(sorted(glob.glob(os.path.join(data, f"{subset}.*"))))
    fp["ranks"] = world
    fp["window"] = window
    return json.loads(json.dumps(fp, default=str))


def _differences(old: Dict[str, Any], new: Dict[str, Any], prefix="") -> List[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} before, {b!r} now")
    return out


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


class ResumeDir:
    """Rank 0's view of ``--fastgen-resume-dir``."""

    def __init__(self, path: str, fp: Dict[str, Any]):
        self.path = path
        os.makedirs(path, exist_ok=True)
        run = os.path.join(path, RUN_FILE)
        if os.path.exists(run):
            with open(run, encoding="utf-8") as f:
                old = json.load(f)
            diff = _differences(old, fp)
            if diff:
                raise ResumeMismatch(
                    f"--fastgen-resume-dir {path} holds the progress of another command "
                    f"({len(diff)} difference(s): {'; '.join(diff[:5])}); run the same command "
                    "again to resume it, or give an empty directory for this one")
        else:
            _atomic_write(run, json.dumps(fp, indent=1, sort_keys=True).encode())
        for stale in glob.glob(os.path.join(path, "*.tmp-*")):  # a killed write
            os.remove(stale)

    def saved(self) -> Iterator[List[Tuple[Any, Any]]]:
        """The windows saved so far, from the first, up to the first one missing; one at
        a time (a long run's text is not held at once)."""
        for i in itertools.count():
            p = os.path.join(self.path, WINDOW_FILE.format(i))
            if not os.path.exists(p):
                return
            with open(p, "rb") as f:
                yield pickle.load(f)

    def save(self, index: int, records: List[Tuple[Any, Any]]) -> None:
        """records: (text, scorer inputs) of window ``index``, in output order."""
        _atomic_write(os.path.join(self.path, WINDOW_FILE.format(index)),
                      pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL))


def counts(records: List[Tuple[Any, Any]]) -> Tuple[int, int, bool]:
    """(sentences, tokens of each sentence's best hypothesis, had targets) of records, as
    the meters count them when the batches are decoded."""
    sentences = tokens = 0
    has_target = False
    for result, side in records:
        tgt, _, tok_lens, tok_odd, per_sentence = side
        h = 0
        for n in per_sentence:
            if n:
                tokens += len(tok_odd[h]) if tok_odd is not None else tok_lens[h]
            h += n
        sentences += len(per_sentence)
        has_target |= tgt is not None
    return sentences, tokens, has_target
