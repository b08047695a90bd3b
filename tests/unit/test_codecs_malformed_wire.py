"""Malformed wire data handed to decode raises (``ValueError``, ``TypeError``
or ``CodecError``) on every built-in codec, valid wires of any layout decode
alike, and garbage bytes of a valid size decode to the right length without
crashing. In a fresh interpreter, so that an out-of-bounds read that crashes
shows as a failure, not a dead pytest."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from codec_names import BUILTIN

MALFORMED = textwrap.dedent(
    """
    import json, sys, torch, qcomm
    from qcomm import CodecError

    def malformed(wire):
        n = wire.numel()
        yield "truncated by one", wire[:-1]
        yield "truncated to one element", wire[:1]
        yield "one element extra", torch.cat([wire, wire[:1]])
        yield "empty", wire[:0]
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                      torch.uint8, torch.int8, torch.int64, torch.float8_e4m3fn):
            if dtype != wire.dtype:
                yield f"wrong dtype {dtype}", wire.to(dtype)
        if wire.element_size() in (1, 2):
            same = {1: (torch.int8, torch.uint8), 2: (torch.float16, torch.bfloat16)}
            for dtype in same[wire.element_size()]:
                if dtype != wire.dtype:
                    yield f"bytes reinterpreted as {dtype}", wire.view(dtype)
        yield "not a tensor", wire.tolist()
        yield "0-D", wire[0]
        yield "half the bytes", wire[: n // 2 + 1]

    codecs = sys.argv[1:]
    report = {}
    gen = torch.Generator().manual_seed(0)
    for name in codecs:
        codec = qcomm.load_codec(name)
        good = codec.encode(torch.randn(96, generator=gen))
        expected = good.numel()
        rows = []
        valid = {codec.calc_quantized_size(n) for n in range(0, 4 * expected + 64)}
        for label, wire in malformed(good):
            if isinstance(wire, torch.Tensor) and wire.dtype == good.dtype and wire.numel() in valid:
                # A length some input encodes to (any length, for a cast):
                # not malformed, as codecs read wires flat.
                rows.append([label, "valid wire", str(wire.numel())])
                continue
            try:
                out = codec.decode(wire)
            except (ValueError, TypeError, CodecError) as err:
                rows.append([label, "raised", type(err).__name__])
                continue
            except Exception as err:
                rows.append([label, "wrong error", f"{type(err).__name__}: {err}"])
                continue
            rows.append([label, "decoded", f"{getattr(out, 'numel', lambda: '?')()} elements"])
        # A valid wire that is not contiguous, or starts at an odd byte of a
        # larger buffer (a piece of a received wire), decodes like the wire.
        reference = codec.decode(good.clone())
        views = {
            "strided view": torch.stack([good, good], dim=1).view(-1)[::2],
            "odd byte offset": torch.cat([good[:1], good])[1:],
        }
        for label, wire in views.items():
            try:
                same = torch.equal(codec.decode(wire), reference)
                rows.append([label, "decoded" if same else "decoded differently", ""])
            except Exception as err:
                rows.append([label, "raised on valid wire", f"{type(err).__name__}: {err}"])
        # Garbage content of a valid size and dtype must decode (to anything,
        # NaN included) without crashing, to the right length.
        for trial in range(200):
            blocks = int(torch.randint(1, 9, (), generator=gen))
            size = codec.calc_quantized_size(32 * blocks)
            if good.dtype.is_floating_point:
                bits = torch.randint(0, 256, (size * good.element_size(),), dtype=torch.uint8, generator=gen)
                junk = bits.view(good.dtype)
            else:
                junk = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(good.dtype)
            try:
                out = codec.decode(junk)
                ok = out.numel() >= 32 * blocks and out.dim() == 1
                rows.append([f"garbage {trial}", "decoded" if ok else "wrong length", str(out.numel())])
            except Exception as err:
                rows.append([f"garbage {trial}", "raised on valid size", f"{type(err).__name__}: {err}"])
        report[name] = rows
    print(json.dumps(report))
    """
)


def test_malformed_wire_raises_on_every_builtin_codec() -> None:
    out = subprocess.run(
        [sys.executable, "-c", MALFORMED, *BUILTIN], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (
        f"the decoding process died ({out.returncode}):\n{out.stderr[-3000:]}"
    )
    report = json.loads(out.stdout)
    assert sorted(report) == sorted(BUILTIN)
    problems = []
    for name, rows in report.items():
        for label, what, detail in rows:
            garbage = label.startswith(("garbage", "strided view", "odd byte offset"))
            if what == "valid wire":
                continue
            if (garbage and what != "decoded") or (not garbage and what != "raised"):
                problems.append(f"{name}: {label}: {what} ({detail})")
    assert not problems, "\n".join(problems)
