"""Finished hypotheses of block verification, exactly as fairseq's ``finalize_hypos``."""
import math
from typing import Dict, List

import torch
from torch import Tensor

from ..step_rules import StepRules


def finalize_rows(finalized: List[List[Dict[str, Tensor]]], rules: StepRules, tokens: Tensor,
                  cum_hist: Tensor, lengths: List[int], sents: List[int],
                  src_lens: List[int]) -> None:
    """Append each finished row's hypothesis to ``finalized[sent]``.

    tokens: (f, W) their rows (BOS first); cum_hist: (f, W') running scores; lengths:
    tokens of each (eos included); sents: their sentence; src_lens: source lengths."""
    steps = torch.tensor(lengths, device=tokens.device) - 1
    toks = tokens[:, 1:].scatter_(1, steps.unsqueeze(1), rules.eos)
    # positional scores: differences of the running scores (float32, as stock)
    pos = torch.cat([cum_hist[:, :1], cum_hist[:, 1:] - cum_hist[:, :-1]], dim=1)
    scores = cum_hist.gather(1, steps.unsqueeze(1)).squeeze(1)
    for i, (n_tok, sent, src_len) in enumerate(zip(lengths, sents, src_lens)):
        step = n_tok - 1
        score = scores[i]
        if rules.normalize_scores:
            score = score / (step + 1) ** rules.len_penalty
        if rules.match_source_len and step > src_len:
            score = torch.tensor(-math.inf)
        finalized[sent].append({
            "tokens": toks[i, :n_tok],
            "score": score,
            "attention": torch.empty(0),
            "alignment": torch.empty(0),
            "positional_scores": pos[i, :n_tok],
        })
