r"""
qcomm: quantized collective communication for PyTorch embeddings.

Codecs are plugins found through the ``qcomm.codecs`` entry points; a registry
of codec pairs keyed by :class:`~qcomm.CommOp` plugs into TorchRec sharders;
the three embedding collectives (and the reduce-scatter's adjoint, the
all-gather) run with a codec on each pass, and a DDP communication hook
all-reduces dense gradients with the same codecs (:func:`~qcomm.all_reduce`);
TorchRec's planner costs them as they are sent (:class:`~qcomm.CodecPerfEstimator`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it. Importing qcomm imports nothing
# else (torch included) until a name is used: the pytest plugin and the
# command line stay cheap to load.
_HOMES = {
    "AdaptiveCodec": "qcomm.adaptive",
    "CallRecord": "qcomm.history",
    "error_history": "qcomm.history",
    "Awaitable": "qcomm.awaitable",
    "NoWait": "qcomm.awaitable",
    "all_gather_pooled": "qcomm.collectives",
    "all_reduce": "qcomm.collectives.all_reduce",
    "all_to_all_pooled": "qcomm.collectives",
    "all_to_all_sequence": "qcomm.collectives",
    "reduce_scatter_pooled": "qcomm.collectives",
    "BlockCodec": "qcomm.codec_base",
    "BlockContext": "qcomm.codec_base",
    "ElementwiseCodec": "qcomm.codec_base",
    "DDPCommHookState": "qcomm.ddp",
    "ddp_comm_hook": "qcomm.ddp",
    "FSDPCommState": "qcomm.fsdp",
    "fsdp_quantize": "qcomm.fsdp",
    "CodecEntry": "qcomm.discovery",
    "available_codecs": "qcomm.discovery",
    "codec_entries": "qcomm.discovery",
    "load_codec": "qcomm.discovery",
    "CodecPerfEstimator": "qcomm.planner",
    "CommsProfile": "qcomm.planner",
    "plan_specs": "qcomm.planner",
    "planner_topology": "qcomm.planner",
    "profile_from_bench": "qcomm.planner",
    "build_registry": "qcomm.registry",
    "load_pair": "qcomm.registry",
    "parse_codec_spec": "qcomm.specs",
    "CodecError": "qcomm.errors",
    "CodecInfo": "qcomm.types",
    "CommOp": "qcomm.ops",
    "HostCodecs": "qcomm.types",
    "NoOpQuantizedCommCodec": "qcomm.types",
    "QuantizedCommCodec": "qcomm.types",
    "QuantizedCommCodecs": "qcomm.types",
    "codec_info": "qcomm.types",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from qcomm.adaptive import AdaptiveCodec as AdaptiveCodec
    from qcomm.awaitable import Awaitable as Awaitable
    from qcomm.awaitable import NoWait as NoWait
    from qcomm.codec_base import BlockCodec as BlockCodec
    from qcomm.codec_base import BlockContext as BlockContext
    from qcomm.codec_base import ElementwiseCodec as ElementwiseCodec
    from qcomm.collectives import all_gather_pooled as all_gather_pooled
    from qcomm.collectives import all_to_all_pooled as all_to_all_pooled
    from qcomm.collectives import all_to_all_sequence as all_to_all_sequence
    from qcomm.collectives import reduce_scatter_pooled as reduce_scatter_pooled
    from qcomm.collectives.all_reduce import all_reduce as all_reduce
    from qcomm.ddp import DDPCommHookState as DDPCommHookState
    from qcomm.ddp import ddp_comm_hook as ddp_comm_hook
    from qcomm.discovery import CodecEntry as CodecEntry
    from qcomm.discovery import available_codecs as available_codecs
    from qcomm.discovery import codec_entries as codec_entries
    from qcomm.discovery import load_codec as load_codec
    from qcomm.errors import CodecError as CodecError
    from qcomm.fsdp import FSDPCommState as FSDPCommState
    from qcomm.fsdp import fsdp_quantize as fsdp_quantize
    from qcomm.history import CallRecord as CallRecord
    from qcomm.history import error_history as error_history
    from qcomm.ops import CommOp as CommOp
    from qcomm.planner import CodecPerfEstimator as CodecPerfEstimator
    from qcomm.planner import CommsProfile as CommsProfile
    from qcomm.planner import plan_specs as plan_specs
    from qcomm.planner import planner_topology as planner_topology
    from qcomm.planner import profile_from_bench as profile_from_bench
    from qcomm.registry import build_registry as build_registry
    from qcomm.registry import load_pair as load_pair
    from qcomm.specs import parse_codec_spec as parse_codec_spec
    from qcomm.types import CodecInfo as CodecInfo
    from qcomm.types import HostCodecs as HostCodecs
    from qcomm.types import NoOpQuantizedCommCodec as NoOpQuantizedCommCodec
    from qcomm.types import QuantizedCommCodec as QuantizedCommCodec
    from qcomm.types import QuantizedCommCodecs as QuantizedCommCodecs
    from qcomm.types import codec_info as codec_info


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        # A submodule, as ``qcomm.collectives`` was before the lazy imports.
        try:
            return importlib.import_module(f"qcomm.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"qcomm.{name}":
                raise
            raise AttributeError(f"module 'qcomm' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
