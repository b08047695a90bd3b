r"""
The conformance kit: :func:`check_codec` holds a codec to the contract of
:doc:`codecs` and to the error bound it declares; ``qcomm check`` and the
``qcomm_check_codec`` pytest fixture run it too.

The rules, in order (the first one broken raises :class:`ConformanceError`):

- ``dtype``: ``quantized_dtype`` is an attribute holding the wires' dtype.
- ``ctx``: the methods work with ``ctx=None`` and a fresh context, and
  ``decode`` gives the same values whatever context it gets.
- ``shape``: ``encode`` returns 1-D, ``decode`` 1-D floats of the input's
  length (up to the next multiple of the block).
- ``size``: ``calc_quantized_size(n)`` is the wire's length, for ``n`` in 0,
  1, primes, lengths around the block and one near ``1e5``.
- ``round_trip``: round trips keep the declared bound on normal, wide, tiny,
  huge and constant data; finite inputs decode finite.
- ``determinism``: the same input gives the same bytes (unless ``stochastic``).
- ``additive``: sizes of block-aligned pieces add up, and the wire of a
  concatenation split by them decodes piece by piece.
- ``padded_size``: TorchRec's pooled calls pad, record every rank's width,
  and the padded input round-trips split by batch.
- ``no_mutation``: no call changes its input.
- ``bits``: ``bits_per_element`` matches a long input's wire within 1%.
- ``summable``: if declared, summed wires decode to the sum within the bound.
- ``decode_into``: if present, it writes exactly ``decode``'s bits into a
  contiguous output, a band of columns and a transposed view, nothing else.
- ``round_trip_error``: if present (and the codec is not stochastic), it
  gives the errors of ``decode(encode(x))`` within a relative ``1e-4``, or
  ``None``, for a 1-D input, one with a partial last block and rows of whole
  blocks lying apart.

The block is ``CodecInfo.error_block`` when above ``1``, else ``1``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from qcomm.types import CodecError, CodecInfo, codec_info, dtype_bits

__all__ = ["RULES", "CodecReport", "ConformanceError", "check_codec"]

RULES = (
    "dtype",
    "ctx",
    "shape",
    "size",
    "round_trip",
    "determinism",
    "additive",
    "padded_size",
    "no_mutation",
    "bits",
    "summable",
    "decode_into",
    "round_trip_error",
)


class ConformanceError(CodecError):
    r"""
    A codec broke a rule of the kit; a :class:`~qcomm.CodecError` whose message
    names the rule, the codec and the input.

    Args:
        rule (str): the rule broken, one of ``qcomm.testing.RULES``.
        codec (str): the codec's name.
        detail (str): what was called, on what input, and what came back.
    """

    def __init__(self, rule: str, codec: str, detail: str) -> None:
        super().__init__(f"codec {codec!r} breaks rule {rule!r}: {detail}")
        self.rule = rule
        self.codec = codec
        self.detail = detail

    def __reduce__(self) -> tuple[Any, tuple[str, str, str]]:
        # Rebuilt from its three parts, so that it crosses process boundaries
        # (a check run on a spawned rank) intact.
        return type(self), (self.rule, self.codec, self.detail)


@dataclasses.dataclass(frozen=True)
class CodecReport:
    r"""
    What :func:`check_codec` found for a codec that passed.

    Args:
        codec (str): the codec's name.
        info (CodecInfo): what the codec declares, or the defaults assumed.
        rules (tuple[str, ...]): the rules passed, in order.
        skipped (tuple[str, ...]): rules not checked, each with the reason.
        lengths (tuple[int, ...]): input lengths of the ``size`` rule.
        worst_error (float): the largest round-trip error relative to the
            declared bound (``<= 1``); ``nan`` when none is declared.
    """

    codec: str
    info: CodecInfo
    rules: tuple[str, ...]
    skipped: tuple[str, ...]
    lengths: tuple[int, ...]
    worst_error: float

    def summary(self) -> str:
        r"""
        summary() -> str

        One line: the rules passed, the worst error, the rules skipped.
        """
        if math.isnan(self.worst_error):
            error = "no error bound declared, outputs finite"
        else:
            error = f"worst round-trip error {self.worst_error:.3g} of the declared bound"
        text = f"{len(self.rules)} rules passed ({', '.join(self.rules)}); {error}"
        if self.skipped:
            text += f"; skipped: {', '.join(self.skipped)}"
        return text

    def __str__(self) -> str:
        return f"{self.codec}: {self.summary()}"


@dataclasses.dataclass
class _Run:
    # What one check_codec call carries from rule to rule.
    codec: Any
    info: CodecInfo
    block: int
    device: torch.device
    generator: torch.Generator
    dtype: torch.dtype = torch.float32
    rule: str = "dtype"
    worst: float = 0.0

    def fail(self, detail: str, rule: str | None = None) -> ConformanceError:
        return ConformanceError(rule or self.rule, self.info.name, detail)


# -- data ---------------------------------------------------------------------


def _normal(run: _Run, n: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(n, generator=run.generator, dtype=torch.float64) * scale
    return _within_range(run, x)


def _within_range(run: _Run, x: torch.Tensor) -> torch.Tensor:
    # The bound is promised only up to max_abs_input; stay inside it (and
    # inside float32) after the cast as well.
    limit = min(run.info.max_abs_input, torch.finfo(torch.float32).max)
    return x.clamp(-limit, limit).to(torch.float32).clamp(-limit, limit).to(run.device)


def _datasets(run: _Run, n: int) -> list[tuple[str, torch.Tensor]]:
    gen = run.generator
    sets = [("normal", _normal(run, n)), ("normal x1000", _normal(run, n, 1e3))]
    wide = torch.randn(n, generator=gen, dtype=torch.float64)
    wide *= 10.0 ** torch.empty(n, dtype=torch.float64).uniform_(-4, 4, generator=gen)
    sets.append(("wide-ranging (1e-4..1e4)", _within_range(run, wide)))
    for level in (1e-7, 1e-30, 1e-40):
        sets.append((f"tiny ({level:g})", _normal(run, n, level)))
    huge = [1e30, 1e38]
    if math.isfinite(run.info.max_abs_input):
        huge = [h for h in huge if h < run.info.max_abs_input] + [run.info.max_abs_input]
    for level in huge:
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        x = x / x.abs().max() * level if n else x
        sets.append((f"huge (max |x| {level:g})", _within_range(run, x)))
    for value in (0.0, 0.1, -7.5):
        constant = torch.full((n,), value, dtype=torch.float64)
        sets.append((f"constant {value:g}", _within_range(run, constant)))
    return sets


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Byte equality, so that NaN payloads compare equal to themselves.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _describe(x: torch.Tensor, label: str) -> str:
    return f"<{label}, {x.numel()} x {str(x.dtype).replace('torch.', '')}>"


# -- calling the codec --------------------------------------------------------


def _call(run: _Run, what: str, method: str, *args: Any) -> Any:
    # Whatever the codec raises, a missing method included, is reported as
    # the current rule broken.
    try:
        return getattr(run.codec, method)(*args)
    except ConformanceError:
        raise
    except Exception as err:
        raise run.fail(f"{what} raised {type(err).__name__}: {err}") from err


def _context(run: _Run) -> Any:
    return _call(run, "create_context()", "create_context")


def _size(run: _Run, n: int, ctx: Any, ctx_name: str) -> int:
    what = f"calc_quantized_size({n}, ctx={ctx_name})"
    size = _call(run, what, "calc_quantized_size", n, ctx)
    try:
        return operator.index(size)
    except TypeError:
        raise run.fail(f"{what} returned {size!r}, expected an int") from None


def _encode(run: _Run, x: torch.Tensor, ctx: Any, label: str, ctx_name: str) -> torch.Tensor:
    what = f"encode({_describe(x, label)}, ctx={ctx_name})"
    before = x.clone()
    wire = _call(run, what, "encode", x, ctx)
    if not _same(x, before):
        raise run.fail(f"{what} changed its input tensor", "no_mutation")
    if not isinstance(wire, torch.Tensor):
        raise run.fail(f"{what} returned {type(wire).__name__}, expected a Tensor", "shape")
    if wire.dtype != run.dtype:
        raise run.fail(
            f"{what} returned dtype {wire.dtype}, but quantized_dtype is {run.dtype}", "dtype"
        )
    if wire.dim() != 1:
        raise run.fail(f"{what} returned shape {tuple(wire.shape)}, expected 1-D", "shape")
    return wire


def _decode(run: _Run, wire: torch.Tensor, ctx: Any, label: str, ctx_name: str) -> torch.Tensor:
    what = f"decode(<wire of {label}, {wire.numel()} words>, ctx={ctx_name})"
    before = wire.clone()
    out = _call(run, what, "decode", wire, ctx)
    if not _same(wire, before):
        raise run.fail(f"{what} changed its input tensor", "no_mutation")
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() != 1:
        got = f"{out.dtype} of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else out
        raise run.fail(f"{what} returned {got}, expected a 1-D floating-point tensor", "shape")
    return out


# -- the declared bound -------------------------------------------------------


def _covered(run: _Run, x: torch.Tensor) -> torch.Tensor:
    # Elements the bound speaks for: finite and not above max_abs_input.
    return x.isfinite() & (x.abs() <= run.info.max_abs_input)


def _bound(run: _Run, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound in float64, with s as CodecInfo defines it."""
    info = run.info
    if math.isinf(info.rel_error_bound) or math.isinf(info.abs_error_bound):
        return torch.full(x.shape, math.inf, dtype=torch.float64, device=x.device)
    mag = torch.where(_covered(run, x), x.double().abs(), 0.0)
    n, block = mag.numel(), info.error_block
    if block == 1 or n == 0:
        s = mag
    elif block == 0:
        s = mag.max().expand(n)
    else:
        blocks = -(-n // block)
        padded = torch.nn.functional.pad(mag, (0, blocks * block - n)).view(blocks, block)
        s = padded.amax(dim=1).repeat_interleave(block)[:n]
    return info.rel_error_bound * s + info.abs_error_bound


def _check_close(
    run: _Run,
    x: torch.Tensor,
    y: torch.Tensor,
    what: str,
    bound: torch.Tensor | None = None,
    rule: str | None = None,
) -> None:
    """Holds the decoded ``y`` (at least as long as ``x``) to the bound."""
    n = x.numel()
    longest = -(-n // run.block) * run.block
    if not n <= y.numel() <= longest:
        expected = f"{n}" if longest == n else f"{n} to {longest}"
        raise run.fail(f"{what} gave {y.numel()} elements, expected {expected}", "shape")
    y = y[:n].double()
    covered = _covered(run, x)
    bound = _bound(run, x) if bound is None else bound
    err = (y - x.double()).abs()
    bad = covered & ~(err <= bound)  # also catches NaN
    bad |= covered & ~y.isfinite()
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise run.fail(
            f"{what}: element {i} is {x[i].item()!r} but decodes to {y[i].item()!r} "
            f"(error {err[i].item():.4g}); the declared bound there is {bound[i].item():.4g} "
            f"(rel_error_bound {run.info.rel_error_bound:g}, abs_error_bound "
            f"{run.info.abs_error_bound:g}, error_block {run.info.error_block})",
            rule,
        )
    finite = covered & (bound > 0) & bound.isfinite()
    if bool(finite.any()):
        run.worst = max(run.worst, float((err[finite] / bound[finite]).max()))


# -- the rules ----------------------------------------------------------------


def _friendly(run: _Run) -> int:
    # The rules before ``size`` use a length that any block codec accepts,
    # so that a codec refusing odd lengths is reported by ``size``.
    return 128 * run.block


def _rule_dtype(run: _Run) -> None:
    try:
        dtype = run.codec.quantized_dtype
    except Exception as err:
        raise run.fail(f"reading quantized_dtype raised {type(err).__name__}: {err}") from err
    if callable(dtype) and not isinstance(dtype, torch.dtype):
        raise run.fail(
            "quantized_dtype is a method; the contract (and TorchRec's callers) read it as a "
            "attribute holding a torch.dtype"
        )
    if not isinstance(dtype, torch.dtype):
        raise run.fail(f"quantized_dtype is {dtype!r}, expected a torch.dtype")
    run.dtype = dtype
    x = _normal(run, _friendly(run))
    _encode(run, x, _context(run), "normal data", "create_context()")


def _rule_ctx(run: _Run) -> None:
    x = _normal(run, _friendly(run))
    _size(run, x.numel(), None, "None")
    wire = _encode(run, x, None, "normal data", "None")
    _decode(run, wire, None, "normal data", "None")
    # Two "ranks": the receiver's context went through the receiver's own
    # encode, never the sender's.
    ctx_a, ctx_b = _context(run), _context(run)
    _encode(run, x, ctx_a, "normal data", "ctx_a")
    other = _normal(run, x.numel(), 1e3)
    wire_b = _encode(run, other, ctx_b, "normal data x1000", "ctx_b")
    label = "normal data x1000"
    own = _decode(run, wire_b, ctx_b, label, "ctx_b")
    for ctx, name in ((ctx_a, "ctx_a of another encode"), (None, "None")):
        got = _decode(run, wire_b, ctx, label, name)
        if not _same(got, own):
            raise run.fail(
                f"decode of one wire gives other values with ctx={name} than with the context "
                f"of its own encode; a receiver never holds the sender's context, so what "
                f"decode needs must travel in-band"
            )


def _default_lengths(block: int) -> list[int]:
    lengths = {0, 1, 2, 3, 5, 7, 11, 13, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1021, 100_003}
    if block > 1:
        lengths |= {block - 1, block, block + 1, 2 * block - 1, 2 * block, 2 * block + 1}
        lengths |= {3 * block, 10 * block + 7}
    return sorted(lengths)


def _rule_size(run: _Run, lengths: Sequence[int]) -> None:
    for n in lengths:
        x = _normal(run, n)
        ctx = _context(run)
        sizes = (_size(run, n, None, "None"), _size(run, n, ctx, "create_context()"))
        wire = _encode(run, x, ctx, "normal data", "create_context()")
        if sizes[0] != wire.numel() or sizes[1] != wire.numel():
            raise run.fail(
                f"calc_quantized_size({n}) is {sizes[0]} with ctx=None and {sizes[1]} with a "
                f"fresh context, but encode of {n} elements returned {wire.numel()}",
                "size",
            )
        y = _decode(run, wire, ctx, "normal data", "create_context()")
        _check_close(run, x, y, f"decode(encode(<normal data, {n} elements>))", rule="round_trip")


def _rule_round_trip(run: _Run) -> None:
    aligned = -(-256 // run.block) * run.block
    for k, n in enumerate(sorted({aligned, aligned + 3})):
        for j, (label, x) in enumerate(_datasets(run, n)):
            # Each data set meets ctx=None at one length and a fresh context
            # at the other.
            ctx_name = "None" if (j + k) % 2 else "create_context()"
            ctx = None if (j + k) % 2 else _context(run)
            wire = _encode(run, x, ctx, label, ctx_name)
            y = _decode(run, wire, ctx, label, ctx_name)
            _check_close(run, x, y, f"decode(encode({_describe(x, label)}, ctx={ctx_name}))")


def _rule_determinism(run: _Run) -> None:
    x = _normal(run, _friendly(run))
    first = _encode(run, x, None, "normal data", "None")
    for ctx_name in ("create_context()", "create_context() on a copy"):
        again = x.clone() if "copy" in ctx_name else x
        wire = _encode(run, again, _context(run), "normal data", ctx_name)
        if not _same(wire, first):
            diff = (_bytes(wire) != _bytes(first)).nonzero()
            where = f" (first differing byte {int(diff[0])})" if diff.numel() else ""
            raise run.fail(
                f"encode of the same {x.numel()} elements with ctx=None and with "
                f"ctx={ctx_name} gave different wire bytes{where}; declare "
                f"CodecInfo(stochastic=True) if that is intended"
            )


def _rule_additive(run: _Run, stochastic: bool) -> None:
    b = run.block
    # One piece per destination of an all-to-all, an empty one included, with
    # magnitudes far apart so that a shared scale cannot hide.
    counts = [b, 2 * b, 0, 3 * b, b]
    pieces = [_normal(run, c, 10.0 ** (2 * i - 4)) for i, c in enumerate(counts)]
    whole = torch.cat(pieces)
    for ctx_name in ("None", "create_context()"):
        ctx = None if ctx_name == "None" else _context(run)
        sizes = [_size(run, c, ctx, ctx_name) for c in counts]
        total = _size(run, whole.numel(), ctx, ctx_name)
        if sum(sizes) != total:
            raise run.fail(
                f"calc_quantized_size of pieces of {counts} elements (multiples of the block "
                f"{b}) gives {sizes}, summing to {sum(sizes)}, but {total} for their "
                f"concatenation; TorchRec splits one wire tensor by these sizes"
            )
    label = f"pieces of {counts} elements"
    wire = _encode(run, whole, _context(run), label, "create_context()")
    bound = _bound(run, whole)
    parts = torch.split(wire, sizes)
    start = 0
    for count, piece, part in zip(counts, pieces, parts):
        what = f"decode of the split for elements {start}..{start + count} of encode(<{label}>)"
        y = _decode(run, part, _context(run), f"piece of {count}", "create_context()")
        _check_close(run, piece, y, what, bound[start : start + count])
        if not stochastic:
            alone = _encode(run, piece, _context(run), "one piece", "create_context()")
            if not _same(alone, part):
                raise run.fail(
                    f"the wire of a concatenation, split by calc_quantized_size, differs from "
                    f"encoding its piece of {count} elements alone (at elements "
                    f"{start}..{start + count})"
                )
        start += count
    y = _decode(run, torch.cat(list(parts)), None, label, "None")
    _check_close(run, whole, y, f"decode of the concatenated wires of <{label}>", bound)


def _padded_case(
    run: _Run, dims: list[int], batches: list[int], me: int
) -> tuple[int, list[int] | None]:
    x2d = _normal(run, sum(batches) * dims[me]).view(sum(batches), dims[me])
    ctx = _context(run)
    what = f"padded_size(<input {tuple(x2d.shape)}>, dim_per_rank={dims}, my_rank={me}, ctx)"
    before = x2d.clone()
    result = _call(run, what, "padded_size", x2d, list(dims), me, ctx)
    if not _same(x2d, before):
        raise run.fail(f"{what} changed its input tensor", "no_mutation")
    try:
        padded, padding = (operator.index(v) for v in result)
    except (TypeError, ValueError):
        raise run.fail(f"{what} returned {result!r}, expected (padded_dim_sum, padding)") from None
    width = dims[me]
    if padded < width or padding != padded - width:
        raise run.fail(
            f"{what} returned ({padded}, {padding}) for a width of {width}: expected "
            f"padded_dim_sum >= {width} and padding_size == padded_dim_sum - {width}"
        )
    recorded = getattr(ctx, "padded_dim_sum_per_rank", None)
    if recorded is not None:
        recorded = list(recorded)
        ok = len(recorded) == len(dims) and recorded[me] == padded
        if not ok or any(p < d for p, d in zip(recorded, dims)):
            raise run.fail(
                f"{what} returned padded width {padded} but recorded "
                f"padded_dim_sum_per_rank={recorded}; expected one entry >= each of {dims}, "
                f"entry {me} being {padded}"
            )
    elif padding:
        raise run.fail(
            f"{what} asks for {padding} padding columns but records no "
            f"ctx.padded_dim_sum_per_rank; TorchRec would size the receive splits by the "
            f"unpadded widths"
        )
    # The sender's side of TorchRec's pooled all-to-all: encode the padded
    # input once, split the wire by each destination's batch.
    x = torch.nn.functional.pad(x2d, (0, padding)) if padding else x2d.view(-1)
    flat = x.reshape(-1)
    label = f"padded input {tuple(x.shape)}"
    wire = _encode(run, x, ctx, label, "ctx")
    splits = [_size(run, padded * nb, ctx, "ctx") for nb in batches]
    if sum(splits) != wire.numel():
        raise run.fail(
            f"encode of the {label} returned {wire.numel()} words, but the splits by batch "
            f"{batches} x padded width {padded} are {splits} (sum {sum(splits)})"
        )
    bound = _bound(run, flat)
    start = 0
    for rank, (nb, part) in enumerate(zip(batches, torch.split(wire, splits))):
        end = start + nb * padded
        y = _decode(run, part, _context(run), f"rows for rank {rank}", "create_context()")
        where = f"decode of the {label}'s split for rank {rank} ({what})"
        _check_close(run, flat[start:end], y, where, bound[start:end])
        start = end
    return padded, recorded


def _rule_padded_size(run: _Run) -> None:
    b = run.block
    dims = [2 * b + 3, b, 5, 1] if b > 1 else [7, 4, 5, 1]
    batches = [2, 0, 3, 1]
    seen = [_padded_case(run, dims, batches, me) for me in range(len(dims))]
    padded = [p for p, _ in seen]
    for me, (_, recorded) in enumerate(seen):
        if recorded is not None and recorded != padded:
            raise run.fail(
                f"with dim_per_rank={dims}, rank {me} records padded_dim_sum_per_rank="
                f"{recorded}, but the ranks themselves pad to {padded}"
            )


def _rule_bits(run: _Run) -> None:
    n = -(-100_000 // run.block) * run.block
    measured = _size(run, n, None, "None") * dtype_bits(run.dtype) / n
    declared = run.info.bits_per_element
    if abs(measured - declared) > 0.01 * declared:
        raise run.fail(
            f"CodecInfo declares {declared:g} bits per element, but {n} elements take "
            f"{measured:g} bits each on the wire"
        )


def _rule_summable(run: _Run) -> None:
    n = 4 * run.block + 1
    a, b = _normal(run, n), _normal(run, n)
    ctx = _context(run)
    wire_a = _encode(run, a, ctx, "normal data a", "ctx")
    wire_b = _encode(run, b, _context(run), "normal data b", "ctx")
    y = _decode(run, wire_a + wire_b, ctx, "a + b", "ctx")
    # Each input's error, plus the backend's rounding of the sum in the wire
    # dtype, which the codec's relative bound covers for |a| + |b|.
    rel = run.info.rel_error_bound
    bound = _bound(run, a) + _bound(run, b) + _bound(run, a.abs() + b.abs()) * (1 + rel)
    _check_close(run, a + b, y, "decode(encode(a) + encode(b)) against a + b", bound)


def _rule_decode_into(run: _Run) -> None:
    width = 4 * run.block
    rows = 6
    x = _normal(run, rows * width, 3.0)
    wire = _encode(run, x, _context(run), "normal data", "create_context()")
    expected = _decode(run, wire, _context(run), "normal data", "create_context()")
    if expected.numel() != x.numel():
        raise run.fail(f"decode of {x.numel()} elements gave {expected.numel()}", "shape")
    sentinel = -12345.0
    wide = torch.full((rows, 3 * width), sentinel, device=run.device)
    square = torch.full((width, rows), sentinel, device=run.device)
    outs = [
        ("a contiguous 1-D tensor", torch.full((x.numel(),), sentinel, device=run.device)),
        (f"columns {width}..{2 * width} of a [{rows}, {3 * width}] matrix", wide[:, width:-width]),
        (f"the transpose of a [{width}, {rows}] matrix", square.t()),
    ]
    for where, out in outs:
        before = wire.clone()
        what = f"decode_into(<wire of {x.numel()} elements>, <{where}>)"
        _call(run, what, "decode_into", wire, out, _context(run))
        if not _same(wire, before):
            raise run.fail(f"{what} changed its input tensor", "no_mutation")
        got = out.reshape(-1)
        if not torch.equal(_bytes(got), _bytes(expected.to(torch.float32))):
            i = int((got != expected).nonzero()[0]) if bool((got != expected).any()) else 0
            raise run.fail(
                f"{what} wrote {got[i].item()!r} at element {i} where decode gives "
                f"{expected[i].item()!r}"
            )
    outside = torch.cat([wide[:, :width].reshape(-1), wide[:, -width:].reshape(-1)])
    if not bool((outside == sentinel).all()):
        raise run.fail("decode_into into a band of columns wrote outside the band")


def _rule_round_trip_error(run: _Run) -> None:
    rows, width = 6, 4 * run.block
    x = _normal(run, rows * 2 * width, 3.0)
    partial = 3 * run.block + max(1, run.block // 2) if run.block > 1 else 97
    samples = [
        ("a 1-D tensor", x),
        ("a 1-D tensor ending in a partial block", x[:partial]),
        (f"the rows of a [{rows}, {width}] band of a wider matrix", x.view(rows, -1)[:, :width]),
    ]
    for where, sample in samples:
        what = f"round_trip_error(<{where}>)"
        before = sample.clone()
        got = _call(run, what, "round_trip_error", sample)
        if not _same(sample, before):
            raise run.fail(f"{what} changed its input tensor", "no_mutation")
        if got is None:
            continue
        if (
            not isinstance(got, tuple)
            or len(got) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got)
        ):
            raise run.fail(f"{what} returned {got!r}, expected two floats or None")
        flat = sample.reshape(-1)
        wire = _encode(run, flat, _context(run), where, "create_context()")
        decoded = _decode(run, wire, _context(run), where, "create_context()")
        lost = decoded[: flat.numel()].double() - flat.double()
        expected = (
            float(lost.norm() / flat.double().norm()),
            float(lost.abs().max() / flat.double().abs().max()),
        )
        for name, value, want in zip(("RMS", "largest"), got, expected, strict=True):
            if not abs(value - want) <= 1e-4 * want + 1e-12:
                raise run.fail(
                    f"{what} gave the relative {name} error {value!r} where "
                    f"decode(encode(x)) has {want!r}"
                )


# The longest input the kit builds; 64 MiB of float32 (128 MiB as the float64
# it is drawn in).
_MAX_ELEMENTS = 1 << 24


def check_codec(
    codec: Any,
    *,
    lengths: Sequence[int] | None = None,
    seed: int = 0,
    block: int | None = None,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> CodecReport:
    r"""
    check_codec(codec: Any, *, lengths: Sequence[int] | None = None, seed: int = 0, block: int | None = None, device: str | torch.device = "cpu", progress: Callable[[str], None] | None = None) -> CodecReport

    Holds ``codec`` to the contract and its declared error bound (the module
    lists the rules); a codec without :class:`~qcomm.CodecInfo` gets the
    defaults of :func:`~qcomm.codec_info`, so only finite round trips.

    Args:
        codec (Any): the codec.
        lengths (Sequence[int], optional): lengths of the ``size`` rule.
            Default: ``None`` (0, 1, primes, around the block, 100003).
        seed (int, optional): seed of the test data. Default: ``0``.
        block (int, optional): what all-to-all pieces are multiples of.
            Default: ``None`` (see the module).
        device (str | torch.device, optional): where the data lives.
            Default: ``"cpu"``.
        progress (Callable[[str], None], optional): called with each rule's
            name before it runs. Default: ``None``.

    Returns:
        CodecReport: the rules passed and the worst error against the bound.

    Raises:
        ConformanceError: on the first rule broken.
        ValueError: if ``lengths``, ``block`` or ``device`` are invalid, or the
            test data would exceed :math:`2^{24}` elements.

    Examples::

        >>> from qcomm import NoOpQuantizedCommCodec
        >>> report = check_codec(NoOpQuantizedCommCodec(), lengths=[0, 1, 7])
        >>> report.worst_error, "size" in report.rules
        (0.0, True)
    """
    info = codec_info(codec)
    own_info = isinstance(getattr(codec, "info", None), CodecInfo)
    if block is None:
        block = info.error_block if info.error_block > 1 else 1
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if 128 * block > _MAX_ELEMENTS:
        whose = f" (CodecInfo.error_block of {info.name!r})" if block == info.error_block else ""
        raise ValueError(
            f"block {block}{whose} is too large to check: the kit encodes inputs of 128 "
            f"blocks, and holds them to {_MAX_ELEMENTS} elements (a block of at most "
            f"{_MAX_ELEMENTS // 128}) so that its own test data fit in memory"
        )
    if lengths is None:
        lengths = _default_lengths(block)
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if bad:
        raise ValueError(f"lengths must be non-negative ints, got {bad}")
    huge = [n for n in lengths if n > _MAX_ELEMENTS]
    if huge:
        raise ValueError(f"lengths: {huge[0]} is too large; the kit checks up to {_MAX_ELEMENTS}")
    dev = torch.device(device)
    if dev.type not in info.devices:
        raise ValueError(
            f"device {str(dev)!r} is not among the devices {info.name!r} declares: {info.devices}"
        )
    run = _Run(codec, info, block, dev, torch.Generator().manual_seed(seed))
    skipped = []
    steps: list[tuple[str, Callable[[], None] | str]] = [
        ("dtype", lambda: _rule_dtype(run)),
        ("ctx", lambda: _rule_ctx(run)),
        ("shape", lambda: None),  # checked on every call
        ("size", lambda: _rule_size(run, lengths)),
        ("round_trip", lambda: _rule_round_trip(run)),
        (
            "determinism",
            "the codec declares stochastic" if info.stochastic else lambda: _rule_determinism(run),
        ),
        ("additive", lambda: _rule_additive(run, info.stochastic)),
        ("padded_size", lambda: _rule_padded_size(run)),
        ("no_mutation", lambda: None),  # checked on every call
        ("bits", (lambda: _rule_bits(run)) if own_info else "no CodecInfo declared"),
        ("summable", (lambda: _rule_summable(run)) if info.summable else "not declared summable"),
        (
            "decode_into",
            (lambda: _rule_decode_into(run))
            if callable(getattr(codec, "decode_into", None))
            else "no decode_into",
        ),
        (
            "round_trip_error",
            "no round_trip_error"
            if not callable(getattr(codec, "round_trip_error", None))
            else "the codec declares stochastic"
            if info.stochastic
            else lambda: _rule_round_trip_error(run),
        ),
    ]
    passed = []
    for rule, step in steps:
        if isinstance(step, str):
            skipped.append(f"{rule} ({step})")
            continue
        run.rule = rule
        if progress is not None:
            progress(rule)
        step()
        passed.append(rule)
    no_bound = math.isinf(info.rel_error_bound) or math.isinf(info.abs_error_bound)
    return CodecReport(
        codec=info.name,
        info=info,
        rules=tuple(passed),
        skipped=tuple(skipped),
        lengths=tuple(lengths),
        worst_error=math.nan if no_bound else run.worst,
    )
