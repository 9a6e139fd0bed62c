"""A minimal asyncside server: the embedded MoE model behind the OpenAI API, on this machine only.

    python examples/minimal_server.py --port 8000
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
         -d '{"model": "<id from /v1/models>", "prompt": "Hello", "max_tokens": 8}'

Ctrl-C stops it. ``asyncside serve`` is the full command (model choice, residency, limits).
"""

from __future__ import annotations

import argparse

import uvloop

from asyncside.serving import create_app, open_engine, serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    args = parser.parse_args()

    # open_engine() with no model directory loads the embedded default (built on first run) and
    # opens a Runtime over its expert store, keeping a quarter of each layer's experts resident.
    app = create_app(lambda: open_engine(resident=0.25))
    try:
        uvloop.run(serve(app, "127.0.0.1", args.port, on_ready=lambda url: print(f"serving on {url}", flush=True)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
