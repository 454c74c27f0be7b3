"""/docs (Swagger UI) and /redoc (ReDoc) from this server's own files. FastAPI's default pages load
their scripts, styles and favicon from public CDNs, so on a machine without internet access (a
cluster's control node, a laptop on a train) /docs was a blank page. The assets come from the
`fastapi-offline` wheel (PyPI: Swagger UI 5, which renders OpenAPI 3.1, and ReDoc's standalone
bundle), served under ASSETS."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"
"""Where the pages' scripts, styles and favicon are served (same origin as the pages)."""
ASSET_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"


def add_docs_pages(app: FastAPI, *, title: str) -> None:
    """GET /docs, /redoc and ASSETS on `app` (created with docs_url=None, redoc_url=None)."""
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title} - Swagger UI",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
            # no badge fetched from the public validator service
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{title} - ReDoc",
            redoc_js_url=f"{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS}/favicon.png",
            with_google_fonts=False,
        )

    app.mount(ASSETS, StaticFiles(directory=ASSET_DIR), name="docs-assets")
