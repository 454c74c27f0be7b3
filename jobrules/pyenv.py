"""The rules for a job's own Python requirements (`env.pip` in the JobSpec, or the lines of a
workspace's requirements.txt), shared by the API (422 at submit and at a workspace's upload) and the
worker (refused before any install). The standard library, and `packaging` (the PEP 508 grammar pip
itself parses requirements with; a dependency of the pinned optuna, so every process has it).

A requirement is a PEP 508 name with optional extras, version specifiers and an environment marker:
`einops==0.8.2`, `timm[hub]>=1.0; python_version >= "3.10"`. Anything else is refused unless an
admin allows it (`pyenv_allow_options`): pip options (`--index-url`, `--extra-index-url`, `-e`,
`-r`, ...) because they would point a shared worker at an index or file nobody vetted, and direct
references (URLs, `name @ url`, local paths and archives) because their content is not named by
the requirement's text, so the environment's hash would not name what it holds.

Every named requirement is parsed whole by that grammar, its environment marker included: a marker
is only ever a comparison of the environment's variables with quoted strings (`python_version >=
"3.10"`), so `einops; __import__('os').system('id')` is refused at submit, naming the line, rather
than handed to an installer.

A requirement that would replace a package the worker runs (another torch, numpy 2 where the
worker has 1.26) is refused here when its specifiers alone exclude the installed version; the
worker's resolver refuses the rest (a dependency that needs another torch) at install.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as Pep508

MAX_LINES = 200
MAX_LINE_CHARS = 400

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_VERSION_OP = r"(?:===|==|!=|<=|>=|~=|<|>)"
_SPEC = rf"{_VERSION_OP}\s*[A-Za-z0-9.*+!_-]+"
_REQUIREMENT = re.compile(
    rf"^(?P<name>{_NAME})\s*"
    rf"(?:\[(?P<extras>\s*{_NAME}(?:\s*,\s*{_NAME})*\s*)\])?\s*"
    rf"(?P<specs>\(?\s*{_SPEC}(?:\s*,\s*{_SPEC})*\s*\)?)?\s*"
    r"(?:;(?P<marker>.*))?$"
)
_ONE_SPEC = re.compile(rf"({_VERSION_OP})\s*([A-Za-z0-9.*+!_-]+)")
_ARCHIVE = (".whl", ".tar.gz", ".tgz", ".zip", ".tar.bz2", ".tar")
REQUIREMENTS_FILE = "requirements.txt"
"""A workspace's own requirements, at the root of its archive (the worker reads the same name)."""
MARKER_RULE = (
    "a marker compares environment variables (python_version, sys_platform, platform_machine, "
    "implementation_name, ...) with quoted strings, e.g. '; python_version >= \"3.10\"'"
)


@dataclass(frozen=True, slots=True)
class Requirement:
    """One accepted line: its normalised text (what is hashed and installed) and its parts."""

    text: str
    name: str
    """PEP 503 normalised (lower case, runs of -_. as one -)."""
    specs: tuple[tuple[str, str], ...]
    """(operator, version) pairs, e.g. (("==", "0.8.2"),)."""
    option: bool = False
    """A pip option or direct reference an admin allowed (passed to the installer as written)."""


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def strip_comment(line: str) -> str:
    """requirements.txt comments: `#` at the start or after whitespace (a URL fragment keeps its #)."""
    if line.lstrip().startswith("#"):
        return ""
    return re.split(r"\s+#", line, maxsplit=1)[0].strip()


def requirement_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line of a requirements.txt, comments removed and
    backslash continuations joined (numbered by their first line)."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for n, raw in enumerate(text.splitlines(), start=1):
        if not pending:
            start = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = strip_comment(pending + raw)
        pending = ""
        if line:
            out.append((start, line))
    if pending and (line := strip_comment(pending)):
        out.append((start, line))
    return out


def parse_requirement(line: str, *, allow_options: bool = False) -> Requirement | str:
    """The accepted requirement, or the reason the line is refused."""
    line = line.strip()
    if len(line) > MAX_LINE_CHARS:
        return f"is longer than {MAX_LINE_CHARS} characters"
    if line.startswith("-"):
        if allow_options:
            return Requirement(text=line, name="", specs=(), option=True)
        opt = line.split()[0].split("=")[0]
        return (
            f"is a pip option ({opt}); options (indexes, editable installs, other files) are refused "
            "unless an admin allows them (SHARDYARD_PYENV_ALLOW_OPTIONS)"
        )
    direct = (
        "://" in line
        or re.match(rf"^{_NAME}\s*(\[[^\]]*\])?\s*@", line) is not None
        or line.startswith((".", "/", "~"))
        or "\\" in line
        or line.split(";")[0].strip().lower().endswith(_ARCHIVE)
    )
    if direct:
        if allow_options:
            named = re.match(rf"^{_NAME}\s*(\[[^\]]*\])?\s*@", line) is not None
            if named and (why := _pep508_problem(line, has_marker=";" in line)) is not None:
                return why  # `name @ url; marker`: the installer parses its marker too
            return Requirement(text=line, name="", specs=(), option=True)
        return (
            "is a URL or a local path; only named requirements (name, extras, versions) are "
            "accepted unless an admin allows direct references (SHARDYARD_PYENV_ALLOW_OPTIONS)"
        )
    m = _REQUIREMENT.match(line)
    if m is None:
        return "is not a requirement (expected e.g. 'einops==0.8.2' or 'timm>=1.0')"
    specs = tuple((op, v) for op, v in _ONE_SPEC.findall(m.group("specs") or ""))
    name = normalize_name(m.group("name"))
    extras = m.group("extras")
    text = name
    if extras:
        text += "[" + ",".join(sorted(normalize_name(e) for e in extras.split(","))) + "]"
    text += ",".join(f"{op}{v}" for op, v in specs)
    if m.group("marker") is not None:
        marker = " ".join(m.group("marker").split())
        if not marker:
            return "has an empty environment marker after ';'"
        text += f"; {marker}"
    if (why := _pep508_problem(line, has_marker=m.group("marker") is not None)) is not None:
        return why
    return Requirement(text=text, name=name, specs=specs)


def _pep508_problem(line: str, *, has_marker: bool) -> str | None:
    """Why the PEP 508 grammar refuses `line` (the pattern above only splits a line into its parts;
    a marker's text is anything after ';' to it), or None."""
    try:
        Pep508(line)
    except InvalidRequirement as e:
        # packaging's message is the reason, then the line with a caret under the spot: keep the reason
        reason = str(e).splitlines()[0] if str(e) else "unparsable"
        if has_marker:
            return f"has an environment marker that is not PEP 508 ({reason}); {MARKER_RULE}"
        return f"is not a PEP 508 requirement ({reason})"
    return None


@functools.cache
def installed_versions() -> dict[str, str]:
    """This interpreter's installed distributions (normalised name -> version): what a job's
    environment is layered over and may not replace. The API and the workers run one image, so
    the API's answer at submit is the workers'; the worker checks again against its own."""
    out: dict[str, str] = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name:
            out.setdefault(normalize_name(name), d.version)
    return out


def _release(v: str) -> tuple[int, ...] | None:
    """The numeric release of a version (`2.13.0+cpu` -> (2, 13, 0)); None for a pre-release,
    an epoch or anything this simple reading cannot order (the resolver then decides)."""
    v = v.split("+", 1)[0].lower().removeprefix("v")
    m = re.fullmatch(r"(\d+(?:\.\d+)*)(?:\.?post\d+)?", v)
    return None if m is None else tuple(int(p) for p in m.group(1).split("."))


def _pad(a: tuple[int, ...], n: int) -> tuple[int, ...]:
    return a + (0,) * (n - len(a))


def admits(op: str, want: str, installed: str) -> bool | None:
    """Whether `installed` satisfies `op want`; None when this reading cannot tell."""
    got = _release(installed)
    if op in ("==", "!=") and want.endswith(".*"):
        pre = _release(want[:-2])
        if got is None or pre is None:
            return None
        return (_pad(got, len(pre))[: len(pre)] == pre) == (op == "==")
    ref = _release(want)
    if got is None or ref is None:
        return None
    n = max(len(got), len(ref))
    a, b = _pad(got, n), _pad(ref, n)
    if op == "===":
        return installed.lower() == want.lower()
    if op == "==":
        # a local label (+cpu) is ignored when the specifier has none (PEP 440)
        return a == b if "+" not in want else installed.lower() == want.lower()
    if op == "~=":
        return a >= b and got[: len(ref) - 1] == ref[:-1]
    return {"!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}.get(op)


def replaces_installed(req: Requirement, installed: dict[str, str]) -> str | None:
    """Why `req` would replace a package the worker runs (`installed`: normalised name ->
    version), or None. Only specifiers that plainly exclude the installed version count."""
    have = installed.get(req.name)
    if have is None:
        return None
    for op, want in req.specs:
        if admits(op, want, have) is False:
            return (
                f"asks for {req.name}{op}{want} but the workers run {req.name} {have}; the trainer's own "
                "packages cannot be replaced (drop the pin, or pin the version the workers run)"
            )
    return None


def requirement_problems(
    lines: list[tuple[str, str]], *, installed: dict[str, str] | None = None, allow_options: bool = False
) -> list[str]:
    """Every refused line as '<where>: <line> <reason>' (`lines`: (where, text) pairs, e.g.
    ('env.pip[0]', 'einops') or ('requirements.txt line 3', ...)); [] when all are accepted."""
    problems = []
    if len(lines) > MAX_LINES:
        problems.append(f"{len(lines)} requirements, more than the {MAX_LINES} allowed")
    for where, text in lines:
        got = parse_requirement(text, allow_options=allow_options)
        if isinstance(got, str):
            problems.append(f"{where} ({text.strip()[:80]!r}) {got}")
        elif installed and (why := replaces_installed(got, installed)):
            problems.append(f"{where} ({text.strip()[:80]!r}) {why}")
    return problems


def accepted(lines: list[tuple[str, str]], *, allow_options: bool = False) -> list[Requirement]:
    """The parsed requirements of lines that requirement_problems accepted, in order, duplicates
    (same normalised text) once."""
    out: dict[str, Requirement] = {}
    for _, text in lines:
        got = parse_requirement(text, allow_options=allow_options)
        if isinstance(got, Requirement):
            out.setdefault(got.text, got)
    return list(out.values())


def requirements_digest(reqs: list[Requirement], *, platform: str) -> str:
    """The environment's name: the sha256 of its sorted requirements and of the platform it is
    built for (interpreter, machine, and the worker's own package versions it is layered over).
    Order and spelling of equivalent lines do not change it."""
    h = hashlib.sha256()
    for r in sorted(r.text for r in reqs):
        h.update(r.encode() + b"\n")
    h.update(b"--platform " + platform.encode())
    return h.hexdigest()
