"""``kvxfer proxy``: the small HTTP router a vLLM prefill/decode deployment with ``KvxferConnector``
needs in front of its ``vllm serve`` processes.

    kvxfer proxy --prefill http://p0:8100 [--prefill http://p1:8100 ...] \\
                 --decode http://d0:8200 [--decode ...] [--host 0.0.0.0] [--port 8000]

Per OpenAI request (``/v1/completions``, ``/v1/chat/completions``):
  1. the request goes to a prefill server (round robin) with ``max_tokens`` 1, no streaming, and
     ``kv_transfer_params: {"do_remote_decode": true}``: prefill computes the prompt's KV, holds it,
     and answers with the ``kv_transfer_params`` decode needs (instance, registry, room);
  2. the original request goes to a decode server (round robin) with those ``kv_transfer_params``;
     its answer (streamed or not) is passed back as it comes.
A prefill error is returned as it came (decode is not asked); ``/v1/models`` and ``/health`` are
answered by a decode server. Standard library and aiohttp only.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys

from ..errors import ConfigError

log = logging.getLogger("kvxfer.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 64 << 20   # bytes of one request body


def prefill_body(body: dict) -> dict:
    """The request prefill runs: one token, no streaming, and the ask to hold the KV for decode."""
    out = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_body(body: dict, prefill_answer: dict) -> dict | None:
    """The request decode runs (the original, with prefill's kv_transfer_params), or None when
    prefill's answer carries none (then it is the answer)."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if not isinstance(params, dict):
        return None
    return dict(body, kv_transfer_params=params)


def make_app(prefill: list[str], decode: list[str], timeout: float = 600.0):
    """The aiohttp application: ``prefill`` and ``decode`` are base URLs of ``vllm serve`` servers."""
    from aiohttp import ClientSession, ClientTimeout, web

    if not prefill or not decode:
        raise ConfigError("give at least one --prefill and one --decode server")
    p_next, d_next = itertools.cycle(prefill), itertools.cycle(decode)
    session_key = web.AppKey("session", ClientSession)

    async def start(app):
        app[session_key] = ClientSession(timeout=ClientTimeout(total=timeout))

    async def stop(app):
        await app[session_key].close()

    async def route(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the request body must be a JSON object"}, status=400)
        session = request.app[session_key]
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        p_url = next(p_next) + request.path
        async with session.post(p_url, json=prefill_body(body), headers=headers) as pr:
            raw = await pr.read()
            if pr.status != 200:
                return web.Response(body=raw, status=pr.status, content_type=pr.content_type)
        try:
            answer = json.loads(raw)
        except ValueError:
            return web.json_response({"error": f"prefill {p_url} answered with no JSON"}, status=502)
        dbody = decode_body(body, answer)
        if dbody is None:   # the engine behind it is not a kvxfer prefill: its answer is the answer
            log.warning("prefill %s returned no kv_transfer_params; answering with its output", p_url)
            return web.json_response(answer)
        async with session.post(next(d_next) + request.path, json=dbody, headers=headers) as dr:
            out = web.StreamResponse(status=dr.status, headers={"Content-Type": dr.headers.get(
                "Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in dr.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def forward_get(request: web.Request) -> web.Response:
        async with request.app[session_key].get(next(d_next) + request.path) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    app = web.Application(client_max_size=MAX_BODY)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    for path in ROUTES:
        app.router.add_post(path, route)
    app.router.add_get("/v1/models", forward_get)
    app.router.add_get("/health", forward_get)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill vllm serve base URL (repeat)")
    ap.add_argument("--decode", action="append", required=True, help="a decode vllm serve base URL (repeat)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one upstream request may take")
    args = ap.parse_args(argv)
    from aiohttp import web
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = make_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], args.timeout)
    try:
        web.run_app(app, host=args.host, port=args.port, print=lambda *a: None)
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
