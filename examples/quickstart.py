"""Stream an answer from the local platform that `axon up` runs, with the official openai client.

    export AXON_API_KEY=axk_...   # printed by axon up
    .venv/bin/python examples/quickstart.py

It asks the gateway on `AXON_GATEWAY_PORT` (8000) for `AXON_MODEL` (SmolLM2-135M-Instruct): the
same variables `axon up` reads, so a shell that chose another port or model for it asks that one.
"""

import os

from openai import OpenAI

port = os.environ.get("AXON_GATEWAY_PORT", "8000")
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=os.environ["AXON_API_KEY"])
for chunk in client.chat.completions.create(
    model=os.environ.get("AXON_MODEL", "SmolLM2-135M-Instruct"),
    stream=True,
    messages=[{"role": "user", "content": "Hello!"}],
):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
