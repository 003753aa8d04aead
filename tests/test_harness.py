"""The test harness itself: what it must keep visible when a worker dies."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_segfault_after_sglang_is_imported_prints_its_traceback(tmp_path):
    """SGLang's import (libtvm_ffi) replaces faulthandler's SIGSEGV handler, and a crashed xdist worker then
    printed nothing but "Not properly terminated". The suite's setup hook puts faulthandler back before each
    test: a test that segfaults after another imported SGLang prints "Fatal Python error"."""
    (tmp_path / "test_crash.py").write_text(
        "import ctypes\n\n"
        "def test_import():\n    import sglang.srt.mem_cache.pool_host.mha  # noqa: F401\n\n"
        "def test_crash():\n    ctypes.string_at(0)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:randomly", "-p", "no:cacheprovider",
                        "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_crash.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "node down" in out, out[-2000:]
    assert "Fatal Python error: Segmentation fault" in out, out[-2000:]
