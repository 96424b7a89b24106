"""The HTTP API and the page (FastAPI). The routes live in webui/routes/, one router per concern, and share
one webui.context.WebContext; training itself is reached only through webui.runner (subprocesses, signals and
the run's control file)."""

from __future__ import annotations

import hmac
import os
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from webui.context import WebContext
from webui.folders import Roots
from webui.hardware import gpus
from webui.jobfiles import REPO_ROOT
from webui.routes import captioning, datasets, describe, files, folders, generate, jobs, runs, settings, tensorboard

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
TOKEN_COOKIE = "webui_token"
ROUTERS = (captioning.router, jobs.router, settings.router, runs.router, generate.router, files.router, tensorboard.router,
           folders.router, datasets.router, describe.router)


def _body_error(exc: RequestValidationError) -> Optional[dict]:
    """The first error of a request body of the wrong shape, in the API's refusal form (one line + field)."""
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        if tuple(e.get("loc", ()))[:1] == ("body",):
            name = ".".join(loc) or "body"
            return {"error": f"{name}: {e.get('msg', 'invalid')}", "field": loc[0] if loc else None}
    return None


def create_app(jobs_dir: str, token: Optional[str] = None, stop_timeout: float = 60.0,
               default_launcher: str = "python", data_roots: Optional[list[str]] = None,
               find_gpus=gpus) -> FastAPI:
    """`find_gpus`: the GPUs of this machine (webui.hardware.gpus; tests give a stand-in list)."""
    ctx = WebContext(os.path.abspath(jobs_dir), Roots(data_roots or [REPO_ROOT, os.getcwd()]), stop_timeout,
                     default_launcher, find_gpus)
    for added in datasets.load_added_roots(ctx):  # folders added from the page, kept on the server
        ctx.roots.add(added)
    app = FastAPI(title="Training jobs", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.store, app.state.runner, app.state.tensorboards = ctx.store, ctx.runner, ctx.boards
    app.state.describe = ctx.describe

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token:
            given = (request.headers.get("authorization", "").removeprefix("Bearer ").strip()
                     or request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE) or "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                return JSONResponse({"detail": "token required: open the page as /?token=YOUR_TOKEN "
                                               "or send 'Authorization: Bearer YOUR_TOKEN'"}, status_code=401)
        response = await call_next(request)
        if token and request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(RequestValidationError)
    async def ids_outside_the_store(request: Request, exc: RequestValidationError):
        """A job or revision id in the path that is no integer in 1..MAX_ID names nothing: 404; a body of the
        wrong shape: 422 with one line naming the field; FastAPI's 422 stays for the query."""
        bad = [e["loc"][1] for e in exc.errors() if tuple(e.get("loc", ()))[:1] == ("path",)]
        if bad:
            given = request.path_params
            detail = (f"no job {given.get('job_id')}" if "job_id" in bad else
                      f"job {given.get('job_id')} has no settings revision {given.get('revision_id')}")
            return JSONResponse({"detail": detail}, status_code=404)
        body = _body_error(exc)
        if body is not None:
            return JSONResponse({"detail": body}, status_code=422)
        return await request_validation_exception_handler(request, exc)

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), headers={"Cache-Control": "no-store"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    for router in ROUTERS:  # the routes themselves, not a lazy include: app.routes lists every route
        app.router.routes.extend(router.routes)
    return app
