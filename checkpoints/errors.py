"""The one exception type every checkpoint loader raises, so callers catch one thing."""


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, of an unsupported kind, or disagrees with its config.

    The message names the file or tensor at fault and, for shapes, both the found and the
    expected shape.
    """
