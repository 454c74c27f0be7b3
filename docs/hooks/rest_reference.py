"""MkDocs hook: the REST reference page, written from the API's OpenAPI schema.

`make docs` first writes the schema with `python -m api.openapi_dump build/openapi.json` (the same
schema the API serves at /openapi.json). This hook reads that file (or runs the same command itself
when the file is missing), renders one Markdown page from it, `rest-api.md`, and puts the schema
beside the pages as `openapi.json`. Nothing is fetched from the network: the page is plain Markdown
rendered by the site's theme.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = Path(os.environ.get("SHARDYARD_OPENAPI_JSON", ROOT / "build" / "openapi.json"))
METHODS = ("get", "post", "put", "patch", "delete")


def _load_schema() -> dict[str, Any]:
    if SCHEMA_PATH.is_file():
        return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "openapi.json"
        subprocess.run([sys.executable, "-m", "api.openapi_dump", str(out)], cwd=ROOT, check=True)
        return json.loads(out.read_text(encoding="utf-8"))


def _anchor(name: str) -> str:
    return "schema-" + "".join(c if c.isalnum() else "-" for c in name).lower()


def _cell(text: Any) -> str:
    """Text fit for one Markdown table cell."""
    s = "" if text is None else str(text)
    return s.replace("|", "\\|").replace("\r", "").replace("\n\n", "<br><br>").replace("\n", " ").strip()


def _type(s: dict[str, Any] | bool | None) -> str:
    """A schema as a short type expression; references link to their schema below."""
    if not isinstance(s, dict):
        return "any"
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for key, sep in (("anyOf", " or "), ("oneOf", " or "), ("allOf", " and ")):
        if key in s:
            parts = []
            for sub in s[key]:
                t = _type(sub)
                if t not in parts:
                    parts.append(t)
            return sep.join(parts)
    if "const" in s:
        return f"`{json.dumps(s['const'])}`"
    if "enum" in s:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in s["enum"])
    t = s.get("type")
    if isinstance(t, list):
        return " or ".join(t)
    if t == "array":
        return f"array of {_type(s.get('items'))}"
    if t == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"object of {_type(s['additionalProperties'])}"
    if t is None:
        return "any"
    fmt = s.get("format")
    return f"{t} ({fmt})" if fmt else str(t)


def _limits(s: dict[str, Any]) -> str:
    words = []
    for key, word in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
        ("maxLength", "length <="),
        ("minItems", "items >="),
        ("maxItems", "items <="),
        ("pattern", "matches"),
    ):
        if key in s:
            v = s[key]
            words.append(f"{word} `{v}`")
    if "default" in s:
        words.append(f"default `{json.dumps(s['default'])}`")
    return ", ".join(words)


def _operation(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"### {method.upper()} `{path}`", ""]
    if op.get("summary"):
        out += [f"**{op['summary']}**", ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    params = op.get("parameters") or []
    if params:
        out += ["| parameter | in | type | required | what |", "|---|---|---|---|---|"]
        for p in params:
            sch = p.get("schema") or {}
            what = " ".join(x for x in (p.get("description") or sch.get("description"), _limits(sch)) if x)
            out.append(
                f"| `{p['name']}` | {p.get('in', '')} | {_cell(_type(sch))} | "
                f"{'yes' if p.get('required') else 'no'} | {_cell(what)} |"
            )
        out.append("")
    body = op.get("requestBody")
    if body:
        kinds = ", ".join(
            f"`{ct}`: {_type(c.get('schema'))}" for ct, c in (body.get("content") or {}).items()
        )
        out += [f"Body ({'required' if body.get('required') else 'optional'}): {kinds}", ""]
    responses = op.get("responses") or {}
    if responses:
        out += ["| answer | what | body |", "|---|---|---|"]
        for code, r in responses.items():
            bodies = "<br>".join(
                f"`{ct}`: {_type(c.get('schema'))}" for ct, c in (r.get("content") or {}).items()
            )
            out.append(f"| {code} | {_cell(r.get('description'))} | {_cell(bodies)} |")
        out.append("")
    return out


def _schema(name: str, s: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{#{_anchor(name)}}}", ""]
    if s.get("description"):
        out += [s["description"].strip(), ""]
    props = s.get("properties") or {}
    required = set(s.get("required") or [])
    if props:
        out += ["| field | type | required | what |", "|---|---|---|---|"]
        for field, ps in props.items():
            what = " ".join(x for x in (ps.get("description"), _limits(ps)) if x)
            out.append(
                f"| `{field}` | {_cell(_type(ps))} | {'yes' if field in required else 'no'} | {_cell(what)} |"
            )
        out.append("")
    elif not props and s.get("type") != "object":
        out += [f"Type: {_type(s)}", ""]
    return out


def render(schema: dict[str, Any]) -> str:
    info = schema.get("info", {})
    out = [
        "# REST API reference",
        "",
        f"Generated from the API's OpenAPI schema ({info.get('title', 'Shardyard')} "
        f"{info.get('version', '')}, OpenAPI {schema.get('openapi', '')}) each time the site is "
        "built. The same schema is served by a running API at `/openapi.json`, and this site "
        "carries a copy: [openapi.json](openapi.json). The [REST guide](rest.md) explains "
        "authentication, errors, streams and limits in prose.",
        "",
    ]
    groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in schema.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                op = item[method]
                tag = (op.get("tags") or ["other"])[0]
                groups.setdefault(tag, []).append((path, method, op))
    for tag, ops in groups.items():
        out += [f"## {tag.capitalize()}", ""]
        for path, method, op in ops:
            out += _operation(path, method, op)
    comps = schema.get("components", {}).get("schemas", {})
    if comps:
        out += ["## Schemas", ""]
        for name in sorted(comps):
            out += _schema(name, comps[name])
    return "\n".join(out) + "\n"


def on_files(files: Files, config: Any) -> Files:
    schema = _load_schema()
    files.append(File.generated(config, "rest-api.md", content=render(schema)))
    files.append(File.generated(config, "openapi.json", content=json.dumps(schema, indent=2) + "\n"))
    return files
