r"""
The ``mx4`` codec: OCP MXFP4 in fbgemm-gpu's layout (``fp32_to_mx4``), E2M1
elements two per byte and one E8M0 exponent per group. The bytes are those
of fbgemm's CPU reference ``py_quantize_mx4`` for finite input (tested bit
for bit), computed by vectorized torch code on any device, or on CPU by
qcomm's C kernels (but for ``stochastic``) with the same bits.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from qcomm import BlockCodec, CodecInfo
from qcomm.collectives._buffers import empty as _empty
from qcomm_builtin._native import kernel_input, kernels, lines_of, round_trip_error

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "ROUNDING_MODES",
    "MX4Codec",
    "decode_mx4",
    "encode_mx4",
    "shared_exponents",
]

# fbgemm's quantize_comm.MX_GROUP_SIZE_DEFAULT, what TorchRec's MX4 comms use.
DEFAULT_GROUP_SIZE = 32

# fbgemm's RoundingMode members, in the order of their values (0..4). They
# choose how the shared exponent follows from the group's largest magnitude.
ROUNDING_MODES = ("nearest", "floor", "even", "stochastic", "ceil")

# E2M1's top binade is [4, 8): E is the group maximum's exponent minus this.
_EBITS = 2
_INF_BITS = 0x7F800000
_NAN_EXPONENT = 255  # E8M0's NaN, which fbgemm never writes (its bytes are 0..252)
_NAN_INF_BUCKET = 0xFF << 2  # a float32's top 11 bits with its exponent bits all ones

# The E2M1 values of the codes 0..15 (bit 3 is the sign). Code 8 decodes to
# +0.0, not -0.0, as in fbgemm's table (whose "-0" is Python's integer 0).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_SIGNED = _E2M1 + (0.0,) + tuple(-v for v in _E2M1[1:])

# Elements are rounded to the nearest E2M1 value, ties away from zero (what
# fbgemm's add-one-then-shift does), and saturate at 6: a magnitude v gets
# the code counting these thresholds at or below it.
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# Elements per step of the loops over groups. The step's temporaries (at most
# 16 MiB) are reused from step to step and mostly stay in cache, whereas
# full-size ones would be page-faulted in afresh on every call, which costs
# more than the arithmetic. Few, large steps keep the number of parallel
# regions low, which matters when other processes compete for the cores.
_CHUNK_ELEMENTS = 1 << 22


# The lookup tables are built on the device that uses them, from Python
# scalars only: copying a CPU-built table there would wait for the device (a
# blocking copy from pageable memory) on the first call.


@functools.cache
def _code_table(device: torch.device) -> torch.Tensor:
    # E2M1 code (sign included) of a scaled float32 v, indexed by its top 11
    # bits (sign, exponent, 2 mantissa bits): every threshold is a multiple
    # of 2**21 in float32 bit space, so all floats sharing those bits share
    # one code. Scaled finite values are below 8, so the NaN/Inf buckets
    # (exponent bits all ones) serve only the elements of non-finite groups,
    # which encode_mx4 scales into them: code 0, whatever the sign.
    k = torch.arange(2048, dtype=torch.int32, device=device)
    magnitude = ((k & 1023) << 21).view(torch.float32)
    code = torch.zeros_like(k)
    for threshold in _THRESHOLDS:
        code += magnitude >= threshold
    code |= (k >> 10) << 3
    code = torch.where((k & _NAN_INF_BUCKET) == _NAN_INF_BUCKET, 0, code)
    return code.to(torch.uint8)


def _exponent_scales(device: torch.device) -> torch.Tensor:
    # E8M0: byte e means 2**(e - 127), byte 255 means NaN. Built from bits,
    # so exact; 2**-127 is a float32 subnormal.
    e = torch.arange(256, dtype=torch.int32, device=device)
    scale = (e << 23).view(torch.float32)
    scale = torch.where(e == 0, 2.0**-127, scale)
    return torch.where(e == _NAN_EXPONENT, math.nan, scale)


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    # The two decoded floats of every (exponent byte, element byte), as one
    # int64 per entry: entry (e << 8) | b holds value(b & 15) * 2**(e - 127)
    # then value(b >> 4) * 2**(e - 127), the same float32 products fbgemm
    # computes (exact: the scales are powers of two). One gather decodes.
    b = torch.arange(256, device=device)
    pairs = torch.zeros(256, 2, device=device)
    for code, value in enumerate(_E2M1_SIGNED):
        pairs[:, 0].masked_fill_((b & 15) == code, value)
        pairs[:, 1].masked_fill_((b >> 4) == code, value)
    table = pairs.unsqueeze(0) * _exponent_scales(device).view(256, 1, 1)  # [256, 256, 2]
    return table.reshape(-1, 2).contiguous().view(torch.int64).reshape(-1)


def shared_exponents(group_max: torch.Tensor, rounding: str) -> torch.Tensor:
    r"""
    shared_exponents(group_max: Tensor, rounding: str) -> Tensor

    The shared exponent :math:`E` of every group, from its largest magnitude
    :math:`M` (finite), with fbgemm's float32 operations in fbgemm's order:
    with :math:`\ell = \log_2 \max(M, 2^{-126})`, :math:`\lfloor \ell + 1/2
    \rfloor - 2` (``nearest``), :math:`\lfloor \ell \rfloor - 2` (``floor``),
    :math:`\lceil \ell \rceil - 2` (``ceil``), or :math:`\lfloor \log_2 M'
    \rfloor - 2` where :math:`M'` adds :math:`2^{21} - 1` (``even``) or a random
    number below :math:`2^{22}` (``stochastic``) to :math:`M`'s bits, stopping
    at infinity; then clamped to :math:`[-127, 125]`.

    Examples::

        >>> shared_exponents(torch.tensor([1.0, 5.0, 7.5, 0.0]), "even").tolist()
        [-2.0, 0.0, 1.0, -127.0]
    """
    # fbgemm replaces a zero maximum by 2**-126; raising every maximum below
    # 2**-126 to it gives the same exponents (all clamp to -127) in one step.
    m = torch.clamp(group_max, min=2.0**-126)
    if rounding == "nearest":
        e = torch.floor(torch.log2(m) + 0.5)
    elif rounding == "floor":
        e = torch.floor(torch.log2(m))
    elif rounding in ("even", "stochastic"):
        bump: torch.Tensor | int = (1 << 21) - 1
        if rounding == "stochastic":
            bump = torch.randint_like(m, high=2**31 - 1, dtype=torch.int32) & ((1 << 22) - 1)
        # Rounding a maximum above ~2.9e38 up carries past infinity into NaN
        # bits; fbgemm then writes the group as zeros. Stopping at infinity
        # gives the largest exponent instead, so such a group saturates.
        bits = torch.clamp(m.view(torch.int32) + bump, max=_INF_BITS)
        e = torch.floor(torch.log2(bits.view(torch.float32)))
    elif rounding == "ceil":
        e = torch.ceil(torch.log2(m))
    else:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    return torch.clamp(e - _EBITS, -127, 125)


# Mantissas (of 2**23) probed in every binade to build _exponent_table: all
# of them near where an exponent can step (the bottom, sqrt(2) and the top of
# the binade), and a sparse grid in between to check that it does not.
_PROBE_WINDOW = 2048
_MANTISSA_END = 1 << 23
_SQRT2_MANTISSA = round((math.sqrt(2.0) - 1.0) * _MANTISSA_END)


@functools.cache
def _exponent_table(rounding: str) -> torch.Tensor | None:
    # The C kernels' form of shared_exponents(): for every float32 exponent
    # field f (the binade [2**(f-127), 2**(f-126))), ints (base, lo, hi) such
    # that the E8M0 byte of a group maximum with field f and mantissa m is
    # base + (m >= lo) + (m >= hi). "even" reads the floor table at the
    # pre-rounded maximum. The bytes come from shared_exponents itself, so
    # from this torch's own float32 log2 and its rounding. Mathematically the
    # byte is constant in a binade except at most one step near its bottom,
    # sqrt(2) or top; float32 log2 (at most 1 ulp off, 2**-16 at |log2| <= 128)
    # can move a step only some 200 mantissas from where it belongs, well
    # inside the probed windows. Anything else found (a step of more than one,
    # downwards, between probes, or more than two) leaves the mode to torch:
    # None.
    mode = "floor" if rounding == "even" else rounding
    w, end = _PROBE_WINDOW, _MANTISSA_END
    probes = torch.cat(
        [
            torch.arange(0, w),
            torch.arange(_SQRT2_MANTISSA - w, _SQRT2_MANTISSA + w),
            torch.arange(end - w, end),
            torch.arange(0, end, end // 256),
        ]
    ).unique()  # sorted
    fields = torch.arange(1, 255)
    bits = ((fields[:, None] << 23) | probes[None, :]).to(torch.int32)
    exps = shared_exponents(bits.view(torch.float32).view(-1), mode).view(bits.shape)
    byte = exps.to(torch.int32) + 127
    steps = byte.diff(dim=1)
    adjacent = probes.diff() == 1
    if bool((steps < 0).any() | (steps > 1).any() | ((steps != 0) & ~adjacent).any()):
        return None
    if bool(((steps != 0).sum(dim=1) > 2).any()):
        return None
    at = torch.where(steps != 0, probes[1:], end).sort(dim=1).values
    table = torch.full((256, 3), end, dtype=torch.int32)
    table[1:255, 0] = byte[:, 0]
    table[1:255, 1:] = at[:, :2]
    # Field 0 is never looked up (maxima are raised to 2**-126 first); field
    # 255 is the pre-rounded maximum that reached infinity.
    ends = torch.tensor([2.0**-126, math.inf])
    table[[0, 255], 0] = shared_exponents(ends, mode).to(torch.int32) + 127
    return table


def encode_mx4(flat: torch.Tensor, group_size: int, rounding: str) -> torch.Tensor:
    r"""
    encode_mx4(flat: Tensor, group_size: int, rounding: str) -> Tensor

    The MX4 wire of whole groups of ``flat`` (contiguous float32): per group,
    ``group_size // 2`` bytes of E2M1 codes (element :math:`2i` in the low
    nibble of byte :math:`i`), then the exponent byte :math:`E + 127`, or 255
    (NaN) with zero codes for a group holding NaN or :math:`\pm\infty`.

    Examples::

        >>> encode_mx4(torch.tensor([1.0, -0.5, 6.0, 0.0]), 4, "even").tolist()
        [146, 7, 127]
    """
    half = group_size // 2
    groups = flat.view(-1, group_size)
    count = groups.shape[0]
    out = _empty((count, half + 1), torch.uint8, flat.device)
    if count == 0:
        return out.view(-1)
    step = max(1, _CHUNK_ELEMENTS // group_size)
    scaled = _empty((min(step, count), group_size), torch.float32, flat.device)
    # The group maxima first (amax propagates NaN), then every exponent in
    # one call, exactly as fbgemm computes them.
    group_max = torch.empty(count, dtype=torch.float32, device=flat.device)
    for start in range(0, count, step):
        stop = min(start + step, count)
        magnitude = torch.abs(groups[start:stop], out=scaled[: stop - start])
        torch.amax(magnitude, dim=1, out=group_max[start:stop])
    finite = torch.isfinite(group_max)
    group_max = torch.where(finite, group_max, 0.0)  # their exponent is replaced below
    exponent = shared_exponents(group_max, rounding).to(torch.int32)
    out[:, half] = torch.where(finite, exponent + 127, _NAN_EXPONENT).to(torch.uint8)
    # Multiplying by 2**-E (a normal float32 for every E) is exact wherever
    # the product is normal, so it equals fbgemm's division by 2**E; where
    # it is subnormal both give code 0. A non-finite group is multiplied by
    # NaN instead, which lands every element in a NaN bucket of the code
    # table (code 0): its exponent byte 255 is all the receiver needs, so
    # nothing has to reach the host, and no pass asks whether any group is
    # non-finite (on CUDA, asking waits for the device).
    inverse = ((127 - exponent) << 23).view(torch.float32)
    inverse = torch.where(finite, inverse, math.nan).unsqueeze(1)
    table = _code_table(flat.device)
    codes = torch.empty(scaled.numel(), dtype=torch.uint8, device=flat.device)
    packed = torch.empty(scaled.numel() // 2, dtype=torch.int16, device=flat.device)
    for start in range(0, count, step):
        stop = min(start + step, count)
        n = (stop - start) * group_size
        v = torch.mul(groups[start:stop], inverse[start:stop], out=scaled[: stop - start])
        bits = v.view(torch.int32).view(-1).bitwise_right_shift_(21).bitwise_and_(2047)
        c = torch.index_select(table, 0, bits, out=codes[:n])
        # Two codes as one little-endian int16 (low | high << 8) fold into
        # the byte low | high << 4; the cast to uint8 keeps the low byte.
        pair = c.view(torch.int16)
        p = torch.bitwise_right_shift(pair, 4, out=packed[: n // 2]).bitwise_or_(pair)
        out[start:stop, :half] = p.view(-1, half)
    return out.view(-1)


def decode_mx4(wire: torch.Tensor, group_size: int) -> torch.Tensor:
    r"""
    decode_mx4(wire: Tensor, group_size: int) -> Tensor

    The float32 values of an MX4 wire of whole groups: each element times
    :math:`2^{e-127}`; exponent byte 255 decodes its group to NaN.

    Examples::

        >>> decode_mx4(torch.tensor([146, 7, 127], dtype=torch.uint8), 4).tolist()
        [1.0, -0.5, 6.0, 0.0]
    """
    half = group_size // 2
    groups = wire.view(-1, half + 1)
    count = groups.shape[0]
    out = _empty((count * half,), torch.int64, wire.device)
    if count == 0:
        return out.view(torch.float32)
    table = _pair_table(wire.device)
    rows = out.view(count, half)
    high = groups[:, half:].to(torch.int32) << 8
    step = max(1, _CHUNK_ELEMENTS // group_size)
    index = torch.empty(min(step, count), half, dtype=torch.int32, device=wire.device)
    for start in range(0, count, step):
        stop = min(start + step, count)
        # A plain cast-copy then an add beats one mixed-dtype add.
        i = index[: stop - start].copy_(groups[start:stop, :half]).add_(high[start:stop])
        torch.index_select(table, 0, i.view(-1), out=rows[start:stop].view(-1))
    return out.view(torch.float32)


def _check_rounding(rounding: object) -> str:
    if isinstance(rounding, str) and rounding.strip().lower() in ROUNDING_MODES:
        return rounding.strip().lower()
    # fbgemm's RoundingMode is an IntEnum: accept its members and values too.
    if isinstance(rounding, numbers.Integral) and not isinstance(rounding, bool):
        if 0 <= int(rounding) < len(ROUNDING_MODES):
            return ROUNDING_MODES[int(rounding)]
    raise ValueError(
        f"rounding must be one of {', '.join(ROUNDING_MODES)} (fbgemm's RoundingMode), "
        f"got {rounding!r}"
    )


def _error_bound(rounding: str) -> tuple[float, float]:
    # Relative bound and the max_abs_input it holds up to. Let m = M / 2**E
    # be the group maximum M after scaling. Elements round to the nearest
    # E2M1 value, so the error is at most half a step (0.25 below 2, 0.5 in
    # [2, 4), 1 in [4, 6]), and above 6 it is the saturation v - 6. The worst
    # error over elements v <= m, divided by m, is at most 0.2 for every m in
    # [2, 7] (attained at m = 2.5 and m = 5: 5 rounds to 6), and tends to
    # 0.25 as m nears 8 (7.99 saturates to 6). m < 2 happens only where E is
    # clamped at -127: errors there are at most 0.25 * 2**-127, the absolute
    # part of the bound.
    # - nearest: m in [2*sqrt(2), 4*sqrt(2)); ceil: m in (2, 4]; even
    #   (two-bit pre-rounding of M): m in (3.5, 7]. Bound 0.2. The clamp
    #   E <= 125 pushes m toward 8 only for M above 2**127.
    # - floor: m in [4, 8); stochastic: m in (3, 8). Bound 0.25 everywhere.
    # float32 log2 may round up near a power of two, which only moves m into
    # a lower range (m ~ 3.5 or 4), never past these bounds.
    if rounding in ("floor", "stochastic"):
        return 0.25, math.inf
    return 0.2, 2.0**127


class MX4Codec(BlockCodec):
    r"""
    The ``mx4`` codec (OCP MXFP4): every group of ``group_size`` elements shares
    a scale :math:`2^E`, and each element travels as a 4-bit E2M1 float
    (:math:`0, \pm 0.5, \pm 1, \pm 1.5, \pm 2, \pm 3, \pm 4, \pm 6`), :math:`x /
    2^E` rounded to nearest (ties away from zero), saturating at 6: :math:`4 +
    8/\text{group\_size}` bits per element. :math:`E` follows from the group's
    largest magnitude by ``rounding`` (:func:`shared_exponents`). A partial group
    is padded with zeros, as fbgemm pads.

    The bytes equal fbgemm's CPU reference in every rounding mode (``stochastic``
    with the same seed), except where a group's maximum exceeds about
    :math:`2.98 \cdot 10^{38}` (``even``; ``stochastic``: :math:`2.55 \cdot
    10^{38}`): it saturates here, fbgemm writes zeros. fbgemm's CUDA kernel
    takes some exponents from the float's bits rather than ``log2``, so a few
    ulps below a power of two it may pick one lower.

    Error bound, per group with largest magnitude :math:`M`:
    :math:`|\hat{x} - x| \le r M + 2^{-129}`, :math:`r = 0.2` for ``even``,
    ``nearest`` and ``ceil`` (for :math:`|x| \le 2^{127}`), :math:`0.25` for
    ``floor`` and ``stochastic``. A group holding NaN or :math:`\pm\infty` is
    sent with exponent byte 255 and decodes to NaN; fbgemm would send zeros.

    Args:
        group_size (int, optional): elements per exponent, even, 2 to 65536.
            Default: ``32`` (fbgemm's and TorchRec's).
        rounding (str, optional): ``"even"`` (fbgemm's codec: the maximum rounded
            to two significant bits first), ``"nearest"``, ``"floor"``,
            ``"ceil"`` or ``"stochastic"`` (then ``info`` declares it), or
            fbgemm's ``RoundingMode`` values 0-4. Default: ``"even"``.

    Examples::

        >>> codec = MX4Codec(group_size=4)
        >>> codec.decode(codec.encode(torch.tensor([1.0, -0.5, 6.0, 0.0, 2.5, 0.1]))).tolist()
        [1.0, -0.5, 6.0, 0.0, 3.0, 0.0, 0.0, 0.0]
    """

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, rounding: str = "even") -> None:
        super().__init__(group_size, option="group_size")
        self.wire_per_block = self.block // 2 + 1
        if self.block % 2:
            raise ValueError(
                f"group_size must be a positive even number (two elements per byte), got {group_size}"
            )
        self._rounding = _check_rounding(rounding)
        rel, max_abs = _error_bound(self._rounding)
        self.info = CodecInfo(
            name="mx4",
            bits_per_element=4.0 + 8.0 / self.block,
            stochastic=self._rounding == "stochastic",
            rel_error_bound=rel,
            abs_error_bound=2.0**-129,
            error_block=self.block,
            max_abs_input=max_abs,
        )

    @property
    def group_size(self) -> int:
        """Elements per shared exponent."""
        return self.block

    @property
    def rounding(self) -> str:
        """The rounding mode of the shared exponent."""
        return self._rounding

    @property
    def quantized_dtype(self) -> torch.dtype:
        """The wire dtype, ``torch.uint8``."""
        return torch.uint8

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        use = flat.device.type == "cpu" and flat.dim() == 1 and self._rounding != "stochastic"
        k = kernels() if use else None
        src = kernel_input(flat, torch.float32) if k is not None else None
        table = _exponent_table(self._rounding) if src is not None else None
        if k is not None and src is not None and table is not None:
            out = _empty((self.calc_quantized_size(src.numel()),), torch.uint8, src.device)
            pre_round = self._rounding == "even"
            k.mx4_encode(
                src.data_ptr(),
                src.numel(),
                out.data_ptr(),
                self.block,
                pre_round,
                table.data_ptr(),
            )
            return out
        # Elsewhere the torch code, on CUDA too. fbgemm's CUDA operators
        # (quantize_mx_cuda / dequantize_mx_cuda) write another wire: element
        # 2i in the high nibble, not the low one as fbgemm's reference and
        # Triton kernels put it, and the shared exponent from the maximum's
        # exponent bits whatever the rounding mode; fbgemm itself sends MX4
        # through Triton, which qcomm does not require.
        return encode_mx4(self.pad_blocks(flat).contiguous(), self.block, self._rounding)

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        k = kernels() if wire.device.type == "cpu" else None
        src = kernel_input(wire, torch.uint8, self.wire_per_block) if k is not None else None
        if k is not None and src is not None:
            groups = src.numel() // self.wire_per_block
            n = groups * self.block
            out = _empty((n,), torch.float32, src.device)
            if n:
                k.mx4_decode(src.data_ptr(), groups, out.data_ptr(), self.block, n, n)
            return out
        return decode_mx4(wire, self.block)

    def round_trip_error(self, input_tensor: torch.Tensor) -> tuple[float, float] | None:
        r"""
        round_trip_error(input_tensor: Tensor) -> tuple[float, float] | None

        The relative RMS and largest errors of ``decode(encode(input_tensor))``,
        from the C kernels in one pass (see :doc:`codecs`); ``None`` elsewhere,
        and with stochastic rounding (its draws are the call's own).
        """
        if self._rounding == "stochastic":
            return None
        table = _exponent_table(self._rounding)
        if table is None:
            return None
        pre_round = self._rounding == "even"
        return round_trip_error("mx4", input_tensor, self.block, pre_round, table)

    def dequantize_into(self, wire: torch.Tensor, out: torch.Tensor) -> None:
        k = kernels() if wire.device.type == "cpu" else None
        src = kernel_input(wire, torch.uint8, self.wire_per_block) if k is not None else None
        groups = wire.numel() // self.wire_per_block
        lines = lines_of(out, groups * self.block, self.block) if src is not None else None
        if k is None or src is None or lines is None:
            super().dequantize_into(wire, out)
            return
        k.mx4_decode(src.data_ptr(), groups, out.data_ptr(), self.block, *lines)

    def __repr__(self) -> str:
        return f"MX4Codec(group_size={self.block}, rounding={self._rounding!r})"
