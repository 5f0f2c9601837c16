"""A rank's two-way link to the driver, as the worker side sees it: the `Channel` protocol
that every engine provides and the worker's `Session` uses, and `PipeChannel`, the one both
engines build on a `multiprocessing.connection` (a pipe locally, a TCP connection on Ray).
"""

from __future__ import annotations

import select
from typing import Any, Protocol

from unbroken.worker.protocol import from_wire, to_wire


class Channel(Protocol):
    """One rank's two-way link to the driver, used on the worker side.

    Messages arrive in the order they were sent, each whole or not at all. `recv` blocks
    until a message arrives; it raises EOFError or OSError once the driver is gone (the
    worker then ends). `send` of a message the driver can no longer take raises OSError.
    `hung_up` says, without blocking or reading, whether the driver has closed its end: it
    ended this attempt (or died), so this rank must stop writing anything.
    """

    def send(self, message: Any) -> None: ...

    def recv(self) -> Any: ...

    def hung_up(self) -> bool: ...


class PipeChannel:
    """A local worker's `Channel`: its end of the pipe to the driver, carrying messages as
    plain tuples (`protocol.to_wire`)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send(to_wire(message))

    def recv(self) -> Any:
        return from_wire(self.conn.recv())

    def hung_up(self) -> bool:
        poller = select.poll()
        poller.register(self.conn.fileno(), select.POLLIN | select.POLLRDHUP)
        closed = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL
        return any(events & closed for _, events in poller.poll(0))
