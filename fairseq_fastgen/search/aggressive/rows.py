"""The per-row state of a batch under block verification, pruned as one record."""
from dataclasses import dataclass, fields
from typing import Optional

from torch import Tensor


@dataclass
class Rows:
    """Rows still decoding (n of them); finished rows leave with :meth:`keep`."""
    tokens: Tensor  # (n, max_len+2+W) int64 hypotheses, BOS first, W spare columns
    cum_hist: Tensor  # (n, max_len+1+W) float32 running score after each step
    t: Tensor  # (n,) int64 tokens generated so far
    cum: Tensor  # (n,) float32 running score
    acc_s: Tensor  # (n,) float32 decayed count of accepted draft positions
    acc_f: Tensor  # (n,) float32 decayed count of rejected draft positions
    orig: Tensor  # (n,) int64 sentence of the batch
    last_tok: Tensor  # (n, 1) int64 last token
    src_lengths: Tensor  # (n,) int64
    prefix_tokens: Optional[Tensor]  # (n, P) int64 or None

    def keep(self, idx: Tensor) -> "Rows":
        """The rows idx: (k,) int64, in that order."""
        return Rows(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx])
                       for f in fields(self)})
