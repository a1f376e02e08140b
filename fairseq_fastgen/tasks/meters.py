"""The generate pipeline's meters: stock's ``gen_timer`` and the progress bar's rates."""


class Meters:
    """Generation time and tokens (stock's ``gen_timer``) and the progress rates."""

    def __init__(self, gen_timer):
        from fairseq.logging.meters import TimeMeter

        self.gen_timer = gen_timer
        self.wps, self.sps = TimeMeter(), TimeMeter()
        self.busy = 0.0  # seconds spent decoding, summed over batches

    def add(self, tokens: int, seconds: float, sentences: int) -> None:
        self.gen_timer.n += tokens
        self.busy += seconds
        self.wps.update(tokens)
        self.sps.update(sentences)

    def log(self, progress) -> None:
        progress.log({"wps": round(self.wps.avg), "sentences/s": round(self.sps.avg, 2)})
