"""A real HTTP server on a free loopback port that records webhook POSTs, for tests: it answers
the first `fail_first` requests 500, or never answers at all (`hang`)."""

from __future__ import annotations

import threading
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
    requests: list[Received] = field(default_factory=list)
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
                if receiver.hang:
                    receiver.requests.append(Received(dict(self.headers), body, 0))
                    receiver.arrived.set()
                    receiver.release.wait(120)  # never answers while the test runs
                    return
                code = 500 if len(receiver.requests) < receiver.fail_first else 200
                receiver.requests.append(Received(dict(self.headers), body, code))
                receiver.arrived.set()
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def answered_ok(self) -> list[Received]:
        return [r for r in self.requests if r.answered == 200]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
