"""The two ways a pipeline can fail, as exception types a training script can catch."""
from ..errors import Error


class SplitError(Error, ValueError):
    """The model or the requested split cannot be turned into pipeline stages (with the reason)."""


class PipelineError(Error, RuntimeError):
    """A pipeline step failed on this rank or on a peer (the message says which stage and why)."""
