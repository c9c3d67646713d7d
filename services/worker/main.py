"""`axon-worker`: run one inference worker, configured only by environment."""

import uvicorn

from shared.logging import configure_logging
from services.worker.app import create_app
from services.worker.settings import WorkerSettings


def main() -> None:
    settings = WorkerSettings()
    configure_logging(service="worker", level=settings.log_level, log_format=settings.log_format)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.worker_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
    )


if __name__ == "__main__":
    main()
