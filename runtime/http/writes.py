"""A busy server's writes to a connection, sent in one system call per response.

uvicorn writes a response's head (on `http.response.start`) and its body (on
`http.response.body`) as two `transport.write` calls, and asyncio's transport
sends each one at once when its buffer is empty: two send(2) calls, two TCP
segments, for every response. On loopback here a send costs about 28 us of
the server's CPU (the kernel delivers the segment to the reader within the
call), about half of what Thaw's warm path adds to a bare app's.

`OneSendPerTurn` stands in for the connection's transport. While the server
has other requests in flight (`busy`), a write is kept, and what is kept is
written to the real transport once, joined: when the response is whole (the
protocol calls `flush`), or when the loop's current turn ends (`call_soon`;
a stream's chunks, at most a turn late). An idle server writes through at
once: there the early head lets the reader wake while the body is being
sent, and one send instead of two made a lone client's requests 6-7 % slower
(BENCHMARKS.md, "The round's fourth session"). A write of `JOIN_LIMIT` or
more goes through at once, after what is kept, rather than be copied into a
join. A close sends what is kept first;
an abort drops it, as the transport's own abort drops its buffer. Flow
control is the real transport's: it sees every byte within the turn it was
written in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

# A write this large goes through at once, after what is kept: joining it would
# copy it for a saving (one send) that is nothing beside its own.
JOIN_LIMIT = 64 * 1024


class OneSendPerTurn(asyncio.Transport):
    """`transport`, its writes of one loop turn joined (see the module docstring)."""

    __slots__ = ("_busy", "_kept", "_loop", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        busy: Callable[[], bool],
    ) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._busy = busy
        self._kept: list[bytes] = []

    # ---- writing ------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if len(data) >= JOIN_LIMIT:
            self.flush()
            self._transport.write(data)
            return
        kept = self._kept
        if not kept:
            if not self._busy():
                self._transport.write(data)
                return
            self._loop.call_soon(self.flush)
        kept.append(bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what is kept to the transport now (nothing once it is closing: a close
        through this object sent it already, and an abort or a lost connection drops it)."""
        kept = self._kept
        if not kept:
            return
        data = kept[0] if len(kept) == 1 else b"".join(kept)
        kept.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._kept)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    # ---- ending ---------------------------------------------------------------------

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._kept.clear()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    # ---- the rest is the transport's ----------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()
