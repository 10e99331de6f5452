"""``pdctl bench``: measure a running stack like the seed did (open-loop Poisson, streaming, ``vllm bench
serve`` key names), compare two runs, and predict P/D splits on the twin (what-if)."""


class BenchError(ValueError):
    """Bad benchmark input (code 2) or an unreachable target (code 1): the message says what and how to fix."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code
