"""fairseq-fastgen tasks (imported by fairseq's --user-dir loader; no side effects)."""
