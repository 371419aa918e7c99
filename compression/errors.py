"""The codec's one exception type for bad wire input."""


class FrameError(ValueError):
    """A frame is malformed, corrupted, or made for another layout; the message says which."""
