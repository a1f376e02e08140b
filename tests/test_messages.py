"""Messages that name the input and the way out (issue 18): fairseq-interactive's input
that is not valid UTF-8, read from a file or from standard input."""
import fileinput
import io
import subprocess
import sys

import pytest

from fairseq_fastgen.compare import generate_command, run_generate
from fairseq_fastgen.input_check import InputEncodingError, buffered_read

BAD = b"w1 w2 w3\nw4 w5\nw6 w\xe9 w7 \xff\nw8\n"  # line 3: Latin-1 e-acute, then 0xff


def _read(source, size):
    out = []
    with pytest.raises(InputEncodingError) as e:
        for buffer in buffered_read(source, size):
            out.append(buffer)
    return out, e.value


@pytest.mark.parametrize("size", [1, 2, 5])
def test_bad_file_line_is_named_after_the_lines_before_it(tmp_path, size):
    path = tmp_path / "in.txt"
    path.write_bytes(BAD)
    buffers, err = _read(str(path), size)
    assert sum(buffers, []) == ["w1 w2 w3", "w4 w5"]  # every line before the bad one
    assert all(len(b) <= size for b in buffers)
    assert err.message == (
        f"input line 3 (--input {path}) is not valid UTF-8 (byte 0xe9 at column 5, 1 more "
        "bad byte(s) on that line); fix or remove that line, or re-encode the input as UTF-8 "
        "(for example with iconv -f LATIN1 -t UTF-8); the lines before it were translated")
    assert err.code == "fairseq-interactive: error: " + err.message  # exit status 1, no traceback


def test_bad_stdin_line_is_named(monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xffw1\nw2\n"), encoding="utf-8",
                             errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    buffers, err = _read("-", 1)
    assert buffers == []
    assert err.message.startswith("input line 1 (standard input) is not valid UTF-8 (byte 0xff "
                                  "at column 1); fix or remove that line")
    assert "lines before it" not in err.message


def _stock_read(source, size):
    """fairseq_cli.interactive.buffered_read of fairseq-fixed 0.12.3.1, verbatim."""
    buffer = []
    with fileinput.input(files=[source], openhook=fileinput.hook_encoded("utf-8")) as h:
        for src_str in h:
            buffer.append(src_str.strip())
            if len(buffer) >= size:
                yield buffer
                buffer = []
    if len(buffer) > 0:
        yield buffer


GOOD = "w1 w2\r\nw3\rw4  \n\n  w5 é\tw6\nw7".encode("utf-8")


@pytest.mark.parametrize("size", [1, 2, 3])
def test_good_input_reads_as_stock(tmp_path, monkeypatch, size):
    """The same buffers as fairseq's reader: universal newlines in a file, "\\n" only on
    standard input (Python's stdin), stripped lines, a final partial buffer."""
    path = tmp_path / "good.txt"
    path.write_bytes(GOOD)
    ours = list(buffered_read(str(path), size))
    assert ours == list(_stock_read(str(path), size))
    assert sum(ours, []) == ["w1 w2", "w3", "w4", "", "w5 é\tw6", "w7"]

    def stdin():
        return io.TextIOWrapper(io.BytesIO(GOOD), encoding="utf-8", newline="\n")

    monkeypatch.setattr(sys, "stdin", stdin())
    ours = list(buffered_read("-", size))
    monkeypatch.setattr(sys, "stdin", stdin())
    assert ours == list(_stock_read("-", size))
    assert sum(ours, []) == ["w1 w2", "w3\rw4", "", "w5 é\tw6", "w7"]


def test_interactive_cli_exits_with_the_message(tiny, tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(BAD)
    args = [str(tiny.data), "--path", str(tiny.postln), "--beam", "2", "--max-len-b", "5",
            "--source-lang", "src", "--target-lang", "tgt"]
    stock = run_generate(args + ["--input", str(path)], plugin=False, entry="fairseq-interactive")
    assert stock.returncode != 0 and "UnicodeDecodeError" in stock.stderr  # what is fixed
    for extra, origin in ((["--input", str(path)], f"--input {path}"), ([], "standard input")):
        cmd, env = generate_command(args + extra, plugin=True, entry="fairseq-interactive")
        r = subprocess.run(cmd, env=env, input=BAD, capture_output=True, timeout=600)
        out, err = r.stdout.decode(), r.stderr.decode()
        assert r.returncode == 1, err[-2000:]
        assert [l.split("\t")[1] for l in out.splitlines() if l.startswith("S-")] == \
            ["w1 w2 w3", "w4 w5"]
        last = err.rstrip().splitlines()[-1]
        assert last.startswith(f"fairseq-interactive: error: input line 3 ({origin}) is not "
                               "valid UTF-8 (byte 0xe9 at column 5"), last
        assert "Traceback" not in err
