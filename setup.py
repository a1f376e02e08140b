"""fairseq-fastgen: faster, lossless sequence generation for existing fairseq checkpoints."""
from pathlib import Path

from setuptools import setup

here = Path(__file__).parent

setup(
    name="fairseq-fastgen",
    version="0.1.0",
    description=__doc__,
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "fairseq_fastgen",
        "fairseq_fastgen.models",
        "fairseq_fastgen.search",
        "fairseq_fastgen.search.aggressive",
        "fairseq_fastgen.search.continuous",
        "fairseq_fastgen.tasks",
        "fairseq_fastgen.cuda",
    ],
    # Kernel sources live in the repo's top-level cuda/ and install as fairseq_fastgen/cuda/.
    package_dir={"fairseq_fastgen.cuda": "cuda"},
    # csrc/: the C++ decoder step, compiled at first use (models/native_step.py)
    package_data={"fairseq_fastgen.cuda": ["*.cu"], "fairseq_fastgen": ["csrc/*.cpp"]},
    install_requires=[
        # Stack A (Python >= 3.11): the maintained fork of fairseq main.
        'fairseq-fixed==0.12.3.1; python_version >= "3.11"',
        'torch==2.13.0; python_version >= "3.11"',
        # Stack B (Python 3.10): official fairseq 0.12.2.
        'fairseq==0.12.2; python_version < "3.11"',
        'hydra-core==1.3.2; python_version >= "3.11"',
        'omegaconf==2.3.0; python_version >= "3.11"',
        "sentencepiece",
        "sacrebleu",
        "sacremoses",
        "tqdm",
        "ninja",  # torch.utils.cpp_extension builds the C++ decoder step with it
    ],
    extras_require={
        # the CuPy n-gram kernel: pick the build matching the CUDA driver (nvidia-smi's
        # "CUDA Version"); "cuda" stays the CUDA 12 one it always named
        "cuda": ["cupy-cuda12x"],
        "cuda12": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
        "test": ["pytest", "hypothesis", "subword-nmt", "psutil"],
        # benchmarks/suite: CTranslate2 comparison and plots
        "bench": ["ctranslate2==4.8.5", "matplotlib==3.11.2"],
    },
    entry_points={
        "console_scripts": [
            "fastgen-user-dir = fairseq_fastgen.__main__:print_user_dir",
            "fastgen-compare = fairseq_fastgen.compare:main",
            "fastgen-generate = fairseq_fastgen.tasks.generate:cli_main",
        ]
    },
)
