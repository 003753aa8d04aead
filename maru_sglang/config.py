"""The `maru_*` keys of --hicache-storage-backend-extra-config, parsed once with clear errors.

Maru's own keys are accepted so existing configs keep working: the ones that
only made sense with a MaruServer are ignored with one warning.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from maru_shm import parse_size

logger = logging.getLogger("maru_sglang")

DEFAULT_PATH = "/dev/shm/maru_shm"
DEFAULT_POOL_SIZE = 4 << 30
SERVER_ONLY_KEYS = ("maru_server_url", "maru_use_async_rpc", "maru_max_inflight")
KNOWN_KEYS = {
    "maru_path", "maru_pool_size", "maru_chunk_size_bytes", "maru_instance_id", "maru_timeout_ms",
    "maru_eager_map", "maru_mode", "maru_copy_threads", *SERVER_ONLY_KEYS,
}


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
    instance_id: str = ""
    timeout_s: float = 2.0
    eager_map: bool = True
    mode: int = 0o600
    copy_threads: int | None = None  # None: maru_shm's default (every core, at most 4)

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "MaruConfig":
        """Parse the extra config; raise ValueError naming the key for any bad value."""
        extra = dict(extra or {})
        ignored = [k for k in SERVER_ONLY_KEYS if k in extra]
        if ignored:
            logger.warning("maru_shm needs no server: ignoring %s", ", ".join(ignored))
        unknown = sorted(k for k in extra if k.startswith("maru_") and k not in KNOWN_KEYS)
        if unknown:
            logger.warning("unknown maru_* keys ignored: %s (known: %s)", ", ".join(unknown),
                           ", ".join(sorted(KNOWN_KEYS)))
        kw = {}
        if "maru_path" in extra:
            if not isinstance(extra["maru_path"], str) or not extra["maru_path"]:
                raise ValueError(f"maru_path: expected a file path, got {extra['maru_path']!r}")
            kw["path"] = extra["maru_path"]
        for key, field in (("maru_pool_size", "pool_size"), ("maru_chunk_size_bytes", "chunk_size_bytes")):
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
        kw["instance_id"] = str(extra.get("maru_instance_id") or uuid.uuid4().hex[:12])
        return cls(**kw)
