"""Outbound HTTP to addresses users choose (webhooks), closed by default.

A URL is checked once and the check's result is what gets connected to: `check_url` resolves the
host a single time, refuses the URL unless every address it resolves to is public (or on the
operator's allow-list), and returns a `Target` carrying those addresses; `post` connects to one of
them and never resolves the name again, so a name that answers a public address to the check and
a private one to the connect (DNS rebinding) reaches nothing. The name still goes out as the Host
header and as the TLS server name, so virtual hosts and certificate checks work as usual.

"Public" is decided on the address itself and on any IPv4 address embedded in an IPv6 one
(IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo): `::ffff:127.0.0.1` and `64:ff9b::a9fe:a9fe`
are loopback and the cloud metadata service by other names. IPv4 written other than as four
decimal numbers (`2130706433`, `0177.0.0.1`, `0x7f.1`) is refused outright: resolvers, proxies and
receivers read such spellings differently, and nobody needs them.

`post` bounds one exchange as a whole: connecting (through an HTTP CONNECT proxy when the
operator sets one), sending and reading the answer's head share one deadline, so a receiver that
drips a byte a second is cut at it rather than holding a thread for as long as it keeps dripping;
and it reads at most ANSWER_MAX_BYTES of the answer, whatever the receiver sends.

No import of the settings here: core/settings.py uses `EgressAllow.parse` and `Proxy.parse` to
refuse a bad allow-list or proxy when the process starts.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import re
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ANSWER_MAX_BYTES = 64 * 1024
"""The most of an answer (status line, headers and body together) one delivery reads."""
ALLOW_SETTING = "SHARDYARD_WEBHOOK_ALLOW"

_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
"""The well-known NAT64 prefix (RFC 6052): the last 32 bits are the IPv4 address reached."""
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-9][0-9][0-9])(?: |\r|$)")
_INTERIM = (100, 102, 103)
"""1xx answers a server may send before its final one (101 is not asked for, so it is final)."""
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"


class UnsafeUrl(ValueError):
    """A URL the service will not send to; the message names the rule."""


class DeliveryFailed(Exception):
    """An exchange that ended without a final status: the message says why (the deadline, a
    receiver that closed early, an answer that is not HTTP, a proxy that refused the tunnel)."""


@dataclass(frozen=True, slots=True)
class EgressAllow:
    """The operator's exceptions to "public addresses only": networks, and host names whose
    addresses are all trusted."""

    networks: tuple[Network, ...] = ()
    hosts: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> EgressAllow:
        """CIDR networks ("10.0.0.0/8", "127.0.0.1/32", "fd00::/8"; a bare address is a /32 or
        /128) and host names; anything else is a ValueError naming the entry."""
        networks: list[Network] = []
        hosts: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = entry.lower().rstrip(".")
            if not _HOST_NAME.fullmatch(name) or _odd_ipv4(name):
                raise ValueError(f"{ALLOW_SETTING}: {raw!r} is neither a network (CIDR) nor a host name")
            hosts.add(name)
        return cls(networks=tuple(networks), hosts=frozenset(hosts))

    def admits(self, addr: IPAddress) -> bool:
        # exactly as written: an allowed 127.0.0.1/32 does not admit ::ffff:127.0.0.1
        return any(addr in net for net in self.networks)


@functools.lru_cache(maxsize=8)
def egress_allow(entries: tuple[str, ...]) -> EgressAllow:
    """`EgressAllow.parse`, remembered for the API's per-request checks."""
    return EgressAllow.parse(entries)


@dataclass(frozen=True, slots=True)
class Proxy:
    """An HTTP CONNECT proxy every exchange tunnels through (the operator's: never checked)."""

    host: str
    port: int
    authorization: str | None = None

    @classmethod
    def parse(cls, url: str) -> Proxy | None:
        """`http://[user:password@]host[:port]`; empty: None (connect directly)."""
        if not url:
            return None
        # the message never repeats the URL: it may carry a password
        problem = "SHARDYARD_WEBHOOK_PROXY must be http://[user:password@]host[:port] (an HTTP CONNECT proxy)"
        try:
            parts = urlsplit(url)
            port = parts.port or 80
        except ValueError as e:
            raise ValueError(problem) from e
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(problem)
        auth = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = "Basic " + base64.b64encode(pair.encode()).decode()
        return cls(host=parts.hostname, port=port, authorization=auth)


@dataclass(frozen=True, slots=True)
class Target:
    """A checked URL: where to connect (only these addresses) and what to ask for."""

    scheme: str
    host: str
    """The name as the URL gives it (lower case, IDNA, no trailing dot), or the address literal:
    the Host header and the TLS server name."""
    port: int
    path: str
    """Path and query as sent on the request line (percent-encoded)."""
    addresses: tuple[IPAddress, ...]
    """What the host resolved to, once, each address checked."""

    @property
    def host_header(self) -> str:
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == (443 if self.scheme == "https" else 80) else f"{name}:{self.port}"


def _odd_ipv4(host: str) -> bool:
    """True for a host the C library reads as an IPv4 address although it is not four decimal
    numbers: one integer, fewer parts, octal or hex parts, leading zeros."""
    try:
        socket.inet_aton(host)
    except (OSError, UnicodeError, ValueError):
        return False
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return True
    return False


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 one stands for, and the form's name."""
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped, "IPv4-mapped"
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF), "NAT64"
    if addr.sixtofour is not None:
        return addr.sixtofour, "6to4"
    if addr.teredo is not None:
        return addr.teredo[1], "Teredo"
    if 1 < int(addr) < 2**32:  # ::a.b.c.d; :: and ::1 are the unspecified and loopback addresses
        return ipaddress.IPv4Address(int(addr)), "IPv4-compatible"
    return None


_KINDS = (
    ("is_unspecified", "an unspecified"),
    ("is_loopback", "a loopback"),
    ("is_link_local", "a link-local"),
    ("is_multicast", "a multicast"),
    ("is_private", "a private"),
    ("is_reserved", "a reserved"),
    ("is_site_local", "a site-local"),
)


def why_refused(addr: IPAddress) -> str | None:
    """Why a public deliverer must not connect to `addr`, in a few words; None: it may."""
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(addr)
        if embedded is not None:
            inner, form = embedded
            why = why_refused(inner)
            if why is not None:
                return f"the {form} form of {inner}, {why}"
            if form == "IPv4-compatible":  # deprecated since 2006 (RFC 4291): no receiver uses it
                return "an IPv4-compatible address"
            if form == "Teredo":  # a tunnel through a relay the operator does not control
                return "a Teredo address"
            # a public IPv4 address behind a translator or relay (NAT64 through DNS64 on an
            # IPv6-only network); the prefixes themselves count as reserved to `ipaddress`
            return None
    for attribute, kind in _KINDS:
        if getattr(addr, attribute, False):
            return f"{kind} address"
    if not addr.is_global:  # 100.64.0.0/10 (carrier-grade NAT) and the like
        return "not a globally routable address"
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve(host: str) -> tuple[IPAddress, ...]:
    """Every address `host` resolves to, in the resolver's order; a name that does not resolve
    is refused now, not found out at each delivery."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as e:
        raise UnsafeUrl(f"the host {host} does not resolve ({e})") from e
    found: list[IPAddress] = []
    for family, _type, _proto, _name, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if addr not in found:
            found.append(addr)
    if not found:
        raise UnsafeUrl(f"the host {host} does not resolve to an IP address")
    return tuple(found)


def check_url(url: str, *, allow: EgressAllow) -> Target:
    """The Target of `url`, or UnsafeUrl naming the rule it breaks: http(s) with a host and no
    credentials; a host that resolves, and only to public addresses or ones `allow` admits."""
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in url):
        raise UnsafeUrl("the URL must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError as e:  # an unclosed [ of an IPv6 literal, a port that is not a number
        raise UnsafeUrl(f"the URL cannot be parsed: {e}") from e
    if parts.scheme not in ("http", "https"):
        raise UnsafeUrl(f"the URL's scheme must be http or https, not {parts.scheme!r}")
    if parts.username or parts.password:
        raise UnsafeUrl("the URL must not carry a user name or password")
    name = (host or "").rstrip(".")
    if not name:
        raise UnsafeUrl("the URL has no host")
    if port == 0:
        raise UnsafeUrl("the URL's port must be from 1 to 65535")
    if "%" in name:
        raise UnsafeUrl("the host must not carry an IPv6 zone (%)")
    literal = _literal(name)
    if literal is None:
        if _odd_ipv4(name):
            raise UnsafeUrl(
                f"the host {host} is an IPv4 address not written as four decimal numbers "
                "(such as 2130706433, 0177.0.0.1 or 0x7f.1); write it as a.b.c.d"
            )
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError as e:
            raise UnsafeUrl(f"the host {host!r} is not a valid host name") from e
        if not _HOST_NAME.fullmatch(name):
            raise UnsafeUrl(f"the host {host!r} is not a valid host name")
        addresses = _resolve(name)
    else:
        name = str(literal)
        addresses = (literal,)
    if name not in allow.hosts:
        for addr in addresses:
            why = None if allow.admits(addr) else why_refused(addr)
            if why is None:
                continue
            # "non-public address": the words the dashboard and the API's users see
            said = (
                f"the host {host} is a non-public address, {why}"
                if literal is not None
                else f"the host {host} resolves to a non-public address: {addr} is {why}"
            )
            raise UnsafeUrl(f"{said}; an operator may allow it with {ALLOW_SETTING}")
    path = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        path += "?" + quote(parts.query, safe=_PATH_SAFE + "?")
    return Target(
        scheme=parts.scheme,
        host=name,
        port=port or (443 if parts.scheme == "https" else 80),
        path=path,
        addresses=addresses,
    )


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    read: int
    """Bytes of the answer read (at most ANSWER_MAX_BYTES)."""


class _Deadline:
    """One deadline for a whole exchange; every socket operation gets what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def passed(self) -> DeliveryFailed:
        return DeliveryFailed(
            f"deadline: no complete answer within {self.seconds:g} s (connect, send and read together)"
        )

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.passed()
        return left

    def arm(self, sock: socket.socket) -> None:
        sock.settimeout(self.left())


class _Reader:
    """Reads an answer's heads off a socket, never more than `limit` bytes in all."""

    def __init__(self, sock: socket.socket, *, deadline: _Deadline, limit: int) -> None:
        self.sock = sock
        self.deadline = deadline
        self.limit = limit
        self.buf = bytearray()
        self.read = 0

    def _more(self) -> bool:
        """False at the end of the stream or of the allowance."""
        room = self.limit - self.read
        if room <= 0:
            return False
        self.deadline.arm(self.sock)
        chunk = self.sock.recv(min(room, 16384))
        self.read += len(chunk)
        self.buf += chunk
        return bool(chunk)

    def head(self) -> tuple[int, bytes]:
        """The next status code and its header block."""
        start = 0
        while (end := self.buf.find(b"\r\n\r\n", start)) < 0:
            start = max(0, len(self.buf) - 3)
            if self.read >= self.limit:
                raise DeliveryFailed(f"the answer's headers run past {self.limit} bytes")
            if not self._more():
                if self.read >= self.limit:
                    raise DeliveryFailed(f"the answer's headers run past {self.limit} bytes")
                raise DeliveryFailed("the connection closed before the answer's headers ended")
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        first = head.split(b"\r\n", 1)[0]
        m = _STATUS_LINE.match(first)
        if m is None:
            raise DeliveryFailed(f"the answer is not HTTP/1.x: {first[:60]!r}")
        return int(m.group(1)), head

    def drain(self, length: int) -> None:
        """Read and drop the body, up to `length` bytes and within the allowance."""
        got = len(self.buf)
        self.buf.clear()
        while got < length and self._more():
            got += len(self.buf)
            self.buf.clear()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            try:
                return max(0, int(value.strip()))
            except ValueError:
                return 0
    return 0


def _send(sock: socket.socket, data: bytes, deadline: _Deadline) -> None:
    view = memoryview(data)
    while view:
        deadline.arm(sock)
        view = view[sock.send(view) :]


def _authority(addr: IPAddress, port: int) -> str:
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"


def _tunnel(sock: socket.socket, addr: IPAddress, *, port: int, proxy: Proxy, deadline: _Deadline) -> None:
    """Ask the proxy for a tunnel to the checked address (never the name: the proxy resolving it
    again would undo the check)."""
    authority = _authority(addr, port)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if proxy.authorization:
        lines.append(f"Proxy-Authorization: {proxy.authorization}")
    _send(sock, ("\r\n".join(lines) + "\r\n\r\n").encode(), deadline)
    reader = _Reader(sock, deadline=deadline, limit=ANSWER_MAX_BYTES)
    status, _ = reader.head()
    if not 200 <= status < 300:
        raise DeliveryFailed(f"the egress proxy refused the tunnel to {authority}: answered {status}")
    if reader.buf:
        raise DeliveryFailed("the egress proxy sent bytes past its answer to CONNECT")


def _connect(target: Target, *, proxy: Proxy | None, deadline: _Deadline) -> socket.socket:
    """A socket to one of the target's checked addresses (through a tunnel of the proxy when one
    is set), trying them in order while the deadline lasts."""
    last: OSError | None = None
    for addr in target.addresses:
        sock: socket.socket | None = None
        try:
            if proxy is None:
                sock = socket.socket(
                    socket.AF_INET if addr.version == 4 else socket.AF_INET6, socket.SOCK_STREAM
                )
                deadline.arm(sock)
                sock.connect((str(addr), target.port))
            else:
                sock = socket.create_connection((proxy.host, proxy.port), timeout=deadline.left())
                _tunnel(sock, addr, port=target.port, proxy=proxy, deadline=deadline)
            return sock
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise
        except OSError as e:  # refused, unreachable: the next address may answer
            if sock is not None:
                sock.close()
            last = e
        except BaseException:
            if sock is not None:
                sock.close()
            raise
    assert last is not None
    raise last


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def post(
    target: Target,
    *,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    proxy: Proxy | None = None,
) -> Answer:
    """POST `body` to a checked target within `timeout_s` all told, reading at most
    ANSWER_MAX_BYTES of the answer; the status decides, the rest of the body is only read (up to
    that cap) so the receiver's write completes. Raises DeliveryFailed or OSError."""
    deadline = _Deadline(timeout_s)
    sock: socket.socket | None = None
    try:
        sock = _connect(target, proxy=proxy, deadline=deadline)
        if target.scheme == "https":
            deadline.arm(sock)  # the handshake as a whole gets what is left
            # the name, not the address: SNI and the certificate's check are for the name
            sock = _tls().wrap_socket(sock, server_hostname=target.host)
        lines = [
            f"POST {target.path} HTTP/1.1",
            f"Host: {target.host_header}",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        _send(sock, ("\r\n".join(lines) + "\r\n\r\n").encode() + body, deadline)
        reader = _Reader(sock, deadline=deadline, limit=ANSWER_MAX_BYTES)
        status, head = reader.head()
        while status in _INTERIM:
            status, head = reader.head()
        try:
            reader.drain(_content_length(head))
        except (OSError, DeliveryFailed):
            pass  # the status already decided the attempt
        return Answer(status=status, read=reader.read)
    except TimeoutError as e:
        raise deadline.passed() from e
    finally:
        if sock is not None:
            sock.close()
