"""fairseq-fastgen models (imported by fairseq's --user-dir loader; no side effects)."""
