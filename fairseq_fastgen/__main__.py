"""``python -m fairseq_fastgen`` prints the package directory, for ``--user-dir``:

    fairseq-generate ... --user-dir "$(python -m fairseq_fastgen)"

``python -m fairseq_fastgen build-native`` compiles the C++ decoder step now (``make
install`` does), instead of at the first generation that uses it.
"""
import os
import sys


def print_user_dir() -> None:
    # Resolved without importing the package (which would import fairseq).
    print(os.path.dirname(os.path.abspath(__file__)))


def build_native() -> None:
    from fairseq_fastgen.models import native_step

    module = native_step.load()
    if module is None:  # not an error: the Python step serves
        print(f"fairseq-fastgen: native decoder step not built ({native_step.load_error()}); "
              "generation uses the Python step")
    else:
        print(f"fairseq-fastgen: native decoder step ready ({module.__file__})")


if __name__ == "__main__":
    if sys.argv[1:] == ["build-native"]:
        build_native()
    elif sys.argv[1:]:
        sys.exit(f"usage: python -m fairseq_fastgen [build-native] (got {' '.join(sys.argv[1:])})")
    else:
        print_user_dir()
