"""Where webhooks may go, and how long and how much a receiver may hold a delivery (core/egress.py):
every non-public form of an address refused before any connection, names resolved once and the
checked address connected to, one deadline for a whole delivery, at most 64 KiB of an answer read,
the operator's allow-list and egress proxy, and the per-user cap. Real sockets on 127.0.0.1 only:
nothing here connects anywhere else (a stubbed resolver stands in for names of other addresses)."""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError

from api.main import create_app
from core import egress
from core.egress import ANSWER_MAX_BYTES, EgressAllow, Proxy, UnsafeUrl, check_url
from core.settings import Settings
from core.webhooks import Deliverer
from db import jobs as dbj
from db import users as dbu
from db import webhooks as dbw
from db.connection import session_for
from db.migrate import upgrade
from tests.webhook_receiver import ConnectProxy, Receiver

NOTHING_ALLOWED = EgressAllow()
LOOPBACK = ["127.0.0.1/32"]


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Any outbound connection fails the test: a refusal must come from the check alone."""
    tried: list[object] = []

    def refuse(*args: object, **_kw: object) -> None:
        tried.append(args)
        raise AssertionError(f"a connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return tried


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """A resolver for made-up names (tests fill it in); counts every lookup in `names["lookups"]`."""
    table: dict[str, list[str]] = {"lookups": []}
    real = socket.getaddrinfo

    def fake(host: str, port: object, *args: object, **kw: object) -> list[tuple]:  # type: ignore[type-arg]
        if host not in table:
            return real(host, port, *args, **kw)  # type: ignore[arg-type]
        table["lookups"].append(host)
        answers = table[host]
        # a name whose answers are used up keeps giving the last: a second lookup sees a rebind
        addr = answers.pop(0) if len(answers) > 1 else answers[0]
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sockaddr = (addr, port or 0, 0, 0) if family == socket.AF_INET6 else (addr, port or 0)
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return table


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://127.0.0.1/h", "non-public address, a loopback address"),
        ("http://[::1]/h", "non-public address, a loopback address"),
        ("http://0.0.0.0/h", "an unspecified address"),
        ("http://[::]/h", "an unspecified address"),
        ("http://169.254.169.254/latest/meta-data", "a link-local address"),
        ("http://[fe80::1]/h", "a link-local address"),
        ("http://10.1.2.3/h", "a private address"),
        ("http://[fc00::1]/h", "a private address"),
        ("http://[fec0::1]/h", "a site-local address"),
        ("http://224.0.0.1/h", "a multicast address"),
        ("http://[ff02::1]/h", "a multicast address"),
        ("http://100.64.0.1/h", "not a globally routable address"),
        ("http://[::ffff:127.0.0.1]/h", "the IPv4-mapped form of 127.0.0.1, a loopback address"),
        ("http://[::ffff:a9fe:a9fe]/h", "the IPv4-mapped form of 169.254.169.254, a link-local"),
        ("http://[::7f00:1]/h", "the IPv4-compatible form of 127.0.0.1, a loopback address"),
        ("http://[::5db8:d70e]/h", "an IPv4-compatible address"),
        ("http://[64:ff9b::7f00:1]/h", "the NAT64 form of 127.0.0.1, a loopback address"),
        ("http://[64:ff9b::a00:1]/h", "the NAT64 form of 10.0.0.1, a private address"),
        ("http://[2002:7f00:1::1]/h", "the 6to4 form of 127.0.0.1, a loopback address"),
        ("http://[2002:a9fe:a9fe::1]/h", "the 6to4 form of 169.254.169.254, a link-local"),
        # Teredo keeps the client's address inverted: 80ff:fffe is 127.0.0.1
        ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/h", "the Teredo form of 127.0.0.1"),
        ("http://2130706433/h", "not written as four decimal numbers"),
        ("http://0177.0.0.1/h", "not written as four decimal numbers"),
        ("http://0x7f.1/h", "not written as four decimal numbers"),
        ("http://127.1/h", "not written as four decimal numbers"),
        ("http://0x7f000001/h", "not written as four decimal numbers"),
        ("http://1572394766/h", "not written as four decimal numbers"),  # 93.184.215.14: public, even so
        ("http://[fe80::1%25eth0]/h", "IPv6 zone"),
        ("http://example.com:0/h", "port must be from 1 to 65535"),
    ],
)
def test_every_non_public_form_is_refused_before_any_connection(
    url: str, rule: str, no_connect: list[object]
) -> None:
    with pytest.raises(UnsafeUrl, match=rule.replace(".", r"\.").replace("(", r"\(")):
        check_url(url, allow=NOTHING_ALLOWED)
    assert not no_connect


def test_a_name_that_does_not_resolve_is_refused(no_connect: list[object]) -> None:
    with pytest.raises(UnsafeUrl, match="the host hooks.shardyard.invalid does not resolve"):
        check_url("https://hooks.shardyard.invalid/h", allow=NOTHING_ALLOWED)
    assert not no_connect


@pytest.mark.parametrize(
    ("answers", "rule"),
    [
        (["::ffff:10.0.0.1"], "::ffff:a00:1 is the IPv4-mapped form of 10.0.0.1, a private address"),
        (["64:ff9b::a9fe:a9fe"], "the NAT64 form of 169.254.169.254, a link-local address"),
        (["2002:c0a8:101::1"], "the 6to4 form of 192.168.1.1, a private address"),
        (["127.0.0.1"], "resolves to a non-public address: 127.0.0.1 is a loopback address"),
    ],
)
def test_names_that_resolve_to_a_non_public_form_are_refused(
    answers: list[str], rule: str, names: dict[str, list[str]], no_connect: list[object]
) -> None:
    names["sneaky.example"] = answers
    with pytest.raises(UnsafeUrl, match=rule.replace(".", r"\.")):
        check_url("http://sneaky.example/h", allow=NOTHING_ALLOWED)
    assert not no_connect


def test_every_address_a_name_resolves_to_must_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    def both(host: str, port: object, *args: object, **kw: object) -> list[tuple]:  # type: ignore[type-arg]
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", both)
    with pytest.raises(UnsafeUrl, match=r"10\.0\.0\.7 is a private address"):
        check_url("http://half.example/h", allow=NOTHING_ALLOWED)


def test_public_addresses_pass_and_their_translations_too(names: dict[str, list[str]]) -> None:
    names["hooks.example"] = ["93.184.215.14"]
    target = check_url("https://Hooks.Example./a/b?x=1#frag", allow=NOTHING_ALLOWED)
    assert (target.host, target.port, target.path) == ("hooks.example", 443, "/a/b?x=1")
    assert [str(a) for a in target.addresses] == ["93.184.215.14"]
    # a public IPv4 address behind NAT64 (an IPv6-only network's DNS64) or 6to4 is still public
    check_url("http://[64:ff9b::5db8:d70e]/h", allow=NOTHING_ALLOWED)
    check_url("http://[2002:5db8:d70e::1]/h", allow=NOTHING_ALLOWED)


def test_the_allow_list_admits_exactly_what_it_names(names: dict[str, list[str]], no_connect: list) -> None:
    allow = EgressAllow.parse(["127.0.0.1/32", "10.20.0.0/16", "hooks.internal"])
    check_url("http://127.0.0.1:8000/h", allow=allow)
    check_url("http://10.20.3.4/h", allow=allow)
    names["hooks.internal"] = ["10.99.0.5"]
    check_url("http://hooks.internal/h", allow=allow)
    # the same loopback in other spellings, and its neighbours, stay refused
    for url in (
        "http://127.0.0.2/h",
        "http://[::ffff:127.0.0.1]/h",
        "http://[64:ff9b::7f00:1]/h",
        "http://2130706433/h",
        "http://0x7f.1/h",
        "http://10.21.0.1/h",
        "http://[::1]/h",
    ):
        with pytest.raises(UnsafeUrl):
            check_url(url, allow=allow)
    names["other.internal"] = ["10.99.0.5"]
    with pytest.raises(UnsafeUrl, match="SHARDYARD_WEBHOOK_ALLOW"):
        check_url("http://other.internal/h", allow=allow)
    assert not no_connect


def test_the_allow_list_and_proxy_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDYARD_WEBHOOK_ALLOW", '["127.0.0.1/32", "hooks.internal"]')
    assert Settings().webhook_allow == ["127.0.0.1/32", "hooks.internal"]
    monkeypatch.setenv("SHARDYARD_WEBHOOK_ALLOW", '["127.0.0.1/33"]')
    with pytest.raises(ValidationError, match="neither a network"):
        Settings()
    monkeypatch.delenv("SHARDYARD_WEBHOOK_ALLOW")
    assert Settings().webhook_allow == []  # nothing non-public unless the operator says so
    proxy = Proxy.parse("http://u%40x:p%3Aw@127.0.0.1:3128")
    assert proxy is not None and (proxy.host, proxy.port) == ("127.0.0.1", 3128)
    assert proxy.authorization == "Basic " + base64.b64encode(b"u@x:p:w").decode()
    for bad in (
        "socks5://u:hunter2@127.0.0.1:1080",
        "https://127.0.0.1:3128",
        "http://:3128",
        "http://h:port",
    ):
        with pytest.raises(ValueError, match="SHARDYARD_WEBHOOK_PROXY") as e:
            Proxy.parse(bad)
        assert "hunter2" not in str(e.value)  # the message never repeats the URL


# ---- deliveries against real receivers on loopback ----


@pytest.fixture
def receivers() -> Iterator[list[Receiver | ConnectProxy]]:
    made: list[Receiver | ConnectProxy] = []
    yield made
    for r in made:
        r.close()


def _settings(url: str, **over: object) -> Settings:
    base = {
        "webhook_backoff_s": 0.05,
        "webhook_allow": LOOPBACK,
        "webhook_timeout_s": 5.0,
        "webhook_attempts": 1,
    }
    return Settings(database_url=url, **{**base, **over})


def _ended_job_told_to(db_url: str, target: str) -> int:
    """A webhook of a new user on `target`, written as is (the registration's check is the API's),
    and one ended job of that user: one delivery due."""
    with session_for(db_url) as s:
        user = dbu.create_user(s, name="ann").id
        hook = dbw.create_webhook(s, user_id=user, url=target, events="all", secret="k").id
        job = dbj.create_job(s, name="j", spec={}, steps=1, owner_id=user).id
        dbj.fail_job(s, job_id=job, reason="x")
    return hook


def _settle(db_url: str, deliverer: Deliverer, hook: int, timeout_s: float = 60) -> tuple[str, list]:
    """Poll until the delivery is no longer pending; its state and attempts."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with session_for(db_url) as s:
                [(delivery, attempts)] = dbw.deliveries(s, webhook_id=hook, limit=1)
            if delivery.state != "pending":
                return delivery.state, attempts
            assert time.monotonic() < deadline, "the delivery did not settle"
            deliverer.poll()
            time.sleep(0.05)
    finally:
        deliverer.stop()


def test_a_non_public_url_in_the_outbox_is_refused_at_delivery_without_connecting(
    db_url: str, receivers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    rx = Receiver()
    receivers.append(rx)
    # allowed when the webhook was made; the operator then narrowed the list
    hook = _ended_job_told_to(db_url, f"http://[::ffff:127.0.0.1]:{rx.port}/hook")
    deliverer = Deliverer(_settings(db_url))
    tried: list[object] = []
    real = socket.socket.connect

    def watch(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[1] == rx.port:  # type: ignore[index]
            tried.append(address)
        real(self, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", watch)
    state, attempts = _settle(db_url, deliverer, hook)
    assert state == "failed" and attempts[0].status_code is None
    assert "IPv4-mapped form of 127.0.0.1" in (attempts[0].error or "")
    assert not tried and not rx.requests


def test_a_delivery_connects_to_the_address_its_check_resolved(
    db_url: str, receivers: list, names: dict[str, list[str]]
) -> None:
    rx = Receiver()
    receivers.append(rx)
    # the first answer is the receiver; any later lookup would get 127.0.0.2, where nothing
    # listens on that port (a rebinding, kept on loopback): only one lookup may happen
    names["rebind.example"] = ["127.0.0.1", "127.0.0.2"]
    hook = _ended_job_told_to(db_url, f"http://rebind.example:{rx.port}/hook?a=1")
    state, attempts = _settle(db_url, Deliverer(_settings(db_url)), hook)
    assert (state, attempts[0].status_code, attempts[0].error) == ("delivered", 200, None)
    assert names["lookups"] == ["rebind.example"]
    [got] = rx.requests
    assert got.headers["Host"] == f"rebind.example:{rx.port}"  # the name, not the address


def test_a_dripping_receiver_is_cut_at_the_deadline(db_url: str, receivers: list) -> None:
    # a byte every 0.2 s for 20 s: each read gets a byte long before a per-read timeout of 1.5 s
    rx = Receiver(drip_s=0.2, drip_bytes=100)
    receivers.append(rx)
    hook = _ended_job_told_to(db_url, rx.url)
    state, attempts = _settle(db_url, Deliverer(_settings(db_url, webhook_timeout_s=1.5)), hook)
    assert state == "failed" and attempts[0].status_code is None
    assert (attempts[0].error or "").startswith("deadline: no complete answer within 1.5 s"), attempts[
        0
    ].error
    # the deliverer hung up: the receiver's writes failed before it had dripped it all
    assert rx.cut_short.wait(15)
    assert not rx.finished.is_set() and rx.sent < rx.drip_bytes


def test_a_huge_answer_is_read_no_further_than_64_kib(db_url: str, receivers: list) -> None:
    rx = Receiver(answer_bytes=50 * 2**20)
    receivers.append(rx)
    hook = _ended_job_told_to(db_url, rx.url)
    deliverer = Deliverer(_settings(db_url))
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        state, attempts = _settle(db_url, deliverer, hook)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the status decides; the body is not needed past the cap
    assert (state, attempts[0].status_code) == ("delivered", 200)
    # what this process allocated meanwhile (the polls' database work included): nothing like
    # the 50 MiB answer
    assert peak - base < 16 * 2**20, f"{(peak - base) / 2**20:.1f} MiB"
    # hung up after the cap: the receiver's writes fail once the sockets' buffers are full
    assert rx.cut_short.wait(15)
    assert not rx.finished.is_set() and rx.sent < 25 * 2**20


def test_the_answer_read_is_capped_at_64_kib(receivers: list) -> None:
    rx = Receiver(answer_bytes=5 * 2**20)
    receivers.append(rx)
    target = check_url(rx.url, allow=EgressAllow.parse(LOOPBACK))
    answer = egress.post(target, body=b"{}", headers={}, timeout_s=10)
    assert answer.status == 200 and answer.read == ANSWER_MAX_BYTES


def test_deliveries_go_through_the_operators_proxy(db_url: str, receivers: list) -> None:
    rx, proxy = Receiver(), ConnectProxy()
    receivers.extend([rx, proxy])
    hook = _ended_job_told_to(db_url, f"http://localhost:{rx.port}/hook")
    settings = _settings(
        db_url, webhook_allow=["localhost"], webhook_proxy=f"http://relay:s3cret@127.0.0.1:{proxy.port}"
    )
    state, attempts = _settle(db_url, Deliverer(settings), hook)
    assert (state, attempts[0].error) == ("delivered", None)
    [head] = proxy.heads
    # the tunnel is asked for by the checked address, never by the name (no second resolution)
    assert head.startswith(f"CONNECT 127.0.0.1:{rx.port} HTTP/1.1\r\n"), head
    assert "Proxy-Authorization: Basic " + base64.b64encode(b"relay:s3cret").decode() in head
    assert rx.requests[0].headers["Host"] == f"localhost:{rx.port}"


def test_a_proxy_setting_that_does_not_parse_stops_every_delivery(
    db_url: str, receivers: list, no_connect: list[object]
) -> None:
    rx = Receiver()
    receivers.append(rx)
    hook = _ended_job_told_to(db_url, rx.url)
    # not sent direct for want of a proxy: the operator asked for one
    deliverer = Deliverer(_settings(db_url, webhook_proxy="socks5://relay:hunter2@127.0.0.1:1080"))
    state, attempts = _settle(db_url, deliverer, hook)
    assert state == "failed" and (attempts[0].error or "").startswith("SHARDYARD_WEBHOOK_PROXY must be")
    assert "hunter2" not in (attempts[0].error or "")
    assert not no_connect and not rx.requests


def test_a_proxy_does_not_lift_the_check_and_its_refusal_fails_the_attempt(
    db_url: str, receivers: list
) -> None:
    rx, proxy, refusing = Receiver(), ConnectProxy(), ConnectProxy(refuse=True)
    receivers.extend([rx, proxy, refusing])
    hook = _ended_job_told_to(db_url, rx.url)
    through = f"http://127.0.0.1:{proxy.port}"
    # the target is not on the allow-list: refused here, so the proxy never hears of it
    state, attempts = _settle(
        db_url, Deliverer(_settings(db_url, webhook_allow=[], webhook_proxy=through)), hook
    )
    assert state == "failed" and "a loopback address" in (attempts[0].error or "")
    assert not proxy.heads and not rx.requests
    # another end of the same user's job, sent through a proxy that refuses every tunnel
    with session_for(db_url) as s:
        owner = dbw.get_webhook(s, webhook_id=hook, user_id=None).user_id
        dbj.fail_job(s, job_id=dbj.create_job(s, name="k", spec={}, steps=1, owner_id=owner).id, reason="y")
    refused = Deliverer(_settings(db_url, webhook_proxy=f"http://127.0.0.1:{refusing.port}"))
    deadline = time.monotonic() + 60
    try:
        while True:
            with session_for(db_url) as s:
                newest, tries = dbw.deliveries(s, webhook_id=hook, limit=1)[0]
            if newest.state != "pending":
                break
            assert time.monotonic() < deadline, "the delivery did not settle"
            refused.poll()
            time.sleep(0.05)
    finally:
        refused.stop()
    assert newest.state == "failed"
    assert tries[0].error == f"the egress proxy refused the tunnel to 127.0.0.1:{rx.port}: answered 403"
    assert not rx.requests


# ---- registration through the API ----


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    upgrade(url)
    opened: list[TestClient] = []

    def make(**over: object) -> TestClient:
        settings = Settings(
            database_url=url,
            data_dir=tmp_path,
            embedded_scheduler=False,
            stall_log_s=0,
            trusted_hosts=["testserver"],
            admin_token=SecretStr("admin-token-for-the-webhook-egress-tests"),
            **over,  # type: ignore[arg-type]
        )
        client = TestClient(create_app(settings)).__enter__()
        opened.append(client)
        client.headers["Authorization"] = "Bearer admin-token-for-the-webhook-egress-tests"
        made = client.post("/api/users", json={"name": f"u{len(opened)}"})
        assert made.status_code == 201, made.text
        client.headers["Authorization"] = f"Bearer {made.json()['token']}"
        return client

    yield make
    for c in opened:
        c.__exit__(None, None, None)


def test_registration_refuses_with_422_naming_url_and_the_rule(api: Callable[..., TestClient]) -> None:
    c = api()
    for url, rule in [
        ("https://hooks.shardyard.invalid/h", "does not resolve"),
        ("http://127.0.0.1:9/h", "a loopback address"),
        ("http://[::ffff:169.254.169.254]/h", "IPv4-mapped form of 169.254.169.254"),
        ("http://0x7f.1/h", "not written as four decimal numbers"),
    ]:
        got = c.post("/api/webhooks", json={"url": url})
        assert got.status_code == 422, got.text
        detail = got.json()["detail"]
        assert detail.startswith("url: ") and rule in detail, detail
    assert c.get("/api/webhooks").json()["items"] == []
    allowed = api(webhook_allow=LOOPBACK)
    assert allowed.post("/api/webhooks", json={"url": "http://127.0.0.1:9/h"}).status_code == 201


def test_a_user_may_have_so_many_webhooks(api: Callable[..., TestClient]) -> None:
    c = api(webhook_max_per_user=3)
    target = "https://93.184.215.14/h"  # an address literal: no lookup, and nothing is sent
    for _ in range(3):
        assert c.post("/api/webhooks", json={"url": target}).status_code == 201
    over = c.post("/api/webhooks", json={"url": target})
    assert over.status_code == 409, over.text
    assert "at most 3 webhooks" in over.json()["detail"] and "delete one" in over.json()["detail"]
    assert len(c.get("/api/webhooks").json()["items"]) == 3
    first = c.get("/api/webhooks").json()["items"][0]["id"]
    assert c.delete(f"/api/webhooks/{first}").status_code == 200
    assert c.post("/api/webhooks", json={"url": target}).status_code == 201
    assert Settings().webhook_max_per_user == 20


def test_https_connects_to_the_checked_address_and_verifies_the_name(
    tmp_path: Path, names: dict[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=hooks.example",
        ]
        + ["-addext", "subjectAltName=DNS:hooks.example", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    seen: list[str | None] = []
    server_ctx.sni_callback = lambda _sock, name, _ctx: seen.append(name)  # type: ignore[assignment,misc,func-returns-value]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                with server_ctx.wrap_socket(raw, server_side=True) as conn:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += conn.recv(4096)
                    seen.append(head.split(b"\r\n")[0].decode())
                    conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")
            except OSError:
                pass  # the client refused our certificate

    threading.Thread(target=serve, daemon=True).start()
    client_ctx = ssl.create_default_context(cafile=str(cert))  # trusts this certificate only
    monkeypatch.setattr(egress, "_tls", lambda: client_ctx)
    allow = EgressAllow.parse(LOOPBACK)
    try:
        names["hooks.example"] = ["127.0.0.1"]
        target = check_url(f"https://hooks.example:{port}/h", allow=allow)
        assert egress.post(target, body=b"{}", headers={}, timeout_s=10).status == 204
        assert seen == ["hooks.example", "POST /h HTTP/1.1"]  # SNI carried the name
        names["other.example"] = ["127.0.0.1"]  # the same address, a name the certificate lacks
        with pytest.raises(ssl.SSLCertVerificationError, match="other.example"):
            egress.post(
                check_url(f"https://other.example:{port}/h", allow=allow), body=b"", headers={}, timeout_s=10
            )
    finally:
        listener.close()
