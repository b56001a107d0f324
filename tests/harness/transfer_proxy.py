"""A TCP proxy in front of a decode node's KV-transfer listener that reads the prefill side's frames and, when
armed, does one thing to the next DATA frame: cuts the connection halfway through its payload, flips one
byte of its payload, or only reports that it passed (so a test can stop P while a transfer runs).

The node announces the proxy's address (`--transfer-advertise`), so P dials it. Owns its event loop thread
and every connection it accepted (`close()` ends them). Frames are parsed with the protocol's own prefix
(kvtransfer/framing.py); nothing is buffered beyond one frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from pdserve.cli.up import free_port
from pdserve.kvtransfer.framing import PREFIX, PREFIX_SIZE
from pdserve.kvtransfer.messages import Data

MODES = ("cut", "corrupt", "mark")


class FrameProxy:
    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target_port = target_port
        self.struck = threading.Event()
        """Set when the armed fault was done to a DATA frame."""
        self._mode: str | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="frame-proxy", daemon=True)

    def start(self) -> FrameProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def arm(self, mode: str) -> None:
        assert mode in MODES, mode
        with self._lock:
            self.struck.clear()
            self._mode = mode

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _take(self) -> str | None:
        with self._lock:
            mode, self._mode = self._mode, None
            return mode

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        await self._server.wait_closed()

    async def _accept(self, p_reader: asyncio.StreamReader, p_writer: asyncio.StreamWriter) -> None:
        try:
            d_reader, d_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            p_writer.transport.abort()
            return
        self._writers |= {p_writer, d_writer}
        back = asyncio.create_task(self._copy(d_reader, p_writer))
        try:
            await self._frames(p_reader, d_writer)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            for w in (p_writer, d_writer):
                w.transport.abort()
                self._writers.discard(w)
            back.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await back

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        writer.transport.abort()

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """P -> D frame by frame (prefix, header, payload); the armed fault hits the next DATA payload."""
        while True:
            prefix = await reader.readexactly(PREFIX_SIZE)
            _, _, msg_type, _, header_len, payload_len, _ = PREFIX.unpack(prefix)
            header = await reader.readexactly(header_len) if header_len else b""
            payload = bytearray(await reader.readexactly(payload_len)) if payload_len else bytearray()
            mode = self._take() if msg_type == Data.TYPE and payload_len else None
            if mode == "cut":
                writer.write(prefix + header + payload[: payload_len // 2])
                await writer.drain()
                self.struck.set()
                return  # both ends are cut in the middle of the frame
            if mode == "corrupt":
                payload[payload_len // 2] ^= 0xFF
            writer.write(prefix + header + payload)
            await writer.drain()
            if mode is not None:
                self.struck.set()
