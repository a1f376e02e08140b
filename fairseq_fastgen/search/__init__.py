"""fairseq-fastgen search (imported by fairseq's --user-dir loader; no side effects)."""
