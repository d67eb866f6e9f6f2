"""What a compiled program's optimized HLO text says, read without running it: collective
bytes per device by kind and by link (within a slice, across slices), a model of HBM traffic,
the arrays it materialises (score matrices among them) and the attention kernels it calls."""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_CALLS = re.compile(r"\b(body|condition|to_apply|calls|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CHANNEL = re.compile(r"channel_id=(\d+)")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_ORIGIN = re.compile(r'op_name="([^"]*)"(?:\s*stack_frame_id=(\d+))?')
_CONSTANT = re.compile(r"[su]32\[\]\S* constant\((\d+)\)")
# A multi-slice program is one slice's: its collectives' replica groups stay within the slice,
# and what crosses slices (DCN) is a host-transfer send to libtpu's megascale runtime, tagged
# with the cross-slice collective it is part of.
_MEGASCALE = re.compile(r'\ssend\(.*_xla_megascale_transfer_type="(\w+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')


def _shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(int(n * _DTYPE_BYTES[dtype]))
    return out


def _group_size(line: str, n_devices: int) -> int:
    m = _MESH_GROUPS.search(line)  # mesh['axis_0'=1,'axis_1'=16] {'axis_1'}: the named axes' product
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (a.split("=") for a in m.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
    m = _IOTA_GROUPS.search(line)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS.search(line)
    if m and m.group(1):
        return len(m.group(1).split(","))
    return n_devices


def _trip_count(while_line: str, condition: list[str]) -> int:
    """XLA's `known_trip_count`, else the bound the condition compares the counter with
    (XLA:TPU writes no trip count; jax's scans count from 0 while i < n)."""
    m = _TRIP.search(while_line)
    if m:
        return int(m.group(1))
    bounds = [int(c) for line in condition for c in _CONSTANT.findall(line)]
    if len(bounds) == 1:
        le = any("direction=LE" in line for line in condition)
        return bounds[0] + (1 if le else 0)
    return 1


def _executions(hlo: str):
    """(bodies, times, order): each computation's lines, how many times it runs per execution
    of ENTRY (the trip counts of the while loops around it multiplied in), and the order they
    were reached from ENTRY."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line.strip()) if line and not line.startswith(" ") else None
        if m:
            current = m.group(1)
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            bodies[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    times: dict[str, int] = {entry: 1}  # executions of each computation per step
    order = [entry]
    for name in order:
        for line in bodies.get(name, ()):
            calls = dict((k, v) for k, v in _CALLS.findall(line))
            trip = 1
            if "body" in calls:
                cond = calls.get("condition", "").strip(" {}%")
                trip = _trip_count(line, bodies.get(cond, []))
            for kind, callees in _CALLS.findall(line):
                for callee in (c.strip(" {}%") for c in callees.split(",")):
                    if callee not in bodies:
                        continue
                    n = times[name] * (trip if kind == "body" else 1)
                    if n > times.get(callee, 0):
                        if callee not in times:
                            order.append(callee)
                        times[callee] = n
    return bodies, times, order


def collective_bytes(hlo: str, n_devices: int = 1, details: list | None = None,
                     by_link: dict | None = None, slices: int = 1) -> dict[str, int]:
    """Bytes per device per execution of the ENTRY computation, by collective kind, from
    optimized HLO text (within and across slices together).

    An all-gather counts its gathered result, a reduce-scatter its full input (result × group
    size), an all-reduce, all-to-all or collective-permute its buffer; each is multiplied by
    the trip counts of the while loops around it (the layer scan, the micro-batch scan, the
    fused loss's vocabulary chunks). XLA:TPU wraps asynchronous collectives in fusions that
    repeat the op (start, continuations, done) and may carry one through a later loop (the
    layer scan) to overlap it with compute: one channel id counts once, as often as the
    least-repeated of its copies runs (where it is issued).

    A multi-slice program (`slices` > 1) is one slice's: its collectives stay within the slice
    (ICI), and each cross-slice (DCN) collective is a send to the megascale runtime whose
    buffer is this device's part (a hierarchical all-reduce sends the shard left by a
    reduce-scatter within the slice); it counts by the same rules (an all-gather's result is
    the sent part × slices). `by_link`, when given, receives {"within_slice": {kind: bytes},
    "cross_slice": {kind: bytes}}."""
    bodies, times, order = _executions(hlo)
    counted: dict[tuple, tuple[str, int, int]] = {}
    for name in order:
        for i, line in enumerate(bodies[name]):
            cross = _MEGASCALE.search(line)
            if cross:
                kind = cross.group(1).lower().replace("_", "-")
                kind = {"one-to-one": "collective-permute"}.get(kind, kind)
                nbytes = _shape_bytes(line[:line.index(" send(")])[0]
                if kind == "all-gather":
                    nbytes *= slices
                rendezvous = _RENDEZVOUS.search(line)
                key = ("dcn", rendezvous.group(1) if rendezvous else f"{name}:{i}")
                if key not in counted or times[name] < counted[key][1]:
                    counted[key] = (kind, times[name], nbytes)
                continue
            m = _OP.search(line)
            if not m:
                continue
            result, kind, start = m.groups()
            sizes = _shape_bytes(result)
            if not sizes:
                continue
            if start and kind == "collective-permute":  # (input, output, contexts)
                nbytes = max(sizes)
            elif start and kind == "all-gather":  # (inputs..., outputs...)
                nbytes = sum(sizes[len(sizes) // 2:])
            else:  # one array, or a combined collective's tuple of outputs
                nbytes = sum(sizes)
            if kind == "reduce-scatter":
                nbytes *= _group_size(line, n_devices)
            channel = _CHANNEL.search(line)
            # shard_map's collectives may all carry channel_id=1 on XLA:TPU: the op's source
            # (op_name, stack frame) and size tell distinct ops apart; an async op's copies share them.
            origin = _ORIGIN.search(line)
            key = (("channel", channel.group(1), kind, nbytes, origin.groups() if origin else None)
                   if channel else (name, i))
            old = counted.get(key)
            if old is None or times[name] < old[1]:
                counted[key] = (kind, times[name], nbytes)
    out = dict.fromkeys(COLLECTIVES, 0)
    links = {"within_slice": dict.fromkeys(COLLECTIVES, 0), "cross_slice": dict.fromkeys(COLLECTIVES, 0)}
    for key, (kind, n, nbytes) in counted.items():
        out[kind] = out.get(kind, 0) + n * nbytes
        link = links["cross_slice" if key[0] == "dcn" else "within_slice"]
        link[kind] = link.get(kind, 0) + n * nbytes
    if by_link is not None:
        by_link.update(links)
    if details is not None:  # the biggest contributors, for reading where traffic comes from
        for key, (kind, n, nbytes) in sorted(counted.items(), key=lambda kv: -kv[1][1] * kv[1][2]):
            details.append({"kind": kind, "id": key[1], "executions": n, "bytes": nbytes,
                            "link": "cross_slice" if key[0] == "dcn" else "within_slice",
                            **({"origin": key[4][0][-120:]} if key[0] == "channel" and key[4] else {})})
    return out


# ----------------------------------------------------------------------------- arrays and kernels

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([\w\-]+)\(")
_FUSION_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_INSTRUCTION_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
# Results that are not a new buffer: aliases, and control flow whose bodies are counted.
_NO_BUFFER = {"bitcast", "get-tuple-element", "parameter", "tuple", "constant", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier"}


def materialised_arrays(hlo: str) -> list[tuple[str, int]]:
    """(shape, bytes) of every instruction result that is a buffer of its own in optimized HLO:
    the instructions of the entry, loop bodies and branches, not those inside a fusion (which
    live in registers or on-chip memory). Tuples count each element; bitcasts and
    get-tuple-elements alias another buffer and are left out."""
    bodies = _executions(hlo)[0]
    fused = set()
    for lines in bodies.values():
        for line in lines:
            if " fusion(" in line or "custom-call(" in line:
                fused.update(_FUSION_CALLS.findall(line))
    out = []
    for name, lines in bodies.items():
        if name in fused:
            continue
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2) in _NO_BUFFER:
                continue
            for dtype, dims in _SHAPE.findall(m.group(1)):
                shape = f"{dtype}[{dims}]"
                out.append((shape, _shape_bytes(shape)[0]))
    return out


def largest_arrays(hlo: str, n: int = 6) -> list[dict]:
    """The `n` largest array shapes materialised in the program, with how many instructions
    produce one (`materialised_arrays`): where the HBM goes, by shape."""
    counts: dict[str, list[int]] = {}
    for shape, nbytes in materialised_arrays(hlo):
        counts.setdefault(shape, [nbytes, 0])[1] += 1
    top = sorted(counts.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"shape": shape, "bytes": nbytes, "count": count} for shape, (nbytes, count) in top]


def score_matrix_arrays(hlo: str, seq_len: int, widths: tuple[int, ...] = ()) -> list[str] | None:
    """Shapes of materialised arrays whose last two dimensions are both the sequence length
    (padded or not): attention score or probability matrices [..., T, T], and XLA's causal
    mask (pred). None (undecidable by shape) when one of the model's `widths` (d_model, d_ff)
    is T too: a [..., T, d] activation would look the same."""
    lo, hi = seq_len, -(-seq_len // 128) * 128
    if any(lo <= w <= hi for w in widths):
        return None
    found = set()
    for shape, _ in materialised_arrays(hlo):
        dims = [int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d]
        if len(dims) >= 2 and lo <= dims[-1] <= hi and lo <= dims[-2] <= hi:
            found.add(shape)
    return sorted(found)


_OPERANDS = re.compile(r"\(([^)]*)\)")


def _update_bytes(line: str, shapes: dict[str, str]) -> int:
    """Bytes a dynamic-update-slice writes: its update operand (the second), not the buffer."""
    m = _OPERANDS.search(line[line.index("dynamic-update-slice("):])
    ops = [o.strip().split()[-1].lstrip("%") for o in m.group(1).split(",")] if m else []
    return sum(_shape_bytes(shapes.get(ops[1], ""))) if len(ops) > 1 else 0


def hbm_bytes(hlo: str) -> float:
    """A MODEL of one step's HBM traffic per device from optimized HLO: every buffer the program
    materialises (an instruction result outside fusions: fusion outputs, kernel outputs, copies)
    is written once and read once, as often as its computation runs (the loops' trip counts). A
    dynamic-update-slice, alone or at the heart of a fusion, writes only its update (a scan
    stacking one layer's residual into the [layers, ...] buffer). Collectives are left to
    `collective_bytes`. It leaves out re-reads (a weight read by several fusions counts once per
    producer) and on-chip reuse."""
    bodies, times, order = _executions(hlo)
    shapes = {}
    for lines in bodies.values():
        for line in lines:
            m, name = _INSTRUCTION.match(line), _INSTRUCTION_NAME.match(line)
            if m and name:
                shapes[name.group(1)] = m.group(1)
    inner, collective, updates = set(), set(), {}
    for name, lines in bodies.items():
        for line in lines:
            if " fusion(" in line or "custom-call(" in line:
                inner.update(_FUSION_CALLS.findall(line))
            if _OP.search(line):
                collective.add(name)
            if "dynamic-update-slice(" in line:
                updates[name] = updates.get(name, 0) + _update_bytes(line, shapes)
    total = 0
    for name in order:
        if name in inner:
            continue
        for line in bodies[name]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2) in _NO_BUFFER or _OP.search(line) or m.group(2).endswith(("-start", "-done")):
                continue
            callee = _FUSION_CALLS.search(line) if m.group(2) == "fusion" else None
            if callee and callee.group(1) in collective:
                continue
            if m.group(2) == "dynamic-update-slice":
                nbytes = _update_bytes(line, shapes)
            elif callee and callee.group(1) in updates:
                nbytes = updates[callee.group(1)]
            else:
                nbytes = sum(_shape_bytes(m.group(1)))
            total += 2 * times[name] * nbytes
    return float(total)


def attention_kernels(hlo: str) -> list[str]:
    """The fused attention kernels in optimized HLO: Mosaic (Pallas TPU) custom calls by kernel
    name (splash's forward and backward), cuDNN's fused attention calls by target. Empty when
    attention is plain XLA."""
    found = set()
    for line in hlo.splitlines():
        target = _CUSTOM_TARGET.search(line)
        if target and target.group(1) == "tpu_custom_call":  # named after the Pallas kernel
            name = _INSTRUCTION_NAME.match(line)
            found.add("mosaic:" + (re.sub(r"[.]\d+$", "", name.group(1)) if name else "unnamed"))
        elif target and "fmha" in target.group(1).lower():
            found.add(f"cudnn:{target.group(1)}")
        elif "__cudnn$fmha" in line or ("kind=kCustom" in line and "cudnn" in line and "fmha" in line.lower()):
            found.add("cudnn:fmha")
    return sorted(found)


def describe_collective(d: dict, hlo: str) -> dict:
    """A collective's result shape and the jax op it came from (its metadata op_name)."""
    if d.get("link") == "cross_slice":  # a megascale send: its result's first array is the buffer
        line = next((l for l in hlo.splitlines() if f'_rendezvous="{d["id"]}"' in l and " send(" in l), "")
        m = re.match(r"\s*%?[\w.\-]+\s*=\s*\(([^)]*)\)", line)
        shapes = ["%s[%s]" % x for x in _SHAPE.findall(m.group(1))][:1] if m else []
    else:
        origin = d.get("origin", "")
        line = next((l for l in hlo.splitlines()
                     if f"channel_id={d['id']}," in l and d["kind"] in l and origin in l), "")
        m = _OP.search(line)
        shapes = ["%s[%s]" % x for x in _SHAPE.findall(m.group(1))] if m else []
    op = re.search(r'op_name="([^"]*)"', line)
    largest = max(shapes, key=lambda x: _shape_bytes(x)[0]) if shapes else ""
    shape = shapes[0] if len(shapes) == 1 else f"{len(shapes)} arrays, largest {largest}" if shapes else ""
    return {**d, "shape": shape, "op": op.group(1)[-120:] if op else ""}
