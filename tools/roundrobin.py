"""A round-robin HTTP forwarder: one URL in front of several SGLang servers, for a client that takes one.

SGLang's benchmark client (`sglang.bench_serving`) sends every request to one base URL. SGLang's
data-parallel controller hands requests to its schedulers round robin; in front of separate servers on one
pool this forwarder does the same, so the client runs unmodified against either. Its rules:
- a generation request (POST /generate, /v1/completions, /v1/chat/completions) goes to the next upstream
  in turn; an upstream that refuses the connection (a killed server) is marked down and skipped, and comes
  back only through `add`;
- any other request (/v1/models, /model_info, /server_info, /health) goes to the first upstream that is up;
- bytes are relayed as they arrive, both sides told `Connection: close`, so a streamed reply streams and
  ends when the upstream closes;
- a request body must carry Content-Length (aiohttp and requests send one); a chunked one gets 411.
It runs on its own event loop in a daemon thread of the calling process.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import urllib.parse

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})


def _address(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    return u.hostname, u.port


class RoundRobin:
    """Forward to `upstreams` (base URLs); `url` is the address to give the client."""

    def __init__(self, upstreams: list[str], host: str = "127.0.0.1"):
        self._lock = threading.Lock()
        self._upstreams = list(upstreams)
        self._down: set[str] = set()
        self._turn = 0
        self.routed: collections.Counter = collections.Counter()  # upstream -> generation requests sent to it
        self.refused: collections.Counter = collections.Counter()  # upstream -> connections refused
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="roundrobin", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ upstreams
    def add(self, url: str) -> None:
        with self._lock:
            if url not in self._upstreams:
                self._upstreams.append(url)
            self._down.discard(url)

    def remove(self, url: str) -> None:
        with self._lock:
            if url in self._upstreams:
                self._upstreams.remove(url)
            self._down.discard(url)

    @property
    def up(self) -> list[str]:
        with self._lock:
            return [u for u in self._upstreams if u not in self._down]

    def _order(self, generation: bool) -> list[str]:
        """Upstreams to try, in order: for a generation, starting at the next one's turn."""
        with self._lock:
            live = [u for u in self._upstreams if u not in self._down]
            if not generation or not live:
                return live
            start = self._turn % len(live)
            self._turn += 1
            return live[start:] + live[:start]

    def _mark_down(self, url: str) -> None:
        with self._lock:
            self._down.add(url)
            self.refused[url] += 1

    # ------------------------------------------------------------------ relay
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            request_line, headers = lines[0], [h for h in lines[1:] if h]
            method, target, _ = request_line.split(" ", 2)
            length, kept = 0, []
            for h in headers:
                name, _, value = h.partition(":")
                name = name.strip().lower()
                if name == "transfer-encoding" and "chunked" in value.lower():
                    writer.write(b"HTTP/1.1 411 Length Required\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                if name == "content-length":
                    length = int(value)
                if name not in _HOP_BY_HOP:
                    kept.append(h)
            body = await reader.readexactly(length) if length else b""
            generation = method == "POST" and urllib.parse.urlsplit(target).path in GENERATION_PATHS
            out = ("\r\n".join([request_line, *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + body
            for upstream in self._order(generation):
                if await self._relay(upstream, out, writer, generation):
                    return
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            pass  # close() ends it: a connection task that ends cancelled makes asyncio log its "exception"
        finally:
            writer.close()  # the transport sends what is buffered, then closes

    async def _relay(self, upstream: str, request: bytes, writer: asyncio.StreamWriter, generation: bool) -> bool:
        """Send `request` to `upstream` and copy its reply to `writer`; False if it refused the connection.
        A generation counts in `routed` once the upstream took the connection."""
        try:
            up_reader, up_writer = await asyncio.open_connection(*_address(upstream))
        except OSError:
            self._mark_down(upstream)
            return False
        if generation:
            with self._lock:
                self.routed[upstream] += 1
        try:
            up_writer.write(request)
            await up_writer.drain()
            while chunk := await up_reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass  # the upstream died mid-reply: the client sees a cut reply, as it would from the server
        finally:
            up_writer.close()
        return True

    def close(self) -> None:
        """Stop listening and end every connection still open (an idle keep-alive one, say)."""
        async def stop():
            self._server.close()
            # A connection accepted just before the close starts its task a step later, after one sweep's
            # snapshot: sweep until no task is left, or the closed loop would drop it pending ("Task was
            # destroyed but it is pending!"). Bounded: each sweep ends what it saw.
            for _ in range(100):
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if not tasks:
                    break
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.sleep(0)
            await self._server.wait_closed()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
