"""``--print-alignment``: fairseq's alignment extraction over the fast beam search."""
from typing import Optional

from fairseq.sequence_generator import SequenceGeneratorWithAlignment

from ..config import FastGenConfig
from .fast_sequence_generator import FastSequenceGenerator


class FastSequenceGeneratorWithAlignment(SequenceGeneratorWithAlignment, FastSequenceGenerator):
    """``--print-alignment``: fairseq's alignment extraction over the fast beam search."""

    def __init__(self, models, tgt_dict, left_pad_target=False, print_alignment="hard",
                 fastgen: Optional[FastGenConfig] = None, **kwargs):
        # SequenceGeneratorWithAlignment.__init__ forwards **kwargs to the next __init__ in
        # the MRO, FastSequenceGenerator's, which then keeps the attention weights.
        super().__init__(models, tgt_dict, left_pad_target=left_pad_target,
                         print_alignment=print_alignment, fastgen=fastgen, need_attn=True,
                         **kwargs)
