"""What a sharded call sends: the collectives of a compiled program, read from its HLO."""

import re

_COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce",
                "reduce-scatter")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")


def collective_bytes(hlo_text: str) -> dict[str, list[int]]:
    """``{op: [bytes of each instruction's result, ...]}`` for every collective in the text
    of a compiled program (`jax.jit(f).lower(...).compile().as_text()`), one device's view.

    Each instruction counts once, in program order, whatever loop holds it (a ring's
    ``collective-permute`` in its loop body is one step's transfer). An ``all-to-all``'s
    result is the device's whole shard, of which it keeps ``1 / n`` and sends the rest.

    ```python
    sent = collective_bytes(jax.jit(attn).lower(q, k, v).compile().as_text())
    sent["all-to-all"]   # e.g. [2048, 2048, 2048, 2048]: q, k, v in, the output back
    ```
    """
    found: dict[str, list[int]] = {}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        total = 0
        for dtype, dims in _SHAPE.findall(match.group(1)):
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            total += size * _BYTES[dtype]
        found.setdefault(match.group(2), []).append(total)
    return found
