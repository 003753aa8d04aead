"""A real Mooncake Store on loopback: mooncake_master and one storage process (tests and `maru-shm bench`).

The master listens on 127.0.0.1 only (its HTTP metadata server stays off: it would bind 0.0.0.0); clients
use P2PHANDSHAKE over tcp. Objects live in the storage process, which contributes memory
(global_segment_size > 0); SGLang-side clients contribute none, so they can come and go.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

STORAGE_SEGMENT = 256 << 20  # default memory the storage process contributes

_STORAGE_MAIN = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print("setup", rc, flush=True)
while rc == 0:
    time.sleep(1)
"""


def unavailable() -> str | None:
    """Why a real Mooncake Store cannot run here, or None."""
    try:
        importlib.import_module("mooncake.store")  # loading it is the check: its native library may be missing
    except Exception as e:  # ImportError, or OSError when libibverbs.so.1 is missing
        return (f"mooncake cannot be imported ({type(e).__name__}: {e}); install it with "
                f"`pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1` and Debian's libibverbs1 "
                f"(scripts/test.sh does both)")
    if master_binary() is None:
        return "mooncake_master is not installed beside the mooncake package"
    return None


def master_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class MooncakeCluster:
    """One master and one storage process on loopback; `settings` is the maru_tier2 value for clients."""

    def __init__(self, log_dir: str, port: int | None = None, segment: int = STORAGE_SEGMENT):
        self.log_dir = log_dir
        self.segment = segment
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.master: subprocess.Popen | None = None
        self.storage: subprocess.Popen | None = None

    @property
    def settings(self) -> dict:
        return {"master_server_address": f"127.0.0.1:{self.port}", "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE", "global_segment_size": 0, "local_hostname": "127.0.0.1"}

    def _log(self, name: str):
        return open(os.path.join(self.log_dir, f"{name}-{self.port}.log"), "ab")

    def start_master(self, timeout: float = 30.0) -> None:
        cmd = [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
               f"--metrics_port={self.metrics_port}"]
        self.master = subprocess.Popen(cmd, stdout=self._log("master"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not answers(self.port):
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not start on port {self.port} (log in {self.log_dir})")
            time.sleep(0.05)

    def start_storage(self, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-c", _STORAGE_MAIN, f"127.0.0.1:{self.port}", str(self.segment)]
        self.storage = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log("storage"), text=True)
        line = _read_line(self.storage, timeout)
        if line.strip() != "setup 0":
            self.stop()
            raise RuntimeError(f"the mooncake storage process did not mount its segment: {line!r}")

    def start(self) -> "MooncakeCluster":
        self.start_master()
        self.start_storage()
        return self

    def kill_master(self) -> None:
        _kill(self.master)
        self.master = None

    def stop(self) -> None:
        _kill(self.storage)
        self.storage = None
        self.kill_master()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        return f"<nothing in {timeout} s>"
    return proc.stdout.readline()


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
