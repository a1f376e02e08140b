"""The benchmark suite (``python benchmarks/suite``; see cli.py for what it measures).

    grid.py      which cells: models, beams, batches, n-gram sizes, systems, rounds
    data.py      the binarized inputs of the cells and of the scaling study
    machine.py   the machine, its GEMM peak, the FLOPs of the physical limit
    runners.py   how systems run: fairseq-generate (one interface over
                 fairseq_fastgen.compare.generate_command), CTranslate2
    measure.py   one cell: interleaved runs, figures vs stock, lossless checks; scaling
    plots.py     the PNG figures
    report.py    BENCHMARKS.md and the README headline, from templates/
    cli.py       the command line and the order of a run
"""
