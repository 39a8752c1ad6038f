"""The page at ``/``: try voices in a browser, served by the server itself from ``static/`` (no build step, no CDN).

``/`` is ``static/index.html``; ``/static/*`` its script and style; ``/page/config.json`` what the page needs to
know before it can call the API (whether a key is needed, the model names, the input limit). The page talks
to the API from the same origin, with the key as ``Authorization: Bearer`` when the user gives one.
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
