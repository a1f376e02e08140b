"""The generate pipeline's writer: batch texts in batch order, the scorer fed as stock feeds it.

Runs in the main process, so the scorer sees the same calls in the same order as in
stock's loop, and ``tgt_dict.encode_line(..., add_if_not_exist=True)`` grows the
dictionary as in stock (the BLEU line is identical).

A batch's lines are written and flushed as one block (``critical``: the run's signal
deferral, lifecycle.py), so that output cut by a signal, a killed worker or a killed
main process ends on a complete line.
"""
import contextlib
from itertools import accumulate
from typing import Callable, ContextManager, Optional

import numpy as np
import torch

from .records import BatchText, DecodeStats, ScoringInputs


class Writer:
    """Writes batch texts in order and feeds the scorer exactly as stock's loop does."""

    def __init__(self, output_file, scorer, tgt_dict, post_process,
                 critical: Callable[[], ContextManager] = contextlib.nullcontext):
        self.output_file = output_file
        self.critical = critical
        self.scorer = scorer
        self.tgt_dict = tgt_dict
        self.post_process = post_process
        self.add_string = hasattr(scorer, "add_string")
        from fairseq.data import Dictionary
        from fairseq.tokenizer import tokenize_line

        self._dictionary_cls = Dictionary
        self._tokenize_line = tokenize_line

    def _encode(self, line):
        """``tgt_dict.encode_line(line, add_if_not_exist=True)``: same ids, same dictionary
        growth; for fairseq's own Dictionary without a per-word tensor write."""
        d = self.tgt_dict
        if type(d) is not self._dictionary_cls:
            return d.encode_line(line, add_if_not_exist=True)
        ids = [d.add_symbol(w) for w in self._tokenize_line(line)]
        ids.append(d.eos_index)
        return torch.tensor(ids, dtype=torch.int32)

    def write(self, result: BatchText, side: ScoringInputs,
              stats: Optional[DecodeStats] = None) -> None:
        text, score_items = result
        if text:
            with self.critical():
                self.output_file.write(text)
                self.output_file.flush()
        tgt, packed, tok_lens, tok_odd, counts = side
        encode = self._encode
        post_process = self.post_process
        raw = tgt is not None and post_process is None and not self.add_string
        # where each hypothesis's tokens start in ``packed``: (n_hypos + 1,)
        starts = list(accumulate(tok_lens, initial=0)) if raw and tok_odd is None else None
        h = 0
        for i, (target_str, detok_hypo_str, hypo_strs) in enumerate(score_items):
            for j, hypo_str in enumerate(hypo_strs):
                if post_process is not None:
                    # utils.post_process_prediction's re-encoding (it may grow the dict)
                    hypo_tokens = encode(hypo_str)
                if tgt is not None and j == 0:
                    if post_process is not None:
                        target_tokens = encode(target_str)
                        hypo_tokens = encode(detok_hypo_str)
                    if self.add_string:
                        self.scorer.add_string(target_str, detok_hypo_str)
                    else:
                        if post_process is None:
                            target_tokens, hypo_tokens = self._raw_tokens(
                                tgt, i, packed, starts, tok_odd, h)
                        self.scorer.add(target_tokens, hypo_tokens)
                h += 1
        assert h == sum(counts), (h, counts)

    def _raw_tokens(self, tgt, i, packed, starts, tok_odd, h):
        """Stock's scorer inputs without --post-process: the int token tensors."""
        row = torch.from_numpy(tgt[i, :])
        target_tokens = row[row.ne(self.tgt_dict.pad())].int()
        if tok_odd is None:
            hypo_tokens = torch.from_numpy(
                packed[starts[h]:starts[h + 1]].astype(np.int64)).int()
        else:
            hypo_tokens = torch.from_numpy(tok_odd[h])
        return target_tokens, hypo_tokens
