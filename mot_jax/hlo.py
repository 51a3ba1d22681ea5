"""Reading a compiled program's HLO text: its computations, how often each runs (loop bodies times their trip
counts), the bytes of its shapes and collectives, its biggest buffers (what `mot_jax.aot` reports)."""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_ASSIGNMENT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # a computation's first line (at column 0)
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|called_computations)=(\{[^}]*\}|%[\w.\-]+)")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in an HLO result type (`bf16[8,128]{1,0}` or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
    return total


def instructions(hlo: str):
    """(name, result type, opcode) of each instruction of an HLO module's text."""
    return [found for line in hlo.splitlines() if (found := _instruction(line))]


def _instruction(line: str):
    """(name, result type, opcode) of an HLO text line that is an instruction, else None."""
    match = _ASSIGNMENT.match(line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith("("):  # a tuple type: up to its closing parenthesis
        end = _closing(rest)
        result, rest = rest[: end + 1], rest[end + 1 :]
    else:
        result, _, rest = rest.partition(" ")
    opcode = rest.strip().split("(", 1)[0]
    return (name, result, opcode) if opcode else None


def computations(hlo: str) -> tuple[dict, str | None]:
    """({name: its lines}, the entry's name) of an HLO module's text."""
    found, entry, current = {}, None, None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            found[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            found[current].append(line)
    return found, entry


def executions(hlo: str) -> dict:
    """{computation: times it runs in one execution of the program}: the entry once; a while loop's body and
    condition its trip count (the constant its condition compares the counter with; once where there is none)
    times its caller's; any other called computation (fusions, calls, a conditional's every branch) its
    caller's. Computations are printed callees first, so callers are walked from the entry down."""
    bodies, entry = computations(hlo)
    times = dict.fromkeys(bodies, 0)
    if entry is None:
        return times
    times[entry] = 1
    for caller in reversed(list(bodies)):
        for line in bodies[caller]:
            called = dict(_CALLED.findall(line))
            trips = _trip_count(bodies.get(called.get("condition", "").lstrip("%"), [])) if "body" in called else 1
            for key, names in called.items():
                for name in re.findall(r"[\w.\-]+", names):
                    if name in times:
                        times[name] += times[caller] * (trips if key in ("body", "condition") else 1)
    return times


def _trip_count(condition: list[str]) -> int:
    """The trip count of a while loop of a counter from 0 by 1 whose condition is `counter < constant`; 1 if not so."""
    constants = dict(re.findall(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", "\n".join(condition)))
    for line in condition:
        if "ROOT" in line and "compare(" in line and "direction=LT" in line:
            operands = re.findall(r"%([\w.\-]+)", line.split("compare(", 1)[1])
            bound = [int(constants[o]) for o in operands if o in constants]
            return bound[-1] if bound else 1
    return 1


def _closing(text: str) -> int:
    """The index of the parenthesis that closes the one `text` starts with."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(text) - 1


def collectives(hlo: str, per_step: bool = False) -> dict:
    """{kind: (count, bytes)} of the collectives in a compiled (per-chip) HLO text, by their results' bytes; an
    async pair (`-start` / `-done`) counts once. As the text has them (a loop body once), or `per_step`: each as
    often as it runs (`executions`: a loop body times its trip count)."""
    found = {}
    times = executions(hlo) if per_step else {}
    for computation, lines in computations(hlo)[0].items():
        for line in lines:
            name_result_opcode = _instruction(line)
            if name_result_opcode is None:
                continue
            _, result, opcode = name_result_opcode
            kind = opcode.removesuffix("-start")
            if kind not in COLLECTIVES or opcode.endswith("-done"):
                continue
            if opcode.endswith("-start"):  # its result is (operands, outputs[, context]): the outputs
                result = _tuple_items(result)[1] if len(_tuple_items(result)) > 1 else result
            runs = times.get(computation, 0) if per_step else 1
            count, size = found.get(kind, (0, 0))
            found[kind] = (count + runs, size + runs * shape_bytes(result))
    return found


def ici_traffic(hlo: str) -> int:
    """Bytes a chip moves over ICI in one step, roughly: its collectives' result bytes as often as they run, an
    all-reduce twice (a ring reduces and then gathers)."""
    return sum(size * (2 if op == "all-reduce" else 1) for op, (_, size) in collectives(hlo, True).items())


def _tuple_items(result: str) -> list[str]:
    """The top-level items of a tuple type `(a, (b, c), d)`; a non-tuple as one item."""
    result = result.strip()
    if not result.startswith("("):
        return [result]
    items, depth, start = [], 0, 1
    for i, ch in enumerate(result):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            items.append(result[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return items


def biggest_buffers(hlo: str, count: int = 3) -> list[tuple[str, str, int]]:
    """The `count` largest instruction results (name, type, bytes) of a compiled (per-chip) HLO text."""
    sized = [
        (name, result.split("{")[0], shape_bytes(result))
        for name, result, _ in instructions(hlo)
        if not result.startswith("(")  # a tuple holds other instructions' buffers
    ]
    return sorted(sized, key=lambda s: -s[2])[:count]
