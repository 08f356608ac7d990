"""What a compiled program's HLO text says that memory_analysis() and cost_analysis() do not: the
collectives the SPMD partitioner inserted (kind, how many run per step, bytes each), and copies
of the KV cache or of a weight (a relayout or a resharding), which must not happen in a step.

Counts are per execution of the program: an instruction inside a while loop's body (the
decoder's scan over layers) counts once per iteration, by the loop's trip count, so a
per-layer all-reduce of an 80-layer model counts 80. An instruction inside a branch of a
conditional (the step's lax.conds: sampling filters, logprobs, prompt_logprobs, drafts) runs
only in steps that take that branch: it is counted apart (`conditional`), not as every step's.
Inside a fusion only the fused computation's root is written to memory: a copy elsewhere in
one (XLA:TPU fuses a retiling copy of a whole weight stack with the dynamic-slice of the
scanned layer that reads one layer of it) moves only what its users read, and a fusion nested
in another fusion writes nothing. Such copies are not reported; a copy that is a top-level
fusion's root (or an element of its root tuple) is.

An async copy-start whose destination has the source's layout in another memory space
(`S(1)`, a TPU's VMEM) is XLA's prefetch of an operand, not a relayout: not reported either.

Pure text parsing, no jax.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
          "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(body|calls|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?([%\w.\-, ]+)\}?")
_BRANCHES = ("branch_computations", "true_computation", "false_computation")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_INT_CONST = re.compile(r"=\s*s32\[\]\S*\s+constant\((\d+)\)")


@dataclasses.dataclass
class Collective:
    kind: str
    count: int = 0  # executions per program run, outside conditional branches
    bytes: int = 0  # result bytes summed over those executions
    conditional: int = 0  # executions inside conditional branches, if taken


@dataclasses.dataclass
class Copy:
    opcode: str
    shape: str  # e.g. bf16[2,64,16,1024]
    count: int
    conditional: bool  # inside a conditional branch: only steps that take it pay for it


def shapes_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a result type, possibly a tuple)."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            name = ("ENTRY:" if m.group(1) else "") + m.group(2)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
    return comps


def _trip_count(line: str, comps: dict[str, list[str]], key: dict[str, str]) -> int:
    """Iterations of the while loop `line`: XLA's known_trip_count where the backend keeps it
    (XLA:GPU), else the bound its condition compares the counter with (XLA:TPU's compiled HLO
    drops the annotation; jax's scans and fori_loops count from 0 by 1 to that s32 constant)."""
    known = _TRIP.search(line)
    if known:
        return int(known.group(1))
    cond = _COND.search(line)
    if cond and cond.group(1) in key:
        consts = {int(c) for ln in comps[key[cond.group(1)]] for c in _INT_CONST.findall(ln)}
        if len(consts) == 1:
            return consts.pop()
    return 1  # unknown: counted once, as cost_analysis does


_TYPED = re.compile(r"([a-z]+\d*(?:e\d+m\d+(?:fn)?)?\[[\d,]*\])(\{[^}]*\})?")
_SPACE = re.compile(r"S\(\d+\)")


def _prefetch(result: str) -> bool:
    """A copy-start's (destination, source, context) result moving an array between memory
    spaces with its layout unchanged."""
    typed = _TYPED.findall(result)
    if len(typed) < 2 or typed[0][0] != typed[1][0]:
        return False
    dst, src = (_SPACE.sub("", lay) for _, lay in typed[:2])
    return typed[0][1] != typed[1][1] and dst == src


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_FUSION_CALL = re.compile(r"\sfusion\(.*\bcalls=%?([\w.\-]+)")
_ROOT_OPERANDS = re.compile(r"^\s*ROOT\s+%?[\w.\-]+\s*=\s*.+?\s+tuple\((.*)\)")


def _unmaterialized(comps: dict[str, list[str]]) -> dict[str, set[str]]:
    """Per fused computation, the names of its instructions that are not written to memory:
    every one but the root (and its tuple's operands) in a fusion called from an unfused
    computation; every one in a fusion nested inside another fusion."""
    key = {c.removeprefix("ENTRY:"): c for c in comps}
    parent: dict[str, str] = {}
    for comp, lines in comps.items():
        for line in lines:
            m = _FUSION_CALL.search(line)
            if m and m.group(1) in key:
                parent[key[m.group(1)]] = comp
    out: dict[str, set[str]] = {}
    for fused, caller in parent.items():
        names = {m.group(1) for ln in comps[fused] if (m := _NAME.match(ln))}
        if caller not in parent:  # a top-level fusion: its root is its output buffer
            for ln in comps[fused]:
                if ln.lstrip().startswith("ROOT"):
                    names.discard(_NAME.match(ln).group(1))
                    tup = _ROOT_OPERANDS.match(ln)
                    if tup:
                        names -= {o.strip().lstrip("%") for o in tup.group(1).split(",")}
        out[fused] = names
    return out


def _multipliers(comps: dict[str, list[str]]) -> tuple[dict[str, int], dict[str, int]]:
    """Executions of each computation per run of the entry computation: (outside any
    conditional branch, inside one if every branch were taken)."""
    entry = next((c for c in comps if c.startswith("ENTRY:")), None)
    key = {c.removeprefix("ENTRY:"): c for c in comps}
    always: dict[str, int] = {}
    branch: dict[str, int] = {}

    def visit(comp: str, n: int, conditional: bool, depth: int = 0) -> None:
        if depth > 64:  # HLO has no recursion; a guard against a parse gone wrong
            return
        times = branch if conditional else always
        times[comp] = times.get(comp, 0) + n
        for line in comps[comp]:
            trip = _trip_count(line, comps, key) if " while(" in line else 1
            for attr, group in _CALLS.findall(line):
                for callee in (c.strip().lstrip("%") for c in group.split(",")):
                    if callee in key:
                        m = n * (trip if attr == "body" else 1)
                        visit(key[callee], m, conditional or attr in _BRANCHES, depth + 1)
    if entry is not None:
        visit(entry, 1, False)
    return always, branch


def scan(hlo: str, watched_shapes: set[tuple[str, tuple[int, ...]]] = frozenset()
         ) -> tuple[dict[str, Collective], list[Copy]]:
    """(collectives by kind, copies of watched shapes) in the compiled HLO text `hlo`.
    watched_shapes: (dtype, dims) of the arrays no copy may be made of (the KV cache's and the
    weights' per-device shards)."""
    comps = _computations(hlo)
    always, branch = _multipliers(comps)
    unwritten = _unmaterialized(comps)
    found = {k: Collective(k) for k in COLLECTIVES}
    copies: dict[tuple[str, str, bool], int] = {}
    for comp, lines in comps.items():
        for conditional, n in ((False, always.get(comp, 0)), (True, branch.get(comp, 0))):
            if n == 0:
                continue
            for line in lines:
                m = _INSTR.match(line)
                if not m:
                    continue
                result, opcode = m.group(2), m.group(3)
                base = opcode.removesuffix("-start")
                if base in found and not opcode.endswith("-done"):
                    if conditional:
                        found[base].conditional += n
                    else:
                        found[base].count += n
                        found[base].bytes += n * shapes_bytes(result)
                elif opcode in ("copy", "copy-start", "transpose"):
                    if _NAME.match(line).group(1) in unwritten.get(comp, ()):
                        continue  # inside a fusion, not its output: moves only what is read of it
                    if opcode == "copy-start" and _prefetch(result):
                        continue  # into another memory space, layout unchanged: a prefetch
                    for dtype, dims in _SHAPE.findall(result):
                        if (dtype, tuple(int(d) for d in dims.split(",") if d)) in watched_shapes:
                            k = (opcode, f"{dtype}[{dims}]", conditional)
                            copies[k] = copies.get(k, 0) + n
                            break  # a copy-start's (destination, source) pair is one copy
    return ({k: v for k, v in found.items() if v.count or v.conditional},
            [Copy(o, s, c, cond) for (o, s, cond), c in copies.items()])
