"""Acceptance statistics of aggressive decoding (cumulative over a generator's batches)."""
from typing import Dict


class AcceptanceStats:
    def __init__(self):
        self.sentences = 0
        self.passes = 0  # decoder block passes
        self.row_steps = 0  # (row, pass) pairs: verification steps
        self.tokens = 0  # tokens produced
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # draft tokens accepted
        self.near_ties = 0  # positions re-done because of a near tie
        self.plain_batches = 0  # batches the regular greedy step decoded (faster there)

    def as_dict(self) -> Dict[str, float]:
        d = dict(self.__dict__)
        d["mean_accepted_per_step"] = self.tokens / max(self.row_steps, 1)
        d["draft_acceptance_rate"] = self.accepted / max(self.drafted, 1)
        d["tokens_per_pass"] = self.tokens / max(self.passes, 1)
        return d

    def __str__(self):
        d = self.as_dict()
        return (f"aggressive decoding: {self.sentences} sentences, {self.tokens} tokens in "
                f"{self.row_steps} verification steps ({d['mean_accepted_per_step']:.2f} tokens/step), "
                f"{self.passes} decoder passes, draft acceptance {d['draft_acceptance_rate']:.1%}, "
                f"near ties {self.near_ties}; {self.plain_batches} batch(es) by the regular "
                f"greedy step (faster for their size)")
