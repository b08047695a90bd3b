r"""
TorchRec's sharding planner told what qcomm's codecs really cost (see
:doc:`planner`).

TorchRec's ``EmbeddingShardingPlanner`` costs a table's communication as its
elements times the byte size of the codec's wire dtype over a fixed
bandwidth: every ``uint8`` wire costs one byte per element, whatever scales
and padding travel with it, a codec by host is costed as if it encoded
inside a host too, encoding and decoding are free, and replicated tables are
all-reduced at their own dtype whatever the DDP hook sends.
:class:`CodecPerfEstimator` keeps TorchRec's estimate of the compute and
replaces the communication with what qcomm's collectives send: each peer's
block as the codec's
:meth:`~qcomm.QuantizedCommCodec.calc_quantized_size` counts it (padding
included), nothing for the rank's own block, a codec by host by where the
peer is, over the link rates of a :class:`CommsProfile`, plus the codec's
encode and decode time. :func:`~qcomm.profile_from_bench` reads those rates from a
``qcomm bench --json`` file; without one :data:`~qcomm.planner.DEFAULT_PROFILE` stands in.

TorchRec is imported inside the functions: qcomm imports without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from collections.abc import Mapping
from typing import Any

import torch

from qcomm.adaptive import AdaptiveCodec
from qcomm.ops import CommOp
from qcomm.types import HostCodecs, NoOpQuantizedCommCodec, codec_info, read_quantized_dtype

__all__ = [
    "DEFAULT_CODEC_BPS",
    "DEFAULT_COPY_BPS",
    "DEFAULT_PROFILE",
    "PLAN_SHARDINGS",
    "CodecPerfEstimator",
    "CommsProfile",
    "plan_specs",
    "planner_topology",
    "profile_from_bench",
    "wire_bytes",
]

# TorchRec's estimates are in milliseconds (its rates in bytes per ms).
_MS = 1e3

#: float32 bytes a memory copy moves per second where none is measured (a
#: GPU's memory)
DEFAULT_COPY_BPS = 1e12

#: bytes of float32 input a codec encodes (or decodes) per second where no
#: measurement is given: a memory-bound kernel at a small fraction of a
#: GPU's memory bandwidth
DEFAULT_CODEC_BPS = 100e9


@dataclasses.dataclass(frozen=True)
class CommsProfile:
    r"""
    The rates :class:`CodecPerfEstimator` costs communication at: the link
    inside a host and between hosts, each rank's port, in bytes per second,
    and each codec's encode and decode throughput in float32 bytes per
    second, by codec name (:attr:`~qcomm.CodecInfo.name`).

    Args:
        inter_host_Bps (float): bytes per second a rank sends to other hosts.
        intra_host_Bps (float): bytes per second a rank sends inside its host.
        encode_Bps (Mapping[str, float], optional): encode throughput by codec
            name. Default: none (:data:`~qcomm.planner.DEFAULT_CODEC_BPS` for every codec).
        decode_Bps (Mapping[str, float], optional): decode throughput by codec
            name. Default: none.
        copy_Bps (float, optional): float32 bytes a memory copy moves per
            second, what the reduce-scatter's sums are costed at.
            Default: :data:`~qcomm.planner.DEFAULT_COPY_BPS`.
        source (str, optional): where the figures come from. Default: ``"model"``.

    Raises:
        TypeError: for ``encode_Bps`` or ``decode_Bps`` that is not a mapping,
            naming it.
        ValueError: for a rate that is not a positive number, naming it.

    Examples::

        >>> profile = CommsProfile(inter_host_Bps=125e6, intra_host_Bps=125e6, encode_Bps={"int8": 2e9})
        >>> profile.codec_seconds("int8", 1e9, encode=True)
        0.5
    """

    inter_host_Bps: float
    intra_host_Bps: float
    encode_Bps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    decode_Bps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    copy_Bps: float = DEFAULT_COPY_BPS
    source: str = "model"

    def __post_init__(self) -> None:
        for kind in ("encode_Bps", "decode_Bps"):
            value = getattr(self, kind)
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"{kind}: expected a mapping from codec names to bytes/s, "
                    f"got {type(value).__name__}"
                )
            # Read-only, so that a shared profile (DEFAULT_PROFILE) cannot be
            # changed in place behind its frozen fields.
            object.__setattr__(self, kind, types.MappingProxyType(dict(value)))
        rates = {
            "inter_host_Bps": self.inter_host_Bps,
            "intra_host_Bps": self.intra_host_Bps,
            "copy_Bps": self.copy_Bps,
        }
        for kind in ("encode_Bps", "decode_Bps"):
            rates |= {f"{kind}[{name!r}]": v for name, v in getattr(self, kind).items()}
        for name, value in rates.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive number of bytes/s, got {value!r}")
            if math.isinf(value) and name.endswith("host_Bps"):
                raise ValueError(f"{name}: expected a finite rate, got {value!r}")

    def codec_seconds(self, codec: Any, float32_bytes: float, *, encode: bool) -> float:
        r"""
        codec_seconds(codec: str | QuantizedCommCodec, float32_bytes: float, *, encode: bool) -> float

        Seconds a codec takes to encode (or decode) ``float32_bytes``; none
        for a codec that changes nothing: qcomm's or TorchRec's no-op codec
        (of any wire dtype), a codec whose wire is the float32 data itself,
        or the name ``"noop"``. An :class:`~qcomm.AdaptiveCodec` takes its
        last candidate's time.

        Args:
            codec (str | QuantizedCommCodec): the codec, or its name.
            float32_bytes (float): the float32 bytes.
            encode (bool): encode, else decode.

        Returns:
            float: the seconds.
        """
        codec = _costed(codec)
        if isinstance(codec, str):
            name = codec
            if name == "noop":
                return 0.0
        elif _sends_data_as_is(codec):
            return 0.0
        else:
            name = codec_info(codec).name
        rates = self.encode_Bps if encode else self.decode_Bps
        return float32_bytes / rates.get(name, DEFAULT_CODEC_BPS)


def _costed(codec: Any) -> Any:
    """The codec a plan costs: an adaptive codec's last candidate, the most precise (an upper bound)."""
    return codec.candidates[-1] if isinstance(codec, AdaptiveCodec) else codec


def _default_profile() -> CommsProfile:
    # TorchRec's own defaults (BasicCommsBandwidths), written out so that
    # qcomm imports without TorchRec: 12.5 GiB/s between hosts, 600 GiB/s inside.
    return CommsProfile(inter_host_Bps=12.5 * 1024**3, intra_host_Bps=600 * 1024**3)


#: the profile where no measurement is given, TorchRec's default link rates
#: (12.5 GiB/s between hosts, 600 GiB/s inside a host) and
#: :data:`~qcomm.planner.DEFAULT_CODEC_BPS` for every codec
DEFAULT_PROFILE = _default_profile()


def _sends_data_as_is(codec: Any, data_dtype: torch.dtype = torch.float32) -> bool:
    # Decided by the codec, not its name: TorchRec's no-op is named after its
    # class, and a plugin's pass-through may be named anything.
    if isinstance(codec, NoOpQuantizedCommCodec):
        return True
    try:
        from torchrec.distributed.types import NoOpQuantizedCommCodec as TorchRecNoOp
    except ImportError:
        pass
    else:
        if isinstance(codec, TorchRecNoOp):
            return True
    if read_quantized_dtype(codec) != data_dtype:
        return False
    ctx = codec.create_context()
    return bool(int(codec.calc_quantized_size(1024, ctx)) == 1024)


def wire_bytes(codec: Any, rows: int, cols: int, *, pooled: bool = True) -> int:
    r"""
    wire_bytes(codec: Any, rows: int, cols: int, *, pooled: bool = True) -> int

    Bytes ``codec`` puts on the wire for one peer's block of ``rows`` x
    ``cols`` float32 elements: its
    :meth:`~qcomm.QuantizedCommCodec.calc_quantized_size` times its wire
    dtype's size, with the columns first padded as the codec's
    :meth:`~qcomm.QuantizedCommCodec.padded_size` asks in a pooled all-to-all.
    An :class:`~qcomm.AdaptiveCodec` is costed at its last candidate, the
    most precise it may choose: an upper bound.

    Args:
        codec (QuantizedCommCodec): the codec.
        rows (int): the block's rows.
        cols (int): its columns.
        pooled (bool, optional): the block travels in a pooled all-to-all
            (else a reduce-scatter, all-gather or sequence all-to-all, which
            pad nothing). Default: ``True``.

    Returns:
        int: the bytes.

    Raises:
        ValueError: for a negative ``rows`` or ``cols``.

    Examples::

        >>> import qcomm
        >>> wire_bytes(qcomm.load_codec("int8"), 2048, 128) / (2048 * 128)
        1.25
    """
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    codec = _costed(codec)
    ctx = codec.create_context()
    if pooled and rows and cols:
        # A meta tensor: padded_size reads the shape only.
        block = torch.empty(rows, cols, device="meta")
        cols, _ = codec.padded_size(block, [cols], 0, ctx)
    # TorchRec's no-op codec has quantized_dtype as a method, qcomm's a property.
    itemsize: int = read_quantized_dtype(codec).itemsize
    return int(codec.calc_quantized_size(rows * cols, ctx)) * itemsize


def _pair(codecs: Any, same_host: bool) -> Any:
    if isinstance(codecs, HostCodecs):
        return codecs.same_host if same_host else codecs.other_host
    return codecs


def _side(codecs: Any, forward: bool) -> Any:
    if codecs is None:
        return NoOpQuantizedCommCodec()
    return codecs.forward if forward else codecs.backward


def _peer_seconds(
    profile: CommsProfile,
    codecs: Any,
    *,
    forward: bool,
    rows: int,
    cols: int,
    pooled: bool,
    same_host_peers: int,
    other_host_peers: int,
) -> float:
    # One rank's blocks to its peers (or from them, on the backward pass):
    # each over the rank's port, encoded and decoded once; its own block
    # crosses nothing and is not encoded.
    seconds = 0.0
    for same, peers in ((True, same_host_peers), (False, other_host_peers)):
        if peers <= 0:
            continue
        codec = _side(_pair(codecs, same), forward)
        rate = profile.intra_host_Bps if same else profile.inter_host_Bps
        float32 = 4.0 * rows * cols
        seconds += peers * wire_bytes(codec, rows, cols, pooled=pooled) / rate
        seconds += peers * profile.codec_seconds(codec, float32, encode=True)
        seconds += peers * profile.codec_seconds(codec, float32, encode=False)
    return seconds


def _allreduce_seconds(
    profile: CommsProfile, codec: Any, numel: int, world_size: int, local_world_size: int
) -> float:
    # qcomm's all-reduce (collectives/all_reduce.py): a reduce-scatter, where
    # a rank encodes the n - 1 blocks its peers own and decodes the n - 1 it
    # receives for its own, then an all-gather, where it encodes its block
    # once and decodes the n - 1 of its peers and its own (so that every
    # rank holds the same values). Each rank sends 2 (n - 1) / n of the
    # buffer through the slowest link on the way.
    if world_size <= 1:
        return 0.0
    n = world_size
    share = 2.0 * (n - 1) / n
    rate = profile.intra_host_Bps if n <= local_world_size else profile.inter_host_Bps
    float32 = 4.0 * numel
    wire = wire_bytes(codec, numel, 1, pooled=False)
    encode = profile.codec_seconds(codec, float32, encode=True)
    decode = profile.codec_seconds(codec, float32 * (2 * n - 1) / n, encode=False)
    return share * (wire / rate) + encode + decode


def _rows(option: Any, constraints: Any) -> float:
    # Output rows of one rank's batch for the table (TorchRec's batch_outputs
    # of a pooled table, its ids of a sequence one).
    from torchrec.distributed.planner.shard_estimators import get_num_poolings

    poolings = get_num_poolings(constraints, option)
    constraint = (constraints or {}).get(option.name)
    batch = getattr(constraint, "batch_sizes", None) or [option.batch_size] * len(poolings)
    lengths = option.input_lengths
    cap = 1.0 if option.is_pooled else math.inf
    return float(sum(min(cap, L) * p * b for L, p, b in zip(lengths, poolings, batch, strict=True)))


class CodecPerfEstimator:
    r"""
    The perf estimator for TorchRec's planner that costs communication at
    what qcomm sends: give it to ``EmbeddingEnumerator(estimator=...)``
    (TorchRec 1.8's ``EmbeddingShardingPlanner`` takes the enumerator), with
    TorchRec's ``EmbeddingStorageEstimator`` beside it.

    TorchRec's own ``EmbeddingPerfEstimator`` estimates each shard first;
    this one then replaces the shard's ``fwd_comms`` and ``bwd_comms``:

    - table-, column- and table-column-wise shards (the pooled all-to-all, or
      the sequence one): the rank sends each peer its block of the batch
      forward and receives each peer's gradient backward;
    - row-wise shards (the pooled reduce-scatter forward, its all-gather
      backward; the sequence all-to-all for unpooled tables): the same
      blocks, with that collective's codecs, and forward the float32 sum of
      each peer's partial sums into the rank's own (half as much again as a
      copy, at :attr:`~qcomm.CommsProfile.copy_Bps`);
    - data-parallel tables: the DDP all-reduce of their gradients with
      ``dense_codec`` (what :func:`~qcomm.ddp_comm_hook` sends).

    Each block costs its wire bytes (:func:`~qcomm.planner.wire_bytes`) over the link to
    its peer (a peer on the same host, rank ``r // local_world_size`` or, for a
    :class:`~qcomm.HostCodecs` that sets it, ``r // ranks_per_host``, over
    :attr:`~qcomm.CommsProfile.intra_host_Bps`, else :attr:`~qcomm.CommsProfile.inter_host_Bps`)
    plus its encode and decode time, with the codec of that peer where the
    registry holds a :class:`~qcomm.HostCodecs`, in milliseconds as TorchRec
    estimates. Other sharding types keep TorchRec's estimate.

    .. note::

        A block codec pads each rank's columns as a whole; the estimate pads
        each table's, the same for dimensions that are multiples of the
        codec's block (32 for the built-in ones).

    Args:
        topology (torchrec.distributed.planner.types.Topology): TorchRec's topology (its world and local world size).
        registry (Mapping[str, QuantizedCommCodecs], optional): the sharders'
            registry (:func:`~qcomm.build_registry`). Default: ``None`` (no codec).
        profile (CommsProfile, optional): the rates. Default: ``None``
            (:data:`~qcomm.planner.DEFAULT_PROFILE`).
        constraints (Mapping, optional): the planner's ``ParameterConstraints``
            by table. Default: ``None``.
        dense_codec (str | QuantizedCommCodec, optional): the DDP hook's
            codec, for data-parallel tables. Default: ``None`` (none: each
            table's gradients at its own dtype).

    Raises:
        TypeError: for a registry that is not a mapping, or a profile that
            is not a :class:`CommsProfile`.
        ValueError: for a :class:`~qcomm.HostCodecs` in the registry whose
            ``ranks_per_host`` is not the topology's ``local_world_size``.

    Examples::

        >>> import qcomm
        >>> from torchrec.distributed.planner import Topology
        >>> topology = Topology(world_size=2, local_world_size=1, compute_device="cpu")
        >>> estimator = CodecPerfEstimator(topology, qcomm.build_registry(forward="mx4", backward="bf16"))
    """

    def __init__(
        self,
        topology: Any,
        registry: Mapping[str, Any] | None = None,
        *,
        profile: CommsProfile | None = None,
        constraints: Mapping[str, Any] | None = None,
        dense_codec: Any = None,
    ) -> None:
        from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator

        if registry is not None and not isinstance(registry, Mapping):
            raise TypeError(
                f"registry: expected a mapping from CommOp names to codec pairs "
                f"(qcomm.build_registry), got {type(registry).__name__}"
            )
        if profile is not None and not isinstance(profile, CommsProfile):
            raise TypeError(
                f"profile: expected a qcomm.CommsProfile (or None), got {type(profile).__name__}"
            )
        if isinstance(dense_codec, str):
            from qcomm.discovery import load_codec

            dense_codec = load_codec(dense_codec)
        local = topology.local_world_size
        for op, codecs in (registry or {}).items():
            per_host = getattr(codecs, "ranks_per_host", None)
            if isinstance(codecs, HostCodecs) and per_host is not None and per_host != local:
                # The codecs by host split the peers as ranks_per_host says:
                # a plan costed on another split is costed on the wrong links.
                raise ValueError(
                    f"registry: {op}'s HostCodecs has ranks_per_host={per_host}, but "
                    f"topology has local_world_size={local}; give both the same"
                )
        self._topology = topology
        self._registry = dict(registry or {})
        self._profile = profile or DEFAULT_PROFILE
        self._constraints = constraints
        self._dense = dense_codec
        self._torchrec = EmbeddingPerfEstimator(topology=topology, constraints=constraints)

    @property
    def profile(self) -> CommsProfile:
        r"""
        profile() -> CommsProfile

        The rates it costs communication at.
        """
        return self._profile

    def estimate(self, sharding_options: list[Any], sharder_data_map: Any) -> None:
        r"""
        estimate(sharding_options: list[torchrec.distributed.planner.types.ShardingOption], sharder_data_map: torchrec.distributed.planner.types.SharderDataMap) -> None

        Sets each shard's ``perf``, in place, as TorchRec's estimators do
        (TorchRec's ``ShardEstimator.estimate``).

        Args:
            sharding_options (list[torchrec.distributed.planner.types.ShardingOption]): the options to estimate.
            sharder_data_map (torchrec.distributed.planner.types.SharderDataMap): TorchRec's
                sharder data, as its enumerator passes it.

        Raises:
            ValueError: for a ``sharder_data_map`` that is ``None``.
        """
        if sharder_data_map is None:
            # TorchRec's own estimator reads it for every option.
            raise ValueError(
                "sharder_data_map: expected TorchRec's SharderDataMap (the enumerator passes "
                "it; build_sharder_data of each sharder), got None"
            )
        self._torchrec.estimate(sharding_options, sharder_data_map=sharder_data_map)
        for option in sharding_options:
            for shard in option.shards:
                comms = self.shard_comms(option, shard)
                if comms is not None and shard.perf is not None:
                    shard.perf.fwd_comms, shard.perf.bwd_comms = comms

    def shard_comms(self, option: Any, shard: Any) -> tuple[float, float] | None:
        r"""
        shard_comms(option: torchrec.distributed.planner.types.ShardingOption, shard: torchrec.distributed.planner.types.Shard) -> tuple[float, float] | None

        The shard's forward and backward communication in milliseconds
        (the unit of TorchRec's estimates), or ``None`` for a sharding type
        it leaves to TorchRec.

        Args:
            option (torchrec.distributed.planner.types.ShardingOption): the table's option.
            shard (torchrec.distributed.planner.types.Shard): one of its shards (``size`` is ``[rows, dim]``).

        Returns:
            tuple[float, float] | None: forward and backward milliseconds, or ``None``.
        """
        from torchrec.distributed.types import ShardingType

        kind = option.sharding_type
        world = self._topology.world_size
        local = self._topology.local_world_size
        rows_total, cols = int(shard.size[0]), int(shard.size[1])
        if kind == ShardingType.DATA_PARALLEL.value:
            dense = self._dense
            if dense is None:
                # No hook: DDP all-reduces the gradients at the table's dtype.
                dense = NoOpQuantizedCommCodec(option.tensor.dtype)
            seconds = _allreduce_seconds(self._profile, dense, rows_total * cols, world, local)
            return 0.0, _MS * seconds
        a2a = (
            ShardingType.TABLE_WISE.value,
            ShardingType.COLUMN_WISE.value,
            ShardingType.TABLE_COLUMN_WISE.value,
        )
        if kind not in (*a2a, ShardingType.ROW_WISE.value):
            return None
        if not option.is_pooled:
            op = CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL
        elif kind == ShardingType.ROW_WISE.value:
            op = CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER
        else:
            op = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
        rows = _rows(option, self._constraints)
        if not option.is_pooled and kind == ShardingType.ROW_WISE.value:
            rows /= world  # a row-wise shard looks up its share of the ids
        block = math.ceil(rows)
        codecs = self._registry.get(op.name)
        if isinstance(codecs, HostCodecs) and codecs.ranks_per_host is not None:
            local = codecs.ranks_per_host  # what decides which codec a peer gets
        same = min(local, world) - 1
        peers = dict(same_host_peers=same, other_host_peers=world - 1 - same)
        pooled = op is CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
        fwd, bwd = (
            _peer_seconds(
                self._profile,
                codecs,
                forward=forward,
                rows=block,
                cols=cols,
                pooled=pooled,
                **peers,
            )
            for forward in (True, False)
        )
        if op is CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER:
            # qcomm decodes each peer's partial sums and adds them in float32:
            # half as much again as a copy of the block, per peer.
            fwd += (world - 1) * 1.5 * 4.0 * block * cols / self._profile.copy_Bps
        return _MS * fwd, _MS * bwd


def planner_topology(
    world_size: int,
    *,
    compute_device: str = "cuda",
    local_world_size: int | None = None,
    profile: CommsProfile | None = None,
    **kwargs: Any,
) -> Any:
    r"""
    planner_topology(world_size: int, *, compute_device: str = "cuda", local_world_size: int | None = None, profile: CommsProfile | None = None, **kwargs) -> torchrec.distributed.planner.types.Topology

    TorchRec's ``Topology`` with the profile's link rates as its
    ``generalized_comms_bandwidths`` (in TorchRec's bytes per millisecond),
    so that what TorchRec itself still costs (the ids' input distribution)
    sees the same link.

    Args:
        world_size (int): the ranks.
        compute_device (str, optional): ``"cuda"`` or ``"cpu"``. Default: ``"cuda"``.
        local_world_size (int, optional): ranks per host. Default: ``None``
            (all on one host, as TorchRec).
        profile (CommsProfile, optional): the rates. Default: ``None``
            (:data:`~qcomm.planner.DEFAULT_PROFILE`).
        **kwargs: the rest of ``Topology``'s arguments.

    Returns:
        torchrec.distributed.planner.types.Topology: the topology.

    Raises:
        ValueError: for a world or local world size that is not a positive int.
        TypeError: for a profile that is not a :class:`CommsProfile`.
    """
    from torchrec.distributed.planner.types import BasicCommsBandwidths, Topology

    for name, value in (("world_size", world_size), ("local_world_size", local_world_size)):
        if value is None and name == "local_world_size":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if profile is not None and not isinstance(profile, CommsProfile):
        raise TypeError(
            f"profile: expected a qcomm.CommsProfile (or None), got {type(profile).__name__}"
        )
    profile = profile or DEFAULT_PROFILE
    bandwidths = BasicCommsBandwidths(
        inter_host_bw=profile.inter_host_Bps / _MS, intra_host_bw=profile.intra_host_Bps / _MS
    )
    return Topology(
        world_size=world_size,
        compute_device=compute_device,
        local_world_size=local_world_size,
        generalized_comms_bandwidths=bandwidths,
        **kwargs,
    )


def profile_from_bench(results: str | os.PathLike[str] | Mapping[str, Any]) -> CommsProfile:
    r"""
    profile_from_bench(results: str | os.PathLike | Mapping[str, Any]) -> CommsProfile

    The :class:`CommsProfile` of a ``qcomm bench --json`` file (or its
    content): the link's rate between hosts as measured with ``--link``
    (both ways at once, each rank sending as in a collective; a ``--train``
    run, which does not measure it: the ``--link`` rate at TCP's
    efficiency), and inside a host as measured with ``--ranks-per-host`` (a
    rank per host: the same rate); each qcomm codec's encode and decode
    throughput at the size it ran; the memory copy's (``roofline``). What
    the file lacks comes from :data:`~qcomm.planner.DEFAULT_PROFILE`.

    Args:
        results (str | os.PathLike | Mapping[str, Any]): the file, or its JSON content.

    Returns:
        CommsProfile: the rates, its ``source`` ``"bench"`` where the file
        measured any.

    Raises:
        ValueError: for a file that cannot be read, or is not a bench run's
            JSON, naming ``results``.

    .. note::

        A codec run with several parameter sets (``int8`` and
        ``int8:row_dim=64``) is costed at the run with its default ones (the
        bare name), else at its first; codecs by host (``same_host=...``)
        are not single codecs and are left out.
    """
    from qcomm.benchmark.metrics import TCP_EFFICIENCY
    from qcomm.benchmark.results import LinkFigures, Results

    if isinstance(results, Mapping):
        data = results
    else:
        try:
            with open(results) as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"results: cannot read {os.fspath(results)!r} as a qcomm bench --json file: {err}"
            ) from None
    if not isinstance(data, Mapping) or "meta" not in data:
        raise ValueError(f"results: expected the JSON of a qcomm bench run, got {results!r}")
    run = Results.of(data)
    inter = DEFAULT_PROFILE.inter_host_Bps
    intra = DEFAULT_PROFILE.intra_host_Bps
    link = run.link
    source = "model"
    if isinstance(link, LinkFigures) and (link.both_ways_GBps or link.one_way_GBps):
        inter = 1e9 * float(link.both_ways_GBps or link.one_way_GBps or 0.0)
        source = "bench"
        if link.same_host_both_ways_GBps:
            intra = 1e9 * link.same_host_both_ways_GBps
        elif not run.bench_meta.ranks_per_host:
            # A rank per host: every peer is on another host.
            intra = inter
    elif link is not None and link.rate_bps:
        # A --train run names its link's rate and does not measure it.
        inter = link.rate_bps / 8 * TCP_EFFICIENCY
        source = "bench"
    copy = DEFAULT_PROFILE.copy_Bps
    if run.roofline is not None and run.roofline.copy_GBps:
        copy = 1e9 * run.roofline.copy_GBps
    encode: dict[str, float] = {}
    decode: dict[str, float] = {}
    bare: set[str] = set()  # names whose rates come from the default parameters
    for row in run.codecs or []:
        if row.source != "qcomm" or row.status != "ok":
            continue
        name, _, params = row.codec.partition(":")
        if "=" in name or name in bare or (params and name in encode | decode):
            continue
        if not params:
            bare.add(name)
        encode.pop(name, None)
        decode.pop(name, None)
        if row.encode_GBps:
            encode[name] = 1e9 * row.encode_GBps
        if row.decode_GBps:
            decode[name] = 1e9 * row.decode_GBps
    if encode:
        source = "bench"
    return CommsProfile(
        inter_host_Bps=inter,
        intra_host_Bps=intra,
        encode_Bps=encode,
        decode_Bps=decode,
        copy_Bps=copy,
        source=source,
    )


#: the sharding types :func:`plan_specs` writes (and ``qcomm bench --train-plan`` runs)
PLAN_SHARDINGS = ("table_wise", "row_wise", "column_wise")


def plan_specs(plan: Any) -> dict[str, str]:
    r"""
    plan_specs(plan: torchrec.distributed.types.ShardingPlan | Mapping[str, torchrec.distributed.types.ParameterSharding]) -> dict[str, str]

    Each table's sharding in a planner's plan, as ``qcomm bench --train-plan``
    reads it (see :doc:`planner`): ``table_wise:RANK``,
    ``column_wise:RANK,RANK,...`` (equal column shards) or ``row_wise``.

    Args:
        plan (torchrec.distributed.types.ShardingPlan | Mapping[str, torchrec.distributed.types.ParameterSharding]): the planner's
            plan (of one module), or one module's table-to-sharding mapping.

    Returns:
        dict[str, str]: each table's sharding, by table name.

    Raises:
        TypeError: for a plan that is neither a ``ShardingPlan`` nor a mapping.
        ValueError: for a plan of several modules, or a sharding type
            outside :data:`~qcomm.planner.PLAN_SHARDINGS`, naming the table.
    """
    tables = plan
    if hasattr(plan, "plan"):
        modules = list(plan.plan.values())
        if len(modules) != 1:
            raise ValueError(
                f"plan: expected the plan of one embedding module, got {len(modules)} modules"
            )
        tables = modules[0]
    if not isinstance(tables, Mapping):
        raise TypeError(
            f"plan: expected TorchRec's ShardingPlan or a mapping from table names to "
            f"ParameterSharding, got {type(tables).__name__}"
        )
    specs = {}
    for name, sharding in tables.items():
        kind = sharding.sharding_type
        if kind not in PLAN_SHARDINGS:
            raise ValueError(
                f"plan: table {name!r} is sharded {kind}; expected one of {', '.join(PLAN_SHARDINGS)}"
            )
        ranks = ",".join(str(r) for r in sharding.ranks or [])
        specs[name] = f"{kind}:{ranks}" if kind in ("table_wise", "column_wise") else kind
    return specs
