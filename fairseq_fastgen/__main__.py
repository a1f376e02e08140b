"""``python -m fairseq_fastgen`` prints the package directory, for ``--user-dir``:

    fairseq-generate ... --user-dir "$(python -m fairseq_fastgen)"
"""
import os


def print_user_dir() -> None:
    # Resolved without importing the package (which would import fairseq).
    print(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    print_user_dir()
