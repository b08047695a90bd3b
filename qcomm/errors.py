r"""
The error qcomm raises about codecs; a module of its own, without torch, so
that the command line's front end can catch it without loading torch.
"""

from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(Exception):
    r"""
    Raised when a codec cannot be found, loaded, built or trusted; the message
    names the codec, plugin or argument at fault and what was expected.
    """
