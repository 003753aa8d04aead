"""ops: put/get operations per second for 4 KiB and 128 KiB values vs a plain memmove of the same bytes
into a /dev/shm mapping."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time

from maru_shm import Store, remove_pool

from .registry import figure, median_spread, pool_path, progress_of, scenario


NAME = "ops"


@scenario(NAME)
def bench_ops(args) -> dict:
    out = {"scenario": "ops", "rows": [], "figures": []}
    path = pool_path("ops")
    nkeys = 256
    try:
        with Store.open(path, size=max(args.pool_size, 256 << 20), create=True, populate=True) as s:
            for vsize in (4096, 131072):
                s.declare_size(vsize)
                vals = [os.urandom(vsize) for _ in range(8)]
                outbuf = bytearray(vsize)
                # plain copy of the same bytes into a /dev/shm mapping, same count
                fd, tmp = tempfile.mkstemp(dir="/dev/shm")
                os.ftruncate(fd, nkeys * vsize)
                mm = mmap.mmap(fd, nkeys * vsize)
                base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                src = [ctypes.c_char_p(v) for v in vals]
                dst_out = (ctypes.c_char * vsize).from_buffer(outbuf)
                put_r, get_r, cp_r = [], [], []
                for rep in range(args.repeat):
                    keys = [f"v{vsize}-{rep}-{i}" for i in range(nkeys)]
                    t = time.perf_counter()
                    for i, k in enumerate(keys):
                        s.put(k, vals[i & 7])
                    put_r.append(nkeys / (time.perf_counter() - t))
                    t = time.perf_counter()
                    for k in keys:
                        s.get_into(k, outbuf)
                    get_r.append(nkeys / (time.perf_counter() - t))
                    t = time.perf_counter()
                    for i in range(nkeys):
                        ctypes.memmove(base + i * vsize, src[i & 7], vsize)
                        ctypes.memmove(dst_out, base + i * vsize, vsize)
                    cp_r.append(nkeys / (time.perf_counter() - t))
                del dst_out, src
                mm.close()
                os.close(fd)
                os.unlink(tmp)
                p, g, c = median_spread(put_r), median_spread(get_r), median_spread(cp_r)
                out["rows"].append({"value_bytes": vsize, "put_ops": p[0], "put_spread": p[1:], "get_ops": g[0],
                                    "get_spread": g[1:], "copy_roundtrip_ops": c[0], "copy_spread": c[1:],
                                    "put_ratio": p[0] / (2 * c[0]), "get_ratio": g[0] / (2 * c[0])})
                one_way = (2 * c[0], [2 * c[1], 2 * c[2]])
                out["figures"] += [
                    figure(f"put {vsize} B, ops/s", p[0], one_way[0], "plain copy one way", unit="ops/s",
                           spread=p[1:], peer_spread=one_way[1]),
                    figure(f"get {vsize} B, ops/s", g[0], one_way[0], "plain copy one way", unit="ops/s",
                           spread=g[1:], peer_spread=one_way[1])]
                progress_of(args)(0.5 if vsize == 4096 else 1.0)
    finally:
        remove_pool(path)
    return out
