"""The page at ``/``: try voices in a browser, served from ``static/`` (no build step, no CDN).

``/static/*`` holds its script and style, and ``/page/config.json`` what it must know before calling the API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"


def install(app: FastAPI, config: Any) -> None:
    """Add the page's routes to ``app`` (``config``: the server's ``ServerConfig``)."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/page/config.json", include_in_schema=False)
    async def page_config() -> JSONResponse:
        return JSONResponse({"key_required": config.api_key is not None, "models": list(config.model_names),
                             "max_input_chars": config.max_input_chars})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
