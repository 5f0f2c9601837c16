"""The link between the Ray engine's driver and its ranks: one TCP connection per rank,
opened by the rank, and accepted by the driver only after `multiprocessing.connection`'s HMAC
challenge (the secret drawn for the attempt never crosses the network, and nothing is
unpickled from a peer that has not proved it holds it)."""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import (
    AuthenticationError,
    Connection,
    answer_challenge,
    deliver_challenge,
)

HANDSHAKE_S = 10  # how long a connecting peer may take over the challenge


def no_delay(conn: Connection) -> None:
    """Small messages each way per report: do not let Nagle's algorithm hold them back."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Listener:
    """The driver's end: a TCP server on the driver's node address (port 0: no race) that
    hands out connections only after they passed the authentication challenge."""

    def __init__(self, host: str, authkey: bytes) -> None:
        self.authkey = authkey
        self.sock = socket.create_server((host, 0))
        self.address = self.sock.getsockname()[:2]

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Connection | None:
        """A connection that proved it holds the secret, or None (a stranger, or one that
        stalled for 10 s in the handshake)."""
        sock, _ = self.sock.accept()
        timeout = struct.pack("ll", HANDSHAKE_S, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            with socket.socket(fileno=os.dup(conn.fileno())) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        except (AuthenticationError, OSError, EOFError):
            conn.close()
            return None
        return conn

    def close(self) -> None:
        self.sock.close()
