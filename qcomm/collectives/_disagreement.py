"""The messages that say which ranks disagree, and on what."""

from __future__ import annotations

from qcomm.collectives._describe import SEP


def ranks_text(ranks: list[int]) -> str:
    """``rank 2`` or ``ranks 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _shortest_differences(texts: list[str]) -> list[str]:
    # A codec's description is long; show what tells the versions apart: its
    # repr when that differs, else its identity and the parts that differ.
    split = [text.split(SEP) for text in texts]
    if len({len(parts) for parts in split}) > 1:
        return texts
    differ = [i for i in range(len(split[0])) if len({parts[i] for parts in split}) > 1]
    out = []
    for parts in split:
        if len(parts) == 1:
            out.append(parts[0])
            continue
        ident = next((p for p in parts if p.startswith("repr=")), parts[0])
        picked = [parts[i] for i in differ]
        if any(p.startswith(("repr=", "class=")) for p in picked):
            picked = [p for p in picked if p.startswith(("repr=", "class="))]
        else:
            picked = [ident, *picked]
        out.append(" ".join(picked))
    return out


def unmatched_splits(call: str, sends: list[list[int]], recvs: list[list[int]]) -> str | None:
    """What rank k sends to rank r must be what r receives from k; the pairs where not."""
    world = len(sends)
    wrong = [
        f"rank {k} sends {sends[k][r]} rows to rank {r} (its input_splits[{r}]) but rank {r} "
        f"expects {recvs[r][k]} from rank {k} (its output_splits[{k}])"
        for k in range(world)
        for r in range(world)
        if sends[k][r] != recvs[r][k]
    ]
    if not wrong:
        return None
    more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    return f"{call}: the ranks' split lists do not match: {'; '.join(wrong[:3])}{more}"


def disagreement(
    call: str, names: list[str], differ: list[int], descriptions: list[dict[str, str]]
) -> str:
    """The message for fields ``differ`` (indices into ``names``), from every rank's descriptions."""
    errors = [(r, d["error"]) for r, d in enumerate(descriptions) if "error" in d]
    if errors:
        said = "; ".join(f"rank {r}: {text}" for r, text in errors)
        return (
            f"{call}: {ranks_text([r for r, _ in errors])} rejected the arguments of this call, "
            f"so it was started on no rank ({said})"
        )
    parts = []
    for i in differ:
        name = names[i] if i < len(names) else f"field {i}"
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(descriptions):
            groups.setdefault(d.get(name, "<missing>"), []).append(r)
        # The largest group (the lowest rank among equals) is the norm; the
        # others are the ranks that differ.
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        odd = sorted(r for _, ranks in ordered[1:] for r in ranks)
        shown = _shortest_differences([text for text, _ in ordered])
        held = "; ".join(
            f"{ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} {text}"
            for text, (_, ranks) in reversed(list(zip(shown, ordered)))
        )
        parts.append(f"{ranks_text(odd)} differ{'s' if len(odd) == 1 else ''} on {name}: {held}")
    return f"{call}: the ranks disagree: " + " | ".join(parts)
