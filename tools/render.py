"""Turning an inspect report (maru_shm.checks.figures.report) into tables.

One model, two outputs: `sections()` lays the report out as a list of
`Section`s (title, header, rows, alignment); `to_rich()` draws them with rich
for a terminal, `to_plain()` as plain aligned text for a pipe or a file (no
colour, no box drawing, no width limit).
"""

from __future__ import annotations

import dataclasses
import datetime

from maru_shm import format_size


# --------------------------------------------------------------------------- human units
def size(n) -> str:
    """Bytes in binary units with three significant digits: 4480 -> '4.38 KiB'."""
    return format_size(n, style="short")


def block(n) -> str:
    """A block size: in a binary unit when it is a whole number of one ('16 KiB'), else in bytes ('4,480 B')."""
    return format_size(n, style="exact")


def count(n) -> str:
    return f"{int(n):,}"


def pct(x) -> str:
    return f"{100 * x:.1f}%"


def when(ns) -> str:
    if not ns:
        return "-"
    return datetime.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def ago(ns, now_ns) -> str:
    if not ns:
        return "-"
    s = max(0, (now_ns - ns) // 10**9)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def rate(x) -> str:
    if x >= 100:
        return f"{x:,.0f}/s"
    return f"{x:.1f}/s"


# --------------------------------------------------------------------------- layout
@dataclasses.dataclass
class Section:
    """A titled table (`header` + `rows`), or a key/value grid (`pairs`, `per_row` pairs to a line)."""

    title: str
    header: list[str] | None = None
    rows: list[list[str]] = dataclasses.field(default_factory=list)
    align: str = ""  # one 'l' or 'r' per column; default: first left, rest right
    empty: str = "none"  # shown instead of a table without rows
    row_styles: list[str | None] = dataclasses.field(default_factory=list)
    pairs: list[tuple[str, str]] | None = None
    per_row: int = 3

    def justify(self, i: int) -> str:
        if self.pairs is not None:
            return "left"
        if i < len(self.align):
            return "left" if self.align[i] == "l" else "right"
        return "left" if i == 0 else "right"

    def grid(self, width: int | None = None) -> list[list[str]]:
        """The pairs laid out as many to a line as fit in `width` (at most `per_row`)."""
        n = self.per_row
        if width is not None:
            while n > 1 and _grid_width(self.pairs, n) > width:
                n -= 1
        return _grid(self.pairs, n)


_GAP = 2


def _grid_width(pairs, n: int) -> int:
    cols = [0] * (2 * n)
    for i, (k, v) in enumerate(pairs):
        j = 2 * (i % n)
        cols[j] = max(cols[j], len(k))
        cols[j + 1] = max(cols[j + 1], len(v))
    return sum(cols) + _GAP * (2 * n - 1)


def _grid(pairs: list[tuple[str, str]], per_row: int) -> list[list[str]]:
    """Key/value pairs laid out `per_row` pairs to a row."""
    rows = []
    for i in range(0, len(pairs), per_row):
        row: list[str] = []
        for k, v in pairs[i:i + per_row]:
            row += [k, v]
        row += [""] * (2 * per_row - len(row))
        rows.append(row)
    return rows


def _dead(dead: list, repair: dict) -> str:
    """The dead processes not yet reaped, or why nobody's liveness is known."""
    if not repair.get("locks_seen", True):
        return "unknown: only the pool's writers may open its lock file"
    return ", ".join(f"slot {p['slot']} (pid {p['pid']})" for p in dead) or "none"


def sections(rep: dict, prev: dict | None = None) -> list[Section]:
    """The report as titled tables; with `prev` (an earlier report) counters also show rates."""
    g, f, sp, ix = rep["geometry"], rep["format"], rep["space"], rep["index"]
    now = rep["taken_ns"]
    out: list[Section] = []

    kind = "DAX device" if f["device"] else "regular file"
    out.append(Section("Pool", pairs=[
        ("path", rep["path"]), ("format", f"version {f['version']}, {kind}, {f.get('eviction', 'count')} eviction"),
        ("uuid", f["pool_uuid"]), ("created", when(f["created_ns"])),
        ("file size", size(g["file_bytes"])), ("header", size(g["header_bytes"])),
        ("data area", size(g["data_bytes"])), ("units", f"{count(g['units'])} x {size(g['unit_size'])}"),
        ("granule", size(g["granule"])), ("max value", size(g["max_value"])),
        ("process slots", count(g["proc_slots"])), ("index", f"{g['index_shards']} shards x {g['shard_slots']} slots"),
    ], per_row=3))

    out.append(Section("Space", pairs=[
        ("live payload", f"{size(sp['live_bytes'])} in {count(sp['live_blocks'])} blocks"),
        ("utilization", f"{pct(sp['utilization'])} of file, {pct(sp['data_utilization'])} of data"),
        ("allocated", f"{size(sp['allocated_bytes'])} ({count(sp['reserved_blocks'])} reserved blocks)"),
        ("fragmentation", pct(sp["fragmentation"])),
        ("slabs", f"{count(sp['slabs'])} over {count(sp['slab_units'])} units"),
        ("free units", f"{count(sp['free_units'])} of {count(sp['units'])}"),
    ], per_row=3))

    rows = [[str(r["class"]), "exact" if r["kind"] == "exact" else "geo", block(r["block_size"]),
             str(r["slab_units"]), count(r["slabs"]), count(r["blocks"]), count(r["used"]), count(r["free"]),
             size(r["live_bytes"]), pct(r["fragmentation"])]
            for r in rep["classes"]]
    out.append(Section("Size classes", ["class", "kind", "block", "units", "slabs", "blocks", "used", "free",
                                        "live payload", "frag"], rows, align="rlrrrrrrrr",
                       empty="no slabs yet"))

    out.append(Section("Index", pairs=[
        ("entries", f"{count(ix['entries'])} of {count(ix['index_slots'])} slots"),
        ("load factor", f"{pct(ix['load_factor'])} (max shard {pct(ix['max_shard_load'])}, limit 87.5%)"),
        ("probe length", f"mean {ix['probe_mean']:.2f}, max {ix['probe_max']}"),
    ], per_row=3))

    rows, styles = [], []
    for p in rep["processes"]:
        status = "this process" if p.get("self") else {True: "alive", False: "dead", None: "unknown"}[p["alive"]]
        c = p["counters"]
        rows.append([str(p["slot"]), str(p["pid"]), str(p["uid"]), status, when(p["started_ns"]),
                     ago(p["attach_ns"], now), count(c["puts"]), count(c["hits"]), count(c["misses"]),
                     count(c["evictions"])])
        styles.append("red" if p["alive"] is False else None)
    out.append(Section("Processes", ["slot", "pid", "uid", "status", "started", "attached for", "puts", "hits",
                                     "misses", "evictions"], rows, align="rrrllrrrrr", empty="none attached",
                       row_styles=styles))

    tiers = rep.get("tier2") or []
    if tiers:
        rows = [[str(t.get("slot")), str(t.get("pid")), str(t.get("state")), str(t.get("master")),
                 count(t.get("hits", 0)), count(t.get("misses", 0)), count(t.get("promoted", 0)),
                 count(t.get("written", 0)), count(t.get("write_failed", 0)), count(t.get("offline_writes", 0)),
                 count(t.get("detaches", 0))] for t in tiers]
        out.append(Section("Second tier (Mooncake Store)", ["slot", "pid", "state", "master", "hits", "misses",
                                                            "promoted", "written", "write failed", "offline writes",
                                                            "detaches"], rows, align="rrlll"))

    rp = rep["repair"]
    pairs = [("shards needing repair", ", ".join(map(str, rp["shards"])) or "none"),
             ("classes needing repair", ", ".join(map(str, rp["classes"])) or "none"),
             ("pool table", "needs repair" if rp["pool"] else "ok")]
    others = [d["lock"] for d in rp["dirty_locks"] if d["domain"] not in ("shard", "class", "pool")]
    if others:
        pairs.append(("other dirty locks", ", ".join(others)))
    dead = [p for p in rep["processes"] if p["alive"] is False]
    pairs.append(("dead, not yet reaped", _dead(dead, rp)))
    out.append(Section("Repair", pairs=pairs, per_row=3))

    c = rep["counters"]
    dt = (now - prev["taken_ns"]) / 1e9 if prev else 0.0
    pairs = []
    order = ["hits", "misses", "puts", "evictions", "evicted_bytes", "put_failures", "bytes_written",
             "bytes_read", "slab_moves", "lock_timeouts", "repairs", "orphans_freed"]
    order += [n for n in c if n not in order and n != "hit_ratio"]
    for name in (n for n in order if n in c):
        v = size(c[name]) if name.endswith("bytes") or name.startswith("bytes") else count(c[name])
        if prev and dt > 0:
            # a process detaching moves its counters to the retired totals: a torn read can dip, never < 0
            r = max(0.0, (c[name] - prev["counters"].get(name, 0)) / dt)
            v += f" ({size(r)}/s)" if name.endswith("bytes") or name.startswith("bytes") else f" ({rate(r)})"
        pairs.append((name.replace("_", " "), v))
    pairs.insert(2, ("hit ratio", pct(c["hit_ratio"])))
    out.append(Section("Counters", pairs=pairs, per_row=4))
    return out


# --------------------------------------------------------------------------- output
def to_plain(secs: list[Section]) -> str:
    """Plain aligned text: a title line, then the table indented by two spaces."""
    lines: list[str] = []
    for s in secs:
        lines.append(s.title)
        rows = s.grid() if s.pairs is not None else s.rows
        if not rows:
            lines.append(f"  {s.empty}")
            lines.append("")
            continue
        table = ([s.header] if s.header else []) + rows
        ncol = max(len(r) for r in table)
        widths = [max(len(r[i]) if i < len(r) else 0 for r in table) for i in range(ncol)]
        for r in table:
            cells = []
            for i in range(ncol):
                cell = r[i] if i < len(r) else ""
                cells.append(cell.ljust(widths[i]) if s.justify(i) == "left" else cell.rjust(widths[i]))
            lines.append(("  " + (" " * _GAP).join(cells)).rstrip())
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def to_rich(secs: list[Section], caption: str | None = None, width: int | None = None):
    """A rich renderable: one table per section; key/value grids fitted to `width` columns."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    if caption:
        parts.append(Text(caption, style="bold"))
        parts.append(Text(""))
    for s in secs:
        rows = s.grid(width) if s.pairs is not None else s.rows
        if not rows:
            parts.append(Text(s.title, style="bold cyan"))
            parts.append(Text(f"  {s.empty}", style="dim"))
            parts.append(Text(""))
            continue
        if s.header is None:
            t = Table(title=s.title, title_justify="left", title_style="bold cyan", show_header=False,
                      box=None, padding=(0, _GAP // 2), pad_edge=False)
            for i in range(max(len(r) for r in rows)):
                t.add_column(style="dim" if s.pairs is not None and i % 2 == 0 else None, justify=s.justify(i))
        else:
            t = Table(title=s.title, title_justify="left", title_style="bold cyan", box=box.SIMPLE_HEAD,
                      header_style="bold", padding=(0, _GAP - 1, 0, 0), pad_edge=False, show_edge=False)
            for i, h in enumerate(s.header):
                t.add_column(h, justify=s.justify(i), no_wrap=True)
        for i, r in enumerate(rows):
            t.add_row(*r, style=s.row_styles[i] if i < len(s.row_styles) else None)
        parts.append(t)
        parts.append(Text(""))
    return Group(*parts)
