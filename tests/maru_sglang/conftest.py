"""Fixtures for the MaruStorage integration tests: real SGLang host pools (CPU, unpinned) and backends
created through SGLang's own StorageBackendFactory ("dynamic") followed by register_mem_pool_host.

No SGLang class is mocked. Every test module starts with
`pytest.importorskip("sglang", ...)`, so the whole directory skips with a clear
reason when SGLang is not installed (CI installs it).
"""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # hicache_helpers must import by name, here and in spawned children
    sys.path.insert(0, _HERE)

import hicache_helpers as hh  # noqa: E402
from maru_shm import remove_pool  # noqa: E402


@pytest.fixture
def pool_path():
    """A fresh pool file path under /dev/shm, removed afterwards."""
    path = hh.shm_path()
    yield path
    remove_pool(path)


@pytest.fixture
def make_instance(pool_path):
    """make_instance(**kw) -> (host, backend): one SGLang rank on the test's pool (see hicache_helpers).

    All backends made here are closed at teardown.
    """
    made = []

    def make(pool: str | None = None, **kw):
        host, backend = hh.make_instance(pool or pool_path, **kw)
        made.append(backend)
        return host, backend

    yield make
    for backend in made:
        try:
            backend.close()
        except Exception:
            pass


@pytest.fixture
def mha_llama(make_instance):
    """Llama-3.1-8B geometry, page_first_direct, page_size 1, 16 pages of random bytes."""
    host, backend = make_instance(kind="mha", layout="page_first_direct", page_size=1, pages=16)
    hh.fill_random(host, seed=1)
    return host, backend


_SLOW_FIRST = ("test_readme_demo_main_job", "test_two_processes_share_pages_and_strangers_see_none",
               "test_a_hybrid_sliding_window_model_through_sglangs_assembler",
               "test_llama_pages_fill_the_pool_until_it_evicts", "test_sglangs_own_controller_across_two_processes",
               "test_the_second_scheduler_loads_prefixes_from_the_pool_under_bench_serving")


def pytest_collection_modifyitems(config, items):
    """Start the multi-process tests first, so that with pytest-xdist they overlap the many short ones."""
    here = os.path.join(_HERE, "")
    slow = [it for it in items if getattr(it, "originalname", it.name) in _SLOW_FIRST and str(it.path).startswith(here)]
    if slow:
        rest = [it for it in items if it not in slow]
        items[:] = slow + rest
