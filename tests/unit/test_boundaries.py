"""The import rules of docs/architecture.md ("Who may import whom"), checked on the source:
trainer/ is pure PyTorch (it meets pydantic only through jobrules/), db/ is SQLAlchemy only, api/
never imports torch or the trainer, workers/ never imports api/ (they share core/), jobrules/ is the
standard library and pydantic, shardyard/ (the Python SDK) is a client of the REST API only, and a
route module never imports another route module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICE = {
    "api",
    "db",
    "workers",
    "celery",
    "sqlalchemy",
    "fastapi",
    "redis",
    "starlette",
    "pydantic",
    "alembic",
    "httpx",
    "kombu",
}

RULES = {
    "trainer": SERVICE,
    "db": {"api", "workers", "trainer", "torch", "fastapi", "celery", "redis"},
    "api": {"torch", "trainer", "workers"},
    # the glue runs the trainer as a subprocess and shares only core/ with the API
    "workers": {"api", "trainer", "fastapi", "starlette", "uvicorn"},
    # the neutral room both api/ and workers/ import
    "core": {"api", "workers", "trainer", "torch", "fastapi", "starlette"},
    # shared by api/ and trainer/: the standard library, and pydantic for the request models
    # (jobrules/spec.py), which both validate with
    "jobrules": (SERVICE - {"pydantic"}) | {"torch", "numpy", "trainer", "core", "pydantic_settings"},
    # the Python SDK and its user CLI (shardyard/cli.py): a client of the REST API, so httpx and the
    # standard library; it may read jobrules/ and core/ shapes, never the service's internals
    "shardyard": (SERVICE - {"httpx", "pydantic"}) | {"torch", "numpy", "trainer", "uvicorn", "sqlalchemy"},
}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_respects_its_import_boundary(package: str) -> None:
    offenders = {}
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources found under {package}/"
    for path in files:
        bad = imported_roots(path) & RULES[package]
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, f"{package}/ crosses its boundary: {offenders}"


def test_the_sdk_imports_without_torch_or_the_service() -> None:
    """`from shardyard.client import Client` in a fresh interpreter pulls in no torch and no
    service room (the import rules above see the source; this sees what Python really loads)."""
    code = (
        "import sys; from shardyard.client import Client; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'numpy', 'api', 'db', 'workers', 'trainer', 'fastapi', 'sqlalchemy', 'celery'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("import os\nfrom sqlalchemy.orm import Session\nimport torch.nn as nn\n")
    assert imported_roots(bad) == {"os", "sqlalchemy", "torch"}


def route_imports(path: Path) -> set[str]:
    """The api.routes modules `path` imports (`from api.routes import x` names x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("api.routes."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "api.routes":
                found.update(f"api.routes.{a.name}" for a in node.names)
            elif node.module.startswith("api.routes."):
                found.add(node.module)
    return found


def test_routes_import_services_never_other_routes() -> None:
    # what two routes share is a service of api/ (e.g. api/workspaces.py's pin_workspace)
    routes = sorted(p for p in (ROOT / "api" / "routes").glob("*.py") if p.name != "__init__.py")
    assert len(routes) > 3, "no route modules found under api/routes/"
    offenders = {p.name: sorted(route_imports(p)) for p in routes if route_imports(p)}
    assert not offenders, f"route modules import other route modules: {offenders}"


def test_the_route_checker_sees_a_route_import(tmp_path: Path) -> None:
    bad = tmp_path / "jobs.py"
    bad.write_text("from api.routes.workspaces import pin_workspace\nfrom api.routes import users\n")
    assert route_imports(bad) == {"api.routes.workspaces", "api.routes.users"}
