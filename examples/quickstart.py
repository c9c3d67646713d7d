"""Stream an answer from the local platform that `axon up` runs, with the official openai client.

    export AXON_API_KEY=axk_...   # printed by axon up
    .venv/bin/python examples/quickstart.py

It asks the gateway on `AXON_GATEWAY_PORT` (8000) for `AXON_MODEL` (SmolLM2-135M-Instruct): the
same variables `axon up` reads, so a shell that chose another port or model for it asks that one.
"""

import os
import sys

from openai import OpenAI

api_key = os.environ.get("AXON_API_KEY")
if not api_key:
    print(
        "quickstart.py: AXON_API_KEY is not set. `make up` prints the key to export:\n  export AXON_API_KEY=axk_...",
        file=sys.stderr,
    )
    sys.exit(2)
port = os.environ.get("AXON_GATEWAY_PORT", "8000")
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key)
for chunk in client.chat.completions.create(
    model=os.environ.get("AXON_MODEL", "SmolLM2-135M-Instruct"),
    stream=True,
    messages=[{"role": "user", "content": "Hello!"}],
):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
