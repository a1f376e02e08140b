"""Stock ``fairseq-generate`` with only fairseq #4709 fixed: the CPU n-gram blocker's
Python loop checks the hypothesis' last n-1 tokens instead of trailing padding.

Usage: python stock_generate_fixed_ngram.py FAIRSEQ_GENERATE_ARGS...  (no plugin loaded)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq.ngram_repeat_block import NGramRepeatBlock  # noqa: E402
import fairseq_fastgen  # noqa: E402
from fairseq_fastgen.search.ngram_blocker import corrected_stock_loop  # noqa: E402

fairseq_fastgen.uninstall()  # stock everywhere else: only the reference loop is borrowed


def _fixed(self, tokens, lprobs, bsz, beam_size, step):
    return corrected_stock_loop(tokens, lprobs, bsz, beam_size, step, self.no_repeat_ngram_size)


NGramRepeatBlock._no_repeat_ngram = _fixed

if __name__ == "__main__":
    from fairseq_cli.generate import cli_main

    sys.exit(cli_main())
