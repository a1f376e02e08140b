"""``python -m fairseq_fastgen`` prints the package directory, for ``--user-dir``:

    fairseq-generate ... --user-dir "$(python -m fairseq_fastgen)"

``python -m fairseq_fastgen build-native`` compiles the C++ decoder step now (``make
install`` does), instead of at the first generation that uses it; it fails (exit 1) when
the build fails, unless ``FASTGEN_ALLOW_PYTHON_STEP=1`` accepts the slower PyTorch step.
"""
import os
import sys


def print_user_dir() -> None:
    # Resolved without importing the package (which would import fairseq).
    print(os.path.dirname(os.path.abspath(__file__)))


ALLOW_PYTHON_STEP = "FASTGEN_ALLOW_PYTHON_STEP"


def build_native() -> int:
    """0 when the C++ step is built (or its absence is accepted), else 1."""
    from fairseq_fastgen.models import native_step

    module = native_step.load()
    if module is not None:
        print(f"fairseq-fastgen: native decoder step ready ({module.__file__})")
        return 0
    why = f"fairseq-fastgen: native decoder step not built ({native_step.load_error()})"
    if os.environ.get(ALLOW_PYTHON_STEP) == "1":
        print(f"{why}; {ALLOW_PYTHON_STEP}=1: generation uses the slower PyTorch step")
        return 0
    print(f"{why}.\nInstall g++ and ninja (pip install ninja), or set {ALLOW_PYTHON_STEP}=1 "
          "to run the slower PyTorch step instead.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:] == ["build-native"]:
        sys.exit(build_native())
    elif sys.argv[1:]:
        sys.exit(f"usage: python -m fairseq_fastgen [build-native] (got {' '.join(sys.argv[1:])})")
    else:
        print_user_dir()
