"""What crosses processes in the generate pipeline: one decoded batch and what comes back.

A :class:`BatchRecord` is made where a batch is decoded (``text.pack_batch``) and read by
the worker that writes its text (``text.process_batch``); the worker sends back a
:class:`WorkerResult`, which the main process hands to the writer in batch order.
Everything here is host memory and picklable.
"""
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Tuple

import numpy as np


class DecodeStats(NamedTuple):
    """One batch's share of stock's generation meters."""

    tokens: int  # tokens of each sentence's best hypothesis (stock's ``gen_timer.n``)
    seconds: float  # ``task.inference_step`` alone, timed as stock times it
    sentences: int


@dataclass
class BatchRecord:
    """One decoded batch, as its text needs it.

    ``packed`` is the ONE device-to-host copy of the numbers, float64, laid out as
    ``[tokens of every hypothesis | n_scores scores | positional scores of every
    hypothesis]`` (hypotheses flat, sentence-major); a field that could not be packed
    (not the usual tensors) comes preformatted in its ``*_strs`` / ``tok_odd`` list instead.
    """

    ids: List[int]  # (bsz,) sample ids
    counts: List[int]  # (bsz,) hypotheses kept per sentence (at most --nbest)
    src: Optional[np.ndarray]  # (bsz, src_len) padded source rows; None without a source dict
    tgt: Optional[np.ndarray]  # (bsz, tgt_len) padded target rows; None without targets
    packed: np.ndarray  # (sum(tok_lens) + n_scores + sum(pos_lens),) float64
    tok_lens: List[int]  # (n_hypos,) token count of each hypothesis in ``packed`` (0: in tok_odd)
    tok_odd: Optional[List[np.ndarray]] = None  # (n_hypos,) int32 tokens when not packable
    n_scores: int = 0  # scores in ``packed`` (0: in score_strs, or --quiet)
    score_strs: Optional[List[str]] = None  # (n_hypos,) formatted scores when not packable
    pos_lens: List[int] = field(default_factory=list)  # (n_hypos,) positional scores in packed
    pos_strs: Optional[List[str]] = None  # (n_hypos,) formatted P- lines when not packable
    alignment: Optional[list] = None  # (n_hypos,) with --print-alignment
    steps: Optional[List[str]] = None  # (n_hypos,) with --print-step
    history: Optional[List[List[np.ndarray]]] = None  # (n_hypos,) with --retain-iter-history

    def scoring_inputs(self) -> "ScoringInputs":
        return ScoringInputs(self.tgt, self.packed, self.tok_lens, self.tok_odd, self.counts)


class ScoringInputs(NamedTuple):
    """What the writer needs of a batch besides its text: the raw token ids a scorer gets
    without ``--post-process`` (kept in the main process when the batch was decoded there)."""

    tgt: Optional[np.ndarray]  # (bsz, tgt_len)
    packed: np.ndarray
    tok_lens: List[int]
    tok_odd: Optional[List[np.ndarray]]
    counts: List[int]


# (target string or None, detokenized best hypothesis, hypothesis strings) per sentence
ScoreItem = Tuple[Optional[str], Optional[str], List[str]]


class BatchText(NamedTuple):
    """The S/T/H/D/P/A/I/E lines of one batch and the strings its scoring needs."""

    text: str
    score_items: List[ScoreItem]  # (bsz,)


class WorkerResult(NamedTuple):
    """What a worker sends back for one batch."""

    text: BatchText
    scoring: Optional[ScoringInputs]  # None: the main process kept them (it decoded the batch)
    stats: Optional[DecodeStats]  # None: decoded in the main process, which counted it
