"""mpitrainrun's end of the lines its elastic ranks open (api/elastic_channel.py).

One thread serves them all. It keeps, for the run in progress, the ranks'
ends in the order they came: an unhandled exception, or a line that closed
without a word (the rank was killed; its host, whose kernel closed the
line, still answers). The first of these says why the run ended: Open MPI
cannot, since when one rank dies a rank on another host often aborts first
and is the one it names. A line still open after mpirun has ended belongs
to a host out of reach (powered off, or cut off from the network: nothing
closed its connections), whose loss comes first whatever the others raised
meanwhile (a stall's ShutdownError). Rank 0's messages (resumed from commit
N, stopping at commit N for new hosts) are kept too, and the news that
hosts changed goes to rank 0 through it.
"""

import dataclasses
import hmac
import selectors
import socket
import threading
import time

from mpitrain.launcher.hosts import is_this_machine
from mpitrain.runtime import elastic_job

# The most a connection may send before its hello, which takes a rank some
# 150 bytes: more is a stranger's, closed instead of read into memory.
HELLO_LIMIT = 4096


@dataclasses.dataclass
class End:
    """How a rank's part in a run ended: ``kind`` is "exception", "killed"
    (its line closed without a word: its host still answered) or
    "unreachable" (its line was still open when mpirun ended)."""
    kind: str
    rank: int
    detail: str = ""
    at: float = dataclasses.field(default_factory=time.monotonic)


class _Peer:
    def __init__(self, connection):
        self.connection = connection
        self.unread = b""
        self.rank = None            # known once it said hello
        self.restart = None
        self.said_how_it_ends = False


class RankLines:
    """Accepts the ranks' lines and reads them in a thread of its own."""

    def __init__(self, token, on_message):
        self.token = token
        self.on_message = on_message        # called with rank 0's resumed/stopping messages
        self._selector = selectors.DefaultSelector()
        self._servers = {}                  # address -> the socket listening there
        self._lock = threading.Lock()
        self.restart = None
        self.ends = []
        self.stopping = None
        self.generation = 0
        self._rank_zero = None
        threading.Thread(target=self._serve, daemon=True,
                         name="mpitrainrun-rank-lines").start()

    def address_for(self, hosts):
        """address:port where the ranks on ``hosts`` reach this launcher, which
        listens there and nowhere else: loopback when every host is this
        machine, else the address the route to the first other host leaves by."""
        others = [host for host in hosts if not is_this_machine(host)]
        address = route_address(others[0]) if others else "127.0.0.1"
        with self._lock:
            if address not in self._servers:
                self._servers[address] = socket.create_server((address, 0))
                self._selector.register(self._servers[address], selectors.EVENT_READ)
            return f"{address}:{self._servers[address].getsockname()[1]}"

    def start_run(self, restart):
        with self._lock:
            for peer in self._peers():          # lines to a host that is gone
                self._selector.unregister(peer.connection)
                peer.connection.close()
            self.restart = restart
            self.ends, self.stopping, self.generation = [], None, 0
            self._rank_zero = None

    def announce_hosts_changed(self):
        """Tell rank 0 (now, or when it connects) that the hosts changed."""
        with self._lock:
            self.generation += 1
            self._tell_rank_zero()

    def _tell_rank_zero(self):
        if self._rank_zero is not None and self.generation:
            try:
                self._rank_zero.connection.sendall(
                    elastic_job.encode({"hosts_updated": self.generation}))
            except OSError:
                pass

    def settle(self, seconds=5):
        """After mpirun has ended: wait until every line of the run has been
        read to its end (the processes are gone, so it comes at once)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self._lock:
                if not any(peer.restart == self.restart
                           for peer in self._peers()):
                    return
            time.sleep(0.02)

    def seconds_since_an_end(self):
        """How long ago the first rank of the run ended, or None."""
        with self._lock:
            return time.monotonic() - self.ends[0].at if self.ends else None

    def first_end(self):
        """The first rank to go: one whose line is still open once mpirun has
        ended (its host is out of reach: down, or cut off), else the first
        to raise or to die."""
        with self._lock:
            unreachable = sorted(peer.rank for peer in self._peers()
                                 if peer.restart == self.restart)
            if unreachable:
                return End("unreachable", unreachable[0])
            return self.ends[0] if self.ends else None

    def _peers(self):
        return [key.data for key in self._selector.get_map().values()
                if key.data is not None]

    def _serve(self):
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    self._accept(key.fileobj)
                else:
                    self._read(key.data)

    def _accept(self, server):
        try:
            connection, _ = server.accept()
        except OSError:                 # reset before it was taken
            return
        self._selector.register(connection, selectors.EVENT_READ, _Peer(connection))

    def _read(self, peer):
        try:
            data = peer.connection.recv(1 << 16)
        except OSError:
            data = b""
        with self._lock:
            if not data:
                self._closed(peer)
                return
            *lines, peer.unread = (peer.unread + data).split(b"\n")
            for line in lines:
                if peer.connection.fileno() == -1:      # a stranger's, dropped
                    return
                if peer.rank is None:
                    self._hello(peer, line)
                else:
                    self._heard(peer, decoded(line))
            if peer.rank is None and len(peer.unread) > HELLO_LIMIT:
                self._drop(peer)

    def _drop(self, peer):
        if peer.connection.fileno() != -1:
            self._selector.unregister(peer.connection)
            peer.connection.close()

    def _closed(self, peer):
        self._drop(peer)
        if peer.restart == self.restart and not peer.said_how_it_ends:
            self.ends.append(End("killed", peer.rank))
        if peer is self._rank_zero:
            self._rank_zero = None

    def _hello(self, peer, line):
        """A line before the hello: a rank of this run says who it is. Any
        other (a stranger's, a rank's of an earlier run) closes the line."""
        message = decoded(line) if len(line) <= HELLO_LIMIT else None
        token = message.get("token") if message else None
        if not (isinstance(token, str) and hmac.compare_digest(
                token.encode(errors="replace"), self.token.encode())
                and message.get("restart") == self.restart
                and isinstance(message.get("rank"), int)):
            self._drop(peer)
            return
        peer.rank, peer.restart = message["rank"], message["restart"]
        if peer.rank == 0:
            self._rank_zero = peer
            self._tell_rank_zero()

    def _heard(self, peer, message):
        if message is None or peer.restart != self.restart:
            return
        if "exception" in message:
            peer.said_how_it_ends = True
            self.ends.append(End("exception", peer.rank, str(message["exception"])))
        elif "exit" in message:
            peer.said_how_it_ends = True
        elif peer.rank == 0 and ("resumed" in message or "stopping" in message):
            if "stopping" in message:
                self.stopping = message
            self.on_message(message)


def decoded(line):
    """The message on a line, or None. Any line may be a stranger's, and
    whatever decoding it raises (RecursionError for "[" * 200000) drops it."""
    try:
        return elastic_job.decode(line)
    except Exception:
        return None


def route_address(host):
    """The address of this machine that the route to ``host`` leaves by."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
