"""An example qcomm codec plugin, found through its ``qcomm.codecs`` entry point."""

from qcomm_example_codec.codec import ScaledFP16Codec

__all__ = ["ScaledFP16Codec"]
