r"""
qcomm: quantized collective communication for PyTorch embeddings.

Codecs are plugins found through the ``qcomm.codecs`` entry points; a registry
of codec pairs keyed by :class:`~qcomm.CommOp` plugs into TorchRec sharders;
the three embedding collectives run with a codec on each pass, and a DDP
communication hook all-reduces dense gradients with the same codecs.
"""

from qcomm.awaitable import Awaitable, NoWait
from qcomm.collectives import all_to_all_pooled, all_to_all_sequence, reduce_scatter_pooled
from qcomm.ddp import DDPCommHookState, ddp_comm_hook
from qcomm.registry import (
    CodecEntry,
    available_codecs,
    build_registry,
    codec_entries,
    load_codec,
    parse_codec_spec,
)
from qcomm.types import (
    CodecError,
    CodecInfo,
    CommOp,
    NoOpQuantizedCommCodec,
    QuantizedCommCodec,
    QuantizedCommCodecs,
    codec_info,
)

__version__ = "0.1.0"

__all__ = [
    "Awaitable",
    "CodecEntry",
    "CodecError",
    "CodecInfo",
    "CommOp",
    "DDPCommHookState",
    "NoOpQuantizedCommCodec",
    "NoWait",
    "QuantizedCommCodec",
    "QuantizedCommCodecs",
    "all_to_all_pooled",
    "all_to_all_sequence",
    "available_codecs",
    "build_registry",
    "codec_entries",
    "codec_info",
    "ddp_comm_hook",
    "load_codec",
    "parse_codec_spec",
    "reduce_scatter_pooled",
]
