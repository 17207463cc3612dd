"""A stand-in for TRL's remote-session environments (OpenEnv, Harbor, OpenReward clients): a tiny TCP server on
127.0.0.1 holds each session's state, and the environment is a client whose `reset()` opens a socket to a new session
and whose tools send commands over it. Such a client cannot be deep-copied (a socket cannot be pickled), so a tree
can only branch it by replay.

    with SessionServer() as server:
        trainer = TreeOPSDTrainer(..., environment_factory=server.factory(RemoteCounterEnv))
"""

from __future__ import annotations

import itertools
import socket
import socketserver
import threading

TIMEOUT_S = 10.0  # every socket operation of the server and the clients is bounded


class _Session(socketserver.StreamRequestHandler):
    """One connection = one session with its own counter. Commands: ADD n, GET, TICKET (a server-wide number)."""

    def handle(self):
        self.request.settimeout(TIMEOUT_S)
        counter = 0
        owner: SessionServer = self.server.owner
        with owner.lock:
            owner.sessions += 1
        try:
            for line in self.rfile:
                command, *args = line.decode().split()
                if command == "ADD":
                    counter += int(args[0])
                    reply = counter
                elif command == "GET":
                    reply = counter
                elif command == "TICKET":
                    with owner.lock:
                        reply = next(owner.tickets)
                else:
                    reply = "ERROR unknown command"
                self.wfile.write(f"{reply}\n".encode())
        except (TimeoutError, ConnectionError, OSError):
            pass


class SessionServer:
    """The server, on a daemon thread; `close()` (or leaving the `with` block) closes every client it handed out and
    stops the server."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions = 0  # connections opened so far (one per reset)
        self.created = 0  # clients built by `factory` so far
        self.tickets = itertools.count(1)
        self.clients: list[RemoteCounterEnv] = []
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Session)
        self._server.daemon_threads = True
        self._server.owner = self
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def factory(self, cls):
        """A zero-argument `environment_factory` building clients of this server."""

        def make():
            self.created += 1
            client = cls(self.address)
            self.clients.append(client)
            return client

        return make

    def close(self):
        for client in self.clients:
            client._close()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(TIMEOUT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RemoteCounterEnv:
    """A client of one remote session holding a counter."""

    def __init__(self, address):
        self._address = address
        self._socket = None
        self._io = None

    def reset(self, **kwargs):
        self._close()
        self._socket = socket.create_connection(self._address, timeout=TIMEOUT_S)
        self._io = self._socket.makefile("rwb")

    def increment(self) -> str:
        """Adds one to the counter.

        Returns:
            The counter's new value.
        """
        return self._send("ADD 1")

    def add(self, amount: int) -> str:
        """Adds an amount to the counter.

        Args:
            amount: how much to add.

        Returns:
            The counter's new value.
        """
        return self._send(f"ADD {int(amount)}")

    @property
    def n(self) -> int:
        """The session's counter, read from the server."""
        return int(self._send("GET"))

    def _send(self, command: str) -> str:
        if self._io is None:
            raise RuntimeError("Not connected: call reset() first.")
        self._io.write(f"{command}\n".encode())
        self._io.flush()
        return self._io.readline().decode().strip()

    def _close(self):
        if self._socket is not None:
            self._io.close()
            self._socket.close()
            self._socket = self._io = None


class TicketEnv(RemoteCounterEnv):
    """Not deterministic: tickets are numbered server-wide, so a replayed call gets a different number."""

    def take_ticket(self) -> str:
        """Takes the next ticket.

        Returns:
            The ticket's number.
        """
        return self._send("TICKET")
