"""
What a codec will do, as text and as a 64-bit fingerprint that ranks compare
(what it holds: docs/collectives.rst, "Mistakes and failures").

Two codecs of one class can differ in an option kept in a private attribute
(fbgemm's ``_loss_scale``), so every plain-valued attribute is described, and
the wire a copy of the codec makes of a fixed probe. A ``stateful`` codec's
state may rightly differ between ranks: its attributes and probe are left out.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import re
from typing import Any

import torch

from qcomm.collectives import _wire
from qcomm.types import CodecInfo, codec_info

SEP = "; "
_PROBE_LENGTHS = (0, 1, 7, 64, 1000)
# Values of many magnitudes and both signs, some tiny and some large, so that
# any scale, loss scale, rounding or clamping shows in the wire.
_PROBE = torch.cat(
    [torch.linspace(-3.0, 3.0, 32), torch.logspace(-6, 6, 32) * (-1.0) ** torch.arange(32)]
).float()
# What legitimately differs between ranks' descriptions of the same codec:
# the device index (each rank of an NCCL job has its own GPU) and object
# addresses in a repr.
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|hpu|mps):\d+")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+")
# Typed Any: mypy takes a class's __repr__ and object's for different types.
_OBJECT_REPR: Any = object.__repr__
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, enum.Enum, CodecInfo)
# Fingerprints of codecs seen before, keyed by identity and attributes.
_cache: dict[tuple[int, type, tuple[tuple[str, str], ...]], tuple[int, str]] = {}
_CACHE_SIZE = 256


def _safe(fn: Any) -> str:
    # A description must never fail: a codec method that raises is described
    # by the exception's type, which is the same on every rank.
    try:
        return str(fn())
    except Exception as err:
        return f"<raises {type(err).__name__}>"


def _attributes(codec: Any) -> tuple[tuple[str, str], ...]:
    """Every attribute of the codec: plain values as they are, others by type."""
    items = sorted(getattr(codec, "__dict__", {}).items())
    return tuple(
        (k, repr(v) if isinstance(v, _PLAIN) else f"<{type(v).__name__}>") for k, v in items
    )


def _probe_wire(codec: Any) -> str:
    """A hash of the wire a copy of the codec makes of the probe tensor."""
    twin = copy.deepcopy(codec)
    # A codec that rounds stochastically draws from the global generator:
    # with a fixed seed of its own the probe is alike on every rank, however
    # each rank seeded its generator, and the user's stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wire = twin.encode(_PROBE.clone(), twin.create_context())
    data = wire.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _declared_stateful(codec: Any) -> bool:
    info = getattr(codec, "info", None)
    return isinstance(info, CodecInfo) and info.stateful


def describe_codec(codec: Any) -> str:
    """A text that differs between two codecs that would encode differently."""
    cls = type(codec)
    parts = [f"class={cls.__module__}.{cls.__qualname__}"]
    if cls.__repr__ is not _OBJECT_REPR:
        parts.append(f"repr={_safe(lambda: repr(codec))}")
    info = codec_info(codec)
    full = not _declared_stateful(codec)
    if full:
        attrs = ", ".join(f"{k}={v}" for k, v in _attributes(codec))
        if attrs:
            parts.append(f"attrs={{{attrs}}}")
    parts.append(f"info={info}")
    parts.append(f"wire={_safe(lambda: _wire.wire_dtype(codec))}")
    sizes = ",".join(
        _safe(lambda n=n: codec.calc_quantized_size(n, codec.create_context()))
        for n in _PROBE_LENGTHS
    )
    parts.append(f"sizes({','.join(map(str, _PROBE_LENGTHS))})={sizes}")
    if full:
        parts.append(f"probe={_safe(lambda: _probe_wire(codec))}")
    return _ADDRESS.sub("0x...", _DEVICE_INDEX.sub(r"\1", SEP.join(parts)))


def short_name(codec: Any) -> str:
    """The codec as a user would name it in a message: its ``repr``, or its class and attributes."""
    cls = type(codec)
    if cls.__repr__ is not _OBJECT_REPR:
        text = _safe(lambda: repr(codec))
    else:
        attrs = ", ".join(f"{k}={v}" for k, v in _attributes(codec))
        text = f"{cls.__qualname__}({attrs})"
    return _ADDRESS.sub("0x...", _DEVICE_INDEX.sub(r"\1", text))[:200]


def fingerprint(codec: Any) -> tuple[int, str]:
    """The 64-bit hash of :func:`describe_codec` and the :func:`short_name`, cached."""
    # A stateful codec's attributes change with its state; it is described
    # without them. Codecs of one class whose attributes are all plain values
    # behave alike (the collectives make a no-op codec per call): they share
    # an entry; any other codec is known by its identity too.
    attrs = () if _declared_stateful(codec) else _attributes(codec)
    plain = all(not v.startswith("<") for _, v in attrs)
    key = (0 if plain else id(codec), type(codec), attrs)
    found = _cache.get(key)
    if found is None:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        found = _cache[key] = (hash64(describe_codec(codec)), short_name(codec))
    return found


def hash64(text: str) -> int:
    """A stable signed 64-bit hash of ``text`` (the same in every process)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
