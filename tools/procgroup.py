"""A server's processes, read from /proc: which belong to it, their kernel state, and the CPU seconds they
spent by process name, the counter that tells where a load run's cores went (each scheduler, SGLang's DP
controller, its tokenizer and detokenizer).

A server is one process group (tools/serving.py starts each in its own session). Names are the kernel's
`comm` (SGLang renames its processes: "sglang::schedul", "sglang::data_pa", ...); processes sharing a name
are summed, and so are their threads' voluntary context switches (how often they slept). Per-thread figures,
which single out a spinning OpenMP worker (BENCHMARKS.md, "At load"), need `top -H` or /proc/PID/task.
"""

from __future__ import annotations

import os


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the name (which may hold spaces or parentheses): [0] the state letter,
    [2] the process group, [11] and [12] user and system ticks; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def state(pid: int) -> str:
    """The kernel's state letter of `pid` ("Z": exited, not yet waited for), or "gone"."""
    fields = stat_fields(pid)
    return fields[0] if fields else "gone"


def _members(pgid: int):
    """(pid, stat fields) of each live process of process group `pgid`."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            fields = stat_fields(pid)
            if fields is not None and len(fields) >= 13 and int(fields[2]) == pgid:
                yield int(pid), fields


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    return [pid for pid, _ in _members(pgid)]


def _voluntary_switches(pid: int) -> int:
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except (OSError, ValueError):
            continue
    return total


def group_cpu(pgid: int) -> dict[str, dict]:
    """{process name: {"processes": n, "cpu_s": user + system seconds, "voluntary_switches": of all threads}}
    for the live processes of process group `pgid`."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict] = {}
    for pid, fields in _members(pgid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:  # gone meanwhile
            continue
        row = out.setdefault(name, {"processes": 0, "cpu_s": 0.0, "voluntary_switches": 0})
        row["processes"] += 1
        row["cpu_s"] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime of the whole thread group
        row["voluntary_switches"] += _voluntary_switches(pid)
    return out


def delta(after: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    """What each process name spent between two readings (a process that started meanwhile counts whole)."""
    out = {}
    for name, row in after.items():
        prev = before.get(name, {})
        out[name] = {"cpu_s": round(row["cpu_s"] - prev.get("cpu_s", 0.0), 2),
                     "voluntary_switches": row["voluntary_switches"] - prev.get("voluntary_switches", 0)}
    return out
