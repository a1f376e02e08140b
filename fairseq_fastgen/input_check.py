"""fairseq-interactive's input, read as stock reads it, with invalid UTF-8 named by line.

Stock's ``buffered_read`` decodes ``--input FILE`` strictly, so a bad byte stops the run
with a ``UnicodeDecodeError`` whose position counts from an 8 KiB decoding chunk, not a
line; on standard input Python's ``surrogateescape`` handler lets the bytes through, and
SentencePiece then fails with "Unable to cast Python instance of type <class 'str'> to C++
type '?'".  This reader splits and strips lines exactly as stock does (the file in
universal-newline mode, standard input on "\\n" only), yields the same buffers, and stops
at the first line that is not valid UTF-8 with an error that names the line, the byte and
its column, after the lines before it were translated.
"""
import contextlib
import fileinput
import re
import sys
from typing import Iterator, List

from . import drops

# What surrogateescape decodes an undecodable byte 0xHH to: U+DCHH.
_ESCAPED = re.compile("[\udc80-\udcff]")


class InputEncodingError(SystemExit):
    """A line of fairseq-interactive's input is not valid UTF-8.

    A ``SystemExit`` as argparse's usage errors are: the command line's input is
    unusable, so the message alone goes to stderr (no traceback) and the exit status is 1.
    """

    def __init__(self, message: str):
        super().__init__(f"fairseq-interactive: error: {message}")
        self.message = message


def check_line(text: str, number: int, source: str) -> None:
    """Raise :class:`InputEncodingError` if ``text`` (line ``number`` of ``source``,
    decoded with ``surrogateescape``) held bytes that are not UTF-8."""
    m = _ESCAPED.search(text)
    if m is None:
        return
    byte = ord(m.group()) - 0xDC00
    count = len(_ESCAPED.findall(text))
    others = f", {count - 1} more bad byte(s) on that line" if count > 1 else ""
    origin = "standard input" if source == "-" else f"--input {source}"
    before = "; the lines before it were translated" if number > 1 else ""
    raise InputEncodingError(
        f"input line {number} ({origin}) is not valid UTF-8 (byte 0x{byte:02x} at column "
        f"{m.start() + 1}{others}); fix or remove that line, or re-encode the input as "
        f"UTF-8 (for example with iconv -f LATIN1 -t UTF-8){before}")


def _lines(input: str) -> Iterator[str]:
    if input != "-":
        with fileinput.input(files=[input], openhook=fileinput.hook_encoded(
                "utf-8", errors="surrogateescape")) as h:
            yield from h
        return
    stdin = sys.stdin
    raw = getattr(stdin, "buffer", None)
    if raw is None:  # a text stream with no bytes beneath (e.g. io.StringIO in a test)
        yield from stdin
        return
    # What Python's own stdin gives (its encoding, lines ended by "\n" only), decoded
    # line by line with the one handler that lets a bad byte be named; a "\n" byte is
    # never part of a UTF-8 sequence, so splitting first decodes the same text.
    encoding = stdin.encoding or "utf-8"
    for line in raw:
        yield line.decode(encoding, "surrogateescape")


def buffered_read(input: str, buffer_size: int) -> Iterator[List[str]]:
    """``fairseq_cli.interactive.buffered_read``: the same buffers of stripped lines.

    Also tells :mod:`drops` the input id of each buffer's first line (the interactive
    main numbers its outputs the same way), so that skipped lines are named by number.
    """
    buffer: List[str] = []
    start = 0
    with contextlib.closing(_lines(input)) as lines:  # the file closed when we stop
        for number, src_str in enumerate(lines, 1):
            try:
                check_line(src_str, number, input)
            except InputEncodingError:
                if buffer:  # translate what came before the bad line, then stop
                    drops.set_offset(start)
                    yield buffer
                raise
            buffer.append(src_str.strip())
            if len(buffer) >= buffer_size:
                drops.set_offset(start)
                yield buffer
                start += len(buffer)
                buffer = []
    if buffer:
        drops.set_offset(start)
        yield buffer
