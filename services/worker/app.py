"""The inference worker's app: a small HTTP server for health and metrics beside the job consumer
(`lifecycle.py:Worker`), which boots in its lifespan."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from services.worker.engines import Engine
from services.worker.engines.factory import create_engine
from services.worker.lifecycle import Worker
from services.worker.settings import WorkerSettings
from shared.http_errors import install_error_handlers
from shared.internal_auth import InternalAuth
from shared.middleware import NO_FASTAPI_TELEMETRY, RequestContextMiddleware
from shared.probes import PROBE_PATHS, install_probes


def create_app(settings: WorkerSettings | None = None, engine: Engine | None = None) -> FastAPI:
    """Build the worker's app; the engine and consumer start in the lifespan.

    Raises:
        InsecureConfiguration: no internal token, or a short one.
    """
    settings = settings or WorkerSettings()
    settings.require_internal_token()
    worker = Worker(settings, engine or create_engine(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.worker = worker
        async with worker.running():
            yield

    app = FastAPI(
        title="Axon inference worker",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        telemetry=NO_FASTAPI_TELEMETRY,
    )
    app.state.worker = worker
    install_error_handlers(app)
    app.add_middleware(InternalAuth, settings=settings)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=worker.metrics.http,
        quiet_paths=PROBE_PATHS,
        tracing=worker.tracing,
    )

    install_probes(
        app,
        registry=worker.metrics.registry,
        not_ready_reason=_not_ready_reason,
        ready_doc="Readiness: the engine is loaded and the worker takes jobs.",
        ready_fields=_ready_fields,
    )
    return app


async def _not_ready_reason(app: FastAPI) -> str | None:
    worker: Worker = app.state.worker
    return worker.not_ready_reason


def _ready_fields(app: FastAPI) -> dict[str, Any]:
    worker: Worker = app.state.worker
    return {"model": worker.engine.model_name, "in_flight": worker.runner.in_flight}
