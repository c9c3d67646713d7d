"""`axon-worker`: run one inference worker, configured only by environment."""

import asyncio
import sys
from types import FrameType

import uvicorn

from services.worker.app import create_app
from services.worker.lifecycle import Worker
from services.worker.settings import WorkerSettings
from shared.logging import configure_logging, get_logger
from shared.settings import InsecureConfiguration


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: drain jobs while still answering /ready (with 503), then
    stop the HTTP server. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self._worker = worker
        self._draining: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None:
            super().handle_exit(sig, frame)
            return
        self._draining = asyncio.get_event_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self._worker.drain()
        self.should_exit = True


def main() -> None:
    settings = WorkerSettings()
    configure_logging(service="worker", level=settings.log_level, log_format=settings.log_format)
    try:
        app = create_app(settings)
    except InsecureConfiguration as exc:
        get_logger(__name__).error("refusing_to_start", reason=str(exc))
        sys.exit(2)
    worker: Worker = app.state.worker
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.worker_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config, worker).run()
    if worker.fatal is not None:
        sys.exit(1)


if __name__ == "__main__":
    main()
