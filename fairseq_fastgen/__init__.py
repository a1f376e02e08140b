"""fairseq-fastgen: faster, lossless sequence generation for fairseq checkpoints.

Load with ``--user-dir fairseq_fastgen`` (or ``import fairseq_fastgen``); importing only
registers the plugin (see :mod:`fairseq_fastgen.install`).
"""
from .config import FastGenConfig, FastGenConfigError, configure  # noqa: F401
from .install import install, uninstall  # noqa: F401

__version__ = "0.1.0"

install()
