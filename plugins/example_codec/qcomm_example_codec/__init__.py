r"""
An example out-of-tree qcomm codec plugin.

qcomm never imports this package by name: it reaches
:class:`~qcomm_example_codec.codec.ScaledFP16Codec` through the entry point
``example_fp16_scaled`` of the group ``qcomm.codecs`` declared in this
distribution's ``pyproject.toml``.
"""

from qcomm_example_codec.codec import ScaledFP16Codec, ScaledFP16Context

__all__ = ["ScaledFP16Codec", "ScaledFP16Context"]
