"""The settings table of docs/settings.md, written from `core.settings.Settings` itself: each field's
environment variable, its default and the docstring written under it.

As an MkDocs hook it fills the table between the `settings:begin` and `settings:end` markers of
settings.md on every build, so the site always lists the settings the code reads. Run as a script
(`.venv/bin/python docs/hooks/settings_reference.py`) it rewrites that table in docs/settings.md
itself, for readers of the repository.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "core" / "settings.py"
PAGE = ROOT / "docs" / "settings.md"
BEGIN = "<!-- settings:begin (written from core/settings.py by docs/hooks/settings_reference.py) -->"
END = "<!-- settings:end -->"
# what the page says of a field whose declaration has no docstring
UNDOCUMENTED = {
    "heartbeat_s": "Seconds between a worker's heartbeats.",
    "frontend_dist": "The built dashboard the API serves at `/` (`make frontend` builds it).",
    "sse_keepalive_s": "Seconds between keep-alive comments on an open stream.",
    "admin_name": "The admin user that `SHARDYARD_ADMIN_TOKEN` signs in as (created if missing).",
    "quota_ranks": "Per-user limit on the ranks of the jobs running at once, for users without their own.",
    "quota_gpus": "Per-user limit on the GPUs of the jobs running at once, for users without their own.",
}


def _docstrings() -> dict[str, str]:
    """Each Settings field's docstring: the string literal right under its annotated assignment."""
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    out: dict[str, str] = {}
    body = cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out[node.target.id] = " ".join(nxt.value.value.split())
            else:
                out[node.target.id] = ""
    return out


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is None:
        return "-"
    text = str(value) if not isinstance(value, (list, dict, bool)) else repr(value).replace("'", '"')
    if isinstance(value, bool):
        text = "true" if value else "false"
    text = text.replace(str(ROOT), "<repo>")
    return f"`{text}`" if text != "" else "empty"


def rows() -> list[tuple[str, str, str]]:
    sys.path.insert(0, str(ROOT))
    from core.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    docs = _docstrings()
    return [
        (f"{prefix}{name}".upper(), _default(field), docs.get(name) or UNDOCUMENTED.get(name, ""))
        for name, field in Settings.model_fields.items()
    ]


def table() -> str:
    lines = ["| variable | default | what |", "|---|---|---|"]
    for env, default, what in rows():
        cell = what.replace("|", "\\|")
        lines.append(f"| `{env}` | {default} | {cell} |")
    return "\n".join(lines)


def fill(markdown: str) -> str:
    start, end = markdown.index(BEGIN), markdown.index(END)
    return markdown[: start + len(BEGIN)] + "\n" + table() + "\n" + markdown[end:]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri == "settings.md":
        return fill(markdown)
    return markdown


if __name__ == "__main__":
    PAGE.write_text(fill(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the settings table of {PAGE.relative_to(ROOT)}")
