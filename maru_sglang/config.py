"""The `maru_*` keys of --hicache-storage-backend-extra-config, parsed once with clear errors.

Maru's own keys are accepted so existing configs keep working: the ones that
only made sense with a MaruServer are ignored with one warning, and so are
retired keys of ours (RETIRED_KEYS).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid

from maru_shm import parse_size

logger = logging.getLogger("maru_sglang")

DEFAULT_PATH = "/dev/shm/maru_shm"
DEFAULT_POOL_SIZE = 4 << 30
SERVER_ONLY_KEYS = ("maru_server_url", "maru_use_async_rpc", "maru_max_inflight")
# maru_prefix_eviction turned on relation records, removed: they lost tokens to the CLOCK (BENCHMARKS.md).
RETIRED_KEYS = ("maru_prefix_eviction",)
KNOWN_KEYS = {
    "maru_path", "maru_pool_size", "maru_chunk_size_bytes", "maru_min_page_bytes", "maru_instance_id",
    "maru_timeout_ms", "maru_eager_map", "maru_mode", "maru_copy_threads", "maru_tier2",
    "maru_tier2_retry_s", "maru_heal_retry_s", "maru_openmp_wait", *SERVER_ONLY_KEYS, *RETIRED_KEYS,
}
OPENMP_WAITS = ("auto", "sleep", "spin")
DEFAULT_TIER2_RETRY_S = 2.0
DEFAULT_HEAL_RETRY_S = 1.0


def _bool(value, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"{key}: expected a boolean, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MaruConfig:
    path: str = DEFAULT_PATH
    pool_size: int = DEFAULT_POOL_SIZE
    chunk_size_bytes: int | None = None
    min_page_bytes: int | None = None  # smallest page of any instance on the pool: what creation sizes it for
    instance_id: str = ""
    timeout_s: float = 2.0
    eager_map: bool = True
    mode: int = 0o600
    copy_threads: int | None = None  # None: maru_shm's default (every core, at most 4)
    tier2: dict | None = None  # SGLang mooncake backend keys of the second tier; None: no second tier
    tier2_retry_s: float = DEFAULT_TIER2_RETRY_S
    heal_retry_s: float = DEFAULT_HEAL_RETRY_S  # how often the pool file is checked, and the first wait to reopen it
    openmp_wait: str = "auto"  # what the host's idle OpenMP workers do (maru_sglang.openmpwait)

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "MaruConfig":
        """Parse the extra config; raise ValueError naming the key for any bad value."""
        extra = dict(extra or {})
        ignored = [k for k in SERVER_ONLY_KEYS if k in extra]
        if ignored:
            logger.warning("maru_shm needs no server: ignoring %s", ", ".join(ignored))
        retired = [k for k in RETIRED_KEYS if k in extra]
        if retired:
            logger.warning("ignoring %s: no longer used (every page is evicted by the pool's own policy)",
                           ", ".join(retired))
        unknown = sorted(k for k in extra if k.startswith("maru_") and k not in KNOWN_KEYS)
        if unknown:
            logger.warning("unknown maru_* keys ignored: %s (known: %s)", ", ".join(unknown),
                           ", ".join(sorted(KNOWN_KEYS)))
        kw = {}
        if "maru_path" in extra:
            if not isinstance(extra["maru_path"], str) or not extra["maru_path"]:
                raise ValueError(f"maru_path: expected a file path, got {extra['maru_path']!r}")
            kw["path"] = extra["maru_path"]
        for key, field in (("maru_pool_size", "pool_size"), ("maru_chunk_size_bytes", "chunk_size_bytes"),
                           ("maru_min_page_bytes", "min_page_bytes")):
            if extra.get(key) is not None:
                try:
                    kw[field] = parse_size(extra[key])
                except ValueError as e:
                    raise ValueError(f"{key}: {e}") from None
                if kw[field] <= 0:
                    raise ValueError(f"{key}: must be positive, got {extra[key]!r}")
        if "maru_timeout_ms" in extra:
            try:
                ms = float(extra["maru_timeout_ms"])
            except (TypeError, ValueError):
                raise ValueError(f"maru_timeout_ms: expected milliseconds, got {extra['maru_timeout_ms']!r}") from None
            if not 0 < ms <= 86_400_000:  # also refuses NaN and inf, which would wait forever
                raise ValueError(f"maru_timeout_ms: must be a positive, finite number of milliseconds (at most a "
                                 f"day), got {extra['maru_timeout_ms']!r}")
            kw["timeout_s"] = ms / 1000.0
        if "maru_eager_map" in extra:
            kw["eager_map"] = _bool(extra["maru_eager_map"], "maru_eager_map")
        if "maru_mode" in extra:
            m = extra["maru_mode"]
            try:
                kw["mode"] = int(m, 8) if isinstance(m, str) else int(m)
            except (TypeError, ValueError):
                raise ValueError(f"maru_mode: expected an octal file mode like '0660', got {m!r}") from None
            if not 0 <= kw["mode"] <= 0o777:
                raise ValueError(f"maru_mode: out of range: {m!r}")
        if extra.get("maru_copy_threads") not in (None, "auto"):
            t = extra["maru_copy_threads"]
            if isinstance(t, bool) or not isinstance(t, (int, str)) or not str(t).strip().isdigit() \
                    or not 1 <= int(t) <= 64:
                raise ValueError(f"maru_copy_threads: expected 'auto' or an integer from 1 to 64, got {t!r}")
            kw["copy_threads"] = int(t)
        if extra.get("maru_tier2") is not None:
            kw["tier2"] = _tier2_settings(extra["maru_tier2"])
        if "maru_tier2_retry_s" in extra:
            kw["tier2_retry_s"] = _seconds(extra["maru_tier2_retry_s"], "maru_tier2_retry_s", 0.05, 3600)
        if "maru_heal_retry_s" in extra:
            kw["heal_retry_s"] = _seconds(extra["maru_heal_retry_s"], "maru_heal_retry_s", 0.01, 3600)
        if extra.get("maru_openmp_wait") is not None:
            w = extra["maru_openmp_wait"]
            if w not in OPENMP_WAITS:
                raise ValueError(f"maru_openmp_wait: expected one of {', '.join(OPENMP_WAITS)}, got {w!r}")
            kw["openmp_wait"] = w
        kw["instance_id"] = str(extra.get("maru_instance_id") or uuid.uuid4().hex[:12])
        return cls(**kw)


def _seconds(value, key: str, low: float, high: float) -> float:
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected seconds, got {value!r}") from None
    if not low <= s <= high:  # also refuses NaN
        raise ValueError(f"{key}: must be between {low} and {high} seconds, got {value!r}")
    return s


def _tier2_settings(value) -> dict:
    """maru_tier2: the keys of SGLang's mooncake backend, as a JSON object or a string holding one.

    master_server_address (host:port) is required: the tier attaches only once that port answers. The
    namespace tag is the tier's own (extra_backend_tag is set from the key space), so it may not be given.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"maru_tier2: not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"maru_tier2: expected an object of mooncake settings, got {value!r}")
    master_address(value.get("master_server_address"))
    if "extra_backend_tag" in value:
        raise ValueError("maru_tier2: extra_backend_tag is set by maru (the pool's namespace); remove it")
    if value.get("standalone_storage"):
        raise ValueError("maru_tier2: standalone_storage needs Mooncake's own host allocator; not supported")
    return dict(value)


def master_address(addr) -> tuple[str, int]:
    """(host, port) of a Mooncake master_server_address "host:port" ("[v6]:port" too); ValueError otherwise."""
    host, _, port = str(addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"maru_tier2: master_server_address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)
