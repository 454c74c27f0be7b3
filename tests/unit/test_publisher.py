"""The worker's live publisher never holds up its caller: against a hung broker (a socket that
accepts and never answers, like a SIGSTOPped redis-server) every send returns at once, the
messages are dropped after one socket timeout, and a later send after the pause goes through to
the publisher again."""

from __future__ import annotations

import socket
import threading

from workers.publisher import LivePublisher


def test_a_hung_broker_drops_live_messages_without_blocking_the_sender() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True).start()
    pub = LivePublisher(f"redis://127.0.0.1:{srv.getsockname()[1]}/0", pause_s=0.5)
    sent = threading.Event()

    def sender() -> None:
        for i in range(200):
            pub.send({"i": i}, channels=("a", "b"))
        sent.set()

    threading.Thread(target=sender, daemon=True).start()
    # the 200 sends finish while the first publish still waits on the hung socket
    assert sent.wait(30), "send() blocked on the broker"
    assert pub.drain(timeout_s=30), "the publisher never gave up on the hung broker"
    assert pub.dropped == 200
    assert accepted, "the publisher did try the broker"
    srv.close()
