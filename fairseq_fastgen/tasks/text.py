"""The text of a decoded batch: packed where it was decoded, written out in a worker.

:func:`pack_batch` (decoding side) turns the hypotheses into a :class:`BatchRecord` with
ONE device-to-host copy; :func:`process_batch` (a worker) runs stock's per-sentence code
of ``fairseq_cli/generate.py::_main`` on it: ``Dictionary.string`` as
``utils.post_process_prediction`` calls it, the task's BPE and tokenizer ``decode``, the
same format strings.  fairseq's own ``Dictionary`` gets lists of ints instead of tensors
(same strings, an order of magnitude faster).
"""
import math
from typing import Any, Dict, List

import numpy as np
import torch

from .records import BatchRecord, BatchText

_LN2 = math.log(2)


class WorkerState:
    """What the text code needs; inherited by the workers through fork (never pickled)."""

    def __init__(self, src_dict, tgt_dict, tokenizer, bpe, post_process, quiet,
                 print_alignment, print_step, retain_iter_history, strip):
        from fairseq.data import Dictionary

        self.src_dict = src_dict
        self.tgt_dict = tgt_dict
        self.tokenizer = tokenizer
        self.bpe = bpe
        self.post_process = post_process
        self.quiet = quiet
        self.print_alignment = print_alignment
        self.print_step = print_step
        self.retain_iter_history = retain_iter_history
        self.strip = strip
        # fairseq's own Dictionary gives the same strings for a list of ints as for a
        # tensor, an order of magnitude faster; other dictionaries get tensors as in stock
        self.src_lists = type(src_dict) is Dictionary
        self.tgt_lists = type(tgt_dict) is Dictionary

    def decode_fn(self, x):
        if self.bpe is not None:
            x = self.bpe.decode(x)
        if self.tokenizer is not None:
            x = self.tokenizer.decode(x)
        return x


# ---- decoding side: one record per batch -------------------------------------------

def _is_packable_1d(t, kinds) -> bool:
    return torch.is_tensor(t) and t.dim() == 1 and (
        t.is_floating_point() if kinds == "float" else not t.is_floating_point())


def pack_batch(host_sample: Dict[str, Any], hypos, nbest: int, quiet: bool,
               state: WorkerState) -> BatchRecord:
    """One picklable record per batch; ONE device-to-host copy of the packed numbers.

    ``hypos``: (bsz,) lists of hypothesis dicts as ``task.inference_step`` returns them.
    Scores are divided by ln 2 exactly as stock does (``tensor / math.log(2)`` in the
    tensor's own dtype, on its device: the same elementwise kernel for a 0-d tensor and a
    vector); the quotient is widened to float64 (exact) only to share the copy with the
    tokens.  Hypotheses whose fields are not the usual tensors are formatted here, with
    stock's own expressions.
    """
    kept = [list(h[:nbest]) for h in hypos]
    flat = [h for hs in kept for h in hs]
    net_input = host_sample["net_input"]
    src = (net_input["src_tokens"].numpy()
           if "src_tokens" in net_input and state.src_dict is not None else None)
    target = host_sample["target"]
    rec = BatchRecord(ids=host_sample["id"].tolist(), counts=[len(hs) for hs in kept],
                      src=src, tgt=target.numpy() if target is not None else None,
                      packed=np.zeros(0), tok_lens=[])

    pieces: List[torch.Tensor] = []
    toks = [h["tokens"] for h in flat]
    if toks and all(_is_packable_1d(t, "int") for t in toks):
        rec.tok_lens = [t.numel() for t in toks]
        pieces.append(torch.cat(toks).double())
    else:
        rec.tok_lens = [0] * len(toks)
        rec.tok_odd = [t.int().cpu().numpy() for t in toks]
    if not quiet and flat:
        _pack_scores(rec, flat, pieces, state)
    if pieces:
        devices = {p.device for p in pieces}
        if len(devices) > 1:
            pieces = [p.cpu() for p in pieces]
        rec.packed = torch.cat(pieces).cpu().numpy()  # the one device-to-host copy
    return rec


def _pack_scores(rec: BatchRecord, flat, pieces: List[torch.Tensor], state: WorkerState) -> None:
    """Scores, positional scores and the optional per-hypothesis fields of ``flat``."""
    scores = [h["score"] for h in flat]
    if all(torch.is_tensor(s) and s.dim() == 0 and s.is_floating_point() for s in scores) \
            and len({s.dtype for s in scores}) == 1 and len({s.device for s in scores}) == 1:
        pieces.append((torch.stack(scores) / _LN2).double())
        rec.n_scores = len(scores)
    else:
        rec.score_strs = ["{}".format(s / _LN2) for s in scores]
    pos = [h["positional_scores"] for h in flat]
    if all(_is_packable_1d(p, "float") for p in pos) and len({p.dtype for p in pos}) == 1 \
            and len({p.device for p in pos}) == 1:
        rec.pos_lens = [p.numel() for p in pos]
        pieces.append((torch.cat(pos) / _LN2).double())
    else:
        rec.pos_strs = [" ".join(map(lambda x: "{:.4f}".format(x), p.div_(_LN2).tolist()))
                        for p in pos]
    if state.print_alignment:
        rec.alignment = [h["alignment"] for h in flat]
    if state.print_step:
        rec.steps = ["{}".format(h["steps"]) for h in flat]
    if state.retain_iter_history:
        rec.history = [[x["tokens"].int().cpu().numpy() for x in h["history"]] for h in flat]


# ---- worker side: stock's per-sentence text code -----------------------------------

def _as_tokens(arr: np.ndarray, as_list: bool, to_int: bool):
    if as_list:
        return arr.tolist()
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.int() if to_int else t


def process_batch(st: WorkerState, rec: BatchRecord) -> BatchText:
    """The text of one batch (stock's per-sentence loop) and the scorer's strings."""
    out: List[str] = []
    score_items = []
    pad = st.tgt_dict.pad()
    packed = rec.packed
    tok_lens = rec.tok_lens
    n_tok = sum(tok_lens)
    tokens = packed[:n_tok].astype(np.int64)
    scores = packed[n_tok:n_tok + rec.n_scores].tolist()
    pos = packed[n_tok + rec.n_scores:]
    tok_off = pos_off = 0
    h = 0  # flat hypothesis index
    src, tgt = rec.src, rec.tgt
    has_target = tgt is not None
    quiet = st.quiet
    for i, sample_id in enumerate(rec.ids):
        if src is not None:
            row = src[i, :]
            src_tokens = _as_tokens(row[row != pad], st.src_lists, to_int=False)
        else:
            src_tokens = None
        if has_target:
            row = tgt[i, :]
            target_tokens = _as_tokens(row[row != pad], st.tgt_lists, to_int=True)

        if st.src_dict is not None:
            src_str = st.src_dict.string(src_tokens, st.post_process)
        else:
            src_str = ""
        if has_target:
            target_str = st.tgt_dict.string(
                target_tokens, st.post_process, escape_unk=True,
                extra_symbols_to_ignore=st.strip)
        src_str = st.decode_fn(src_str)
        if has_target:
            target_str = st.decode_fn(target_str)

        if not quiet:
            if st.src_dict is not None:
                out.append("S-{}\t{}\n".format(sample_id, src_str))
            if has_target:
                out.append("T-{}\t{}\n".format(sample_id, target_str))

        hypo_strs = []
        detok0 = None
        for j in range(rec.counts[i]):
            if rec.tok_odd is None:
                n = tok_lens[h]
                hypo_tokens = _as_tokens(tokens[tok_off:tok_off + n], st.tgt_lists, to_int=True)
                tok_off += n
            else:
                hypo_tokens = _as_tokens(rec.tok_odd[h], st.tgt_lists, to_int=True)
            # = utils.post_process_prediction(...)[1] with align_dict None (the pipeline's
            # case); its re-encoding of hypo_str (which may grow the dictionary) is replayed
            # by the writer in the main process, in stock's order.
            hypo_str = st.tgt_dict.string(
                hypo_tokens, st.post_process, extra_symbols_to_ignore=st.strip)
            detok_hypo_str = st.decode_fn(hypo_str)
            hypo_strs.append(hypo_str)
            if j == 0:
                detok0 = detok_hypo_str
            if not quiet:
                if rec.pos_strs is None:
                    n = rec.pos_lens[h]
                    p = " ".join(map(lambda x: "{:.4f}".format(x), pos[pos_off:pos_off + n].tolist()))
                    pos_off += n
                else:
                    p = rec.pos_strs[h]
                score = "{}".format(scores[h]) if rec.score_strs is None else rec.score_strs[h]
                _hypothesis_lines(out, st, rec, h, sample_id, score, hypo_str, detok_hypo_str,
                                  p, src_str)
            h += 1
        score_items.append((target_str if has_target else None, detok0, hypo_strs))
    return BatchText("".join(out), score_items)


def _hypothesis_lines(out: List[str], st: WorkerState, rec: BatchRecord, h: int, sample_id,
                      score: str, hypo_str: str, detok_hypo_str: str, p: str,
                      src_str: str) -> None:
    """Stock's H/D/P/A/I/E lines of hypothesis ``h`` (flat index) of the batch."""
    out.append("H-{}\t{}\t{}\n".format(sample_id, score, hypo_str))
    out.append("D-{}\t{}\t{}\n".format(sample_id, score, detok_hypo_str))
    out.append("P-{}\t{}\n".format(sample_id, p))
    alignment = rec.alignment[h] if rec.alignment is not None else None
    if st.print_alignment == "hard":
        out.append("A-{}\t{}\n".format(sample_id, " ".join(
            ["{}-{}".format(src_idx, tgt_idx) for src_idx, tgt_idx in alignment])))
    if st.print_alignment == "soft":
        out.append("A-{}\t{}\n".format(sample_id, " ".join(
            [",".join(src_probs) for src_probs in alignment])))
    if st.print_step:
        out.append("I-{}\t{}\n".format(sample_id, rec.steps[h]))
    if st.retain_iter_history:
        from fairseq import utils

        for step, hist in enumerate(rec.history[h]):
            _, h_str, _ = utils.post_process_prediction(
                hypo_tokens=torch.from_numpy(hist), src_str=src_str,
                alignment=None, align_dict=None, tgt_dict=st.tgt_dict,
                remove_bpe=None,
            )
            out.append("E-{}_{}\t{}\n".format(sample_id, step, h_str))
