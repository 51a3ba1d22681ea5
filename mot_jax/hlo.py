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
        elif line.rstrip() == "}":  # not `}}, metadata=...`: a Pallas kernel's config continues over lines
            current = None
        elif current is not None:
            found[current].append(line)
    return found, entry


def executions(hlo: str) -> dict:
    """{computation: times it runs in one execution of the program}: the entry once; a while loop's body and
    condition its trip count (`_trip_count`; once where it cannot be read) times its caller's; any other called
    computation (fusions, calls, a conditional's every branch) its caller's. Computations are printed callees
    first, so callers are walked from the entry down."""
    bodies, entry = computations(hlo)
    times = dict.fromkeys(bodies, 0)
    if entry is None:
        return times
    times[entry] = 1
    for caller in reversed(list(bodies)):
        for line in bodies[caller]:
            called = dict(_CALLED.findall(line))
            if "body" in called:
                loop = (bodies.get(called[key].lstrip("%"), []) for key in ("condition", "body"))
                trips = _trip_count(*loop)
            else:
                trips = 1
            for key, names in called.items():
                for name in re.findall(r"[\w.\-]+", names):
                    if name in times:
                        times[name] += times[caller] * (trips if key in ("body", "condition") else 1)
    return times


_INTEGER = r"[su](?:8|16|32|64)\[\]"  # XLA's own loops (the windowed einsum's) count in u32


def _integer_constants(text: str) -> dict:
    """{name: value} of the scalar integer constants defined in `text`."""
    return dict(re.findall(rf"%([\w.\-]+) = {_INTEGER}\S* constant\((\d+)\)", text))


def _trip_count(condition: list[str], body: list[str] = ()) -> int:
    """The trip count of a while loop whose condition is `counter < constant` and whose body adds a constant step
    to the counter (1 where it adds none it can read), the counter from 0: ceil(bound / step); 1 if not so. XLA's
    windowed einsum (an all-gather turned into collective-permutes) unrolls its loop by two: a step of 2."""
    constants = _integer_constants("\n".join(condition))
    tuple_index = dict(re.findall(r"%([\w.\-]+) = \S+ get-tuple-element\(.*index=(\d+)", "\n".join(condition)))
    for line in condition:
        if "ROOT" in line and "compare(" in line and "direction=LT" in line:
            operands = re.findall(r"%([\w.\-]+)", line.split("compare(", 1)[1].split(")", 1)[0])
            bound = [int(constants[o]) for o in operands if o in constants]
            if not bound:
                return 1
            counter = next((int(tuple_index[o]) for o in operands if o in tuple_index), None)
            return -(-bound[-1] // _step(body, counter))
    return 1


def _step(body: list[str], counter: int | None) -> int:
    """What a loop body adds to the counter at tuple index `counter`: the constant of the `add` its root tuple
    holds there; 1 where that is not what the body does."""
    text = "\n".join(body)
    root = next((line for line in body if "ROOT" in line and " tuple(" in line), None)
    if counter is None or root is None:
        return 1
    items = re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1])
    if counter >= len(items):
        return 1
    add = re.search(rf"%{re.escape(items[counter])} = {_INTEGER}\S* add\(%([\w.\-]+), %([\w.\-]+)\)", text)
    if add is None:
        return 1
    constants = _integer_constants(text)
    steps = [int(constants[o]) for o in add.groups() if o in constants]
    return steps[0] if len(steps) == 1 and steps[0] > 0 else 1


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
