"""Swagger UI (/docs) and ReDoc (/redoc), their JavaScript, CSS and favicon served by the service itself.

FastAPI's own pages load them from a public CDN, which leaves the page blank on a network without internet
access. The files come from the fastapi-offline package, which ships the swagger-ui and redoc bundles.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_PATH = "/docs/assets"

router = APIRouter(include_in_schema=False)


def docs_assets() -> StaticFiles:
    """The swagger-ui and redoc bundles and the favicon, as fastapi-offline ships them."""
    return StaticFiles(directory=str(files("fastapi_offline").joinpath("static")))


def _urls(request: Request) -> tuple[FastAPI, str, str]:
    """The app, its OpenAPI document's URL and the assets' URL, both under the proxy's root path if any."""
    app: FastAPI = request.app
    root = request.scope.get("root_path", "")
    return app, f"{root}{app.openapi_url}", f"{root}{ASSETS_PATH}"


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI for this service's OpenAPI description."""
    app, openapi_url, assets = _urls(request)
    return get_swagger_ui_html(
        openapi_url=openapi_url,
        title=f"{app.title} - Swagger UI",
        swagger_js_url=f"{assets}/swagger-ui-bundle.js",
        swagger_css_url=f"{assets}/swagger-ui.css",
        swagger_favicon_url=f"{assets}/favicon.png",
        # no badge fetched from swagger.io's online validator
        swagger_ui_parameters={"validatorUrl": None},
    )


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    """ReDoc for this service's OpenAPI description."""
    app, openapi_url, assets = _urls(request)
    return get_redoc_html(
        openapi_url=openapi_url,
        title=f"{app.title} - ReDoc",
        redoc_js_url=f"{assets}/redoc.standalone.js",
        redoc_favicon_url=f"{assets}/favicon.png",
        with_google_fonts=False,
    )
