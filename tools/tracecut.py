"""A shorter Mooncake trace for a CPU run: whole sessions of the FAST'25 synthetic trace, re-timed.

SGLang's `mooncake` dataset builds about 129 tokens per hash id and replays records at their timestamps;
the full synthetic trace (3,993 records, a median of 23 hash ids, 17 minutes) takes hours of CPU prefill.
A cut keeps the trace's own reuse structure and only shrinks it:
- a session is the records that share a first hash id (in this trace: a shared prefix of blocks and a
  distinct last block, a multi-turn conversation's reuse as the release keeps it);
- the first `sessions` sessions in arrival order whose records all have at most `max_blocks` hash ids
  and that have at least two records are kept, with their first `per_session` records, hash ids untouched;
- records keep their order and are re-timed `1 / rate` seconds apart;
- output lengths are capped at `output_len` (decode runs at a few tokens a second on a CPU); the client's
  --extra-request-body caps them too, and the cap here keeps the multi-round placeholder answers short.
"""

from __future__ import annotations

import json
from collections import OrderedDict


def cut(records: list[dict], *, sessions: int, per_session: int, max_blocks: int, rate: float,
        output_len: int) -> list[dict]:
    """The kept records, re-timed, in trace order."""
    by_session: OrderedDict[int, list[int]] = OrderedDict()
    for i in sorted(range(len(records)), key=lambda i: records[i]["timestamp"]):
        if records[i]["hash_ids"]:
            by_session.setdefault(records[i]["hash_ids"][0], []).append(i)
    kept: list[int] = []
    taken = 0
    for members in by_session.values():
        if taken == sessions:
            break
        if len(members) < 2 or max(len(records[i]["hash_ids"]) for i in members) > max_blocks:
            continue
        kept += members[:per_session]
        taken += 1
    kept.sort(key=lambda i: (records[i]["timestamp"], i))
    out = []
    for n, i in enumerate(kept):
        r = records[i]
        out.append({"timestamp": round(n * 1000 / rate), "input_length": r["input_length"],
                    "output_length": min(r["output_length"], output_len), "hash_ids": list(r["hash_ids"])})
    return out


def write_cut(src: str, dst: str, **kw) -> dict:
    """Cut the trace at `src` into `dst`; returns what was kept (records, sessions, unique blocks)."""
    with open(src) as f:
        records = [json.loads(line) for line in f if line.strip()]
    out = cut(records, **kw)
    with open(dst, "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    blocks = [h for r in out for h in r["hash_ids"]]
    return {"records": len(out), "sessions": len({r["hash_ids"][0] for r in out}), "blocks": len(blocks),
            "unique_blocks": len(set(blocks)), "source_records": len(records)}
