"""A real HTTP server on a free loopback port that records webhook POSTs, for tests: it answers
the first `fail_first` requests 500, or never answers at all (`hang`), or drips its answer's
headers a byte at a time (`drip_s`), or answers a body of `answer_bytes`; and `ConnectProxy`, an
HTTP CONNECT proxy on loopback that tunnels to 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    headers: dict[str, str]
    body: str
    answered: int


@dataclass
class Receiver:
    fail_first: int = 0
    hang: bool = False
    drip_s: float = 0.0
    """> 0: send `HTTP/1.1 200 OK` at once, then `drip_bytes` bytes of a header, one per drip_s."""
    drip_bytes: int = 100
    answer_bytes: int = 0
    """> 0: answer 200 with a body this long, written as fast as the connection takes it."""
    requests: list[Received] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    """Bytes of the dripped header or of the long body written so far."""
    cut_short: threading.Event = field(default_factory=threading.Event)
    """The other end closed the connection before the whole answer was written."""
    finished: threading.Event = field(default_factory=threading.Event)
    """The whole dripped or long answer was written."""

    def __post_init__(self) -> None:
        receiver = self
        # written again and again: the long answer allocates nothing while it is sent
        block = memoryview(bytes(1 << 20))

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
                if receiver.hang:
                    receiver.requests.append(Received(dict(self.headers), body, 0))
                    receiver.arrived.set()
                    receiver.release.wait(120)  # never answers while the test runs
                    return
                if receiver.drip_s > 0 or receiver.answer_bytes > 0:
                    receiver.requests.append(Received(dict(self.headers), body, 0))
                    receiver.arrived.set()
                    try:
                        self._long_answer()
                    except OSError:  # a broken pipe or a reset: the deliverer hung up
                        receiver.cut_short.set()
                    return
                code = 500 if len(receiver.requests) < receiver.fail_first else 200
                receiver.requests.append(Received(dict(self.headers), body, code))
                receiver.arrived.set()
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _long_answer(self) -> None:
                if receiver.drip_s > 0:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
                    for _ in range(receiver.drip_bytes):
                        time.sleep(receiver.drip_s)
                        self.wfile.write(b"a")
                        receiver.sent += 1
                    self.wfile.write(b"\r\nContent-Length: 0\r\n\r\n")
                else:
                    self.send_response(200)
                    self.send_header("Content-Length", str(receiver.answer_bytes))
                    self.end_headers()
                    while receiver.sent < receiver.answer_bytes:
                        n = min(len(block), receiver.answer_bytes - receiver.sent)
                        self.wfile.write(block[:n])
                        receiver.sent += n
                receiver.finished.set()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def answered_ok(self) -> list[Received]:
        return [r for r in self.requests if r.answered == 200]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class ConnectProxy:
    """An HTTP CONNECT proxy on a free loopback port: records each request's head, refuses (403)
    a tunnel anywhere but 127.0.0.1 (a test never reaches another address) or every tunnel when
    `refuse`, and otherwise pipes bytes both ways."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.heads: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._spawn(self._accept)

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = client.recv(4096)
                if not chunk:
                    return
                head += chunk
            text = head.split(b"\r\n\r\n", 1)[0].decode("latin-1")
            self.heads.append(text)
            method, authority = text.split(" ", 2)[:2]
            host, _, port = authority.rpartition(":")
            if self.refuse or method != "CONNECT" or host != "127.0.0.1":
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as upstream:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                done = threading.Event()
                self._spawn(self._pipe, upstream, client, done)
                self._pipe(client, upstream, done)
                done.wait(30)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, done: threading.Event) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            done.set()

    def close(self) -> None:
        self._closing = True
        self.listener.close()
