"""A trace collector that takes every OTLP/HTTP export and keeps nothing, for measuring what
tracing costs the services (not what a collector costs): `POST /v1/traces` answered 200 with an
empty `ExportTraceServiceResponse`, unread beyond its length. On Ctrl+C it prints how many exports
and bytes it took.

    .venv/bin/python benchmarks/otlp_sink.py --port 4318 &
    AXON_BENCH_OTLP_ENDPOINT=http://127.0.0.1:4318 .venv/bin/python benchmarks/capacity.py ...
"""

import argparse
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects
    exports = 0
    received_bytes = 0

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        self.rfile.read(length)
        Sink.exports += 1
        Sink.received_bytes += length
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")  # an empty ExportTraceServiceResponse
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Sink)
    # Also when started in the background by a script, whose shell ignores SIGINT for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        print(f"{Sink.exports} exports, {Sink.received_bytes} bytes")


if __name__ == "__main__":
    main()
