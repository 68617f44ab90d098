"""``kvxfer proxy`` against stand-in prefill and decode servers (fast tier: in-process aiohttp on
loopback). Prefill is asked for one token with ``do_remote_decode``; decode gets the original
request with prefill's ``kv_transfer_params``; decode's stream comes back chunk by chunk; a prefill
error is returned as it came, without asking decode; servers are used round robin.
"""
from __future__ import annotations

import asyncio
import json

from aiohttp import ClientSession, web

from kvxfer.cli.proxy import make_app

NAME = web.AppKey("name", str)


async def serve(app) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def stand_ins(seen: list, fail: bool = False):
    async def prefill(request):
        body = await request.json()
        seen.append(("P", request.app[NAME], body))
        if fail:
            return web.json_response({"error": "prompt too long"}, status=400)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {"kvxfer_room": "r1",
                                                                                     "do_remote_prefill": True}})

    async def decode(request):
        body = await request.json()
        seen.append(("D", request.app[NAME], body))
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "hello world"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("hello", " world"):
            await resp.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request):
        return web.json_response({"data": [{"id": "m"}]})

    def app(handler, name):
        a = web.Application()
        a[NAME] = name
        a.router.add_post("/v1/completions", handler)
        a.router.add_post("/v1/chat/completions", handler)
        a.router.add_get("/v1/models", models)
        return a

    return app(prefill, "p0"), app(prefill, "p1"), app(decode, "d0")


async def scenario(fail: bool = False):
    seen: list = []
    runners, urls = [], []
    for a in stand_ins(seen, fail):
        r, u = await serve(a)
        runners.append(r)
        urls.append(u)
    proxy, purl = await serve(make_app(urls[:2], urls[2:]))
    out = {}
    try:
        async with ClientSession() as s:
            req = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True,
                   "stream_options": {"include_usage": True}}
            async with s.post(purl + "/v1/completions", json=req) as r:
                out["status"], out["stream"] = r.status, [c async for c in r.content.iter_any()]
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
            async with s.post(purl + "/v1/chat/completions", json=chat) as r:
                out["chat"] = (r.status, await r.json())
            async with s.post(purl + "/v1/completions", data=b"not json") as r:
                out["bad"] = r.status
            async with s.get(purl + "/v1/models") as r:
                out["models"] = await r.json()
    finally:
        for r in [proxy, *runners]:
            await r.cleanup()
    return seen, out


def test_prefill_then_decode_with_the_kv_transfer_params_and_the_stream_passed_back():
    seen, out = asyncio.run(scenario())
    assert out["status"] == 200
    text = b"".join(out["stream"]).decode()
    assert '"hello"' in text and '" world"' in text and text.endswith("data: [DONE]\n\n")
    (_, p0, pbody), (_, _, dbody) = seen[0], seen[1]
    assert pbody["max_tokens"] == 1 and pbody["stream"] is False and "stream_options" not in pbody
    assert pbody["kv_transfer_params"] == {"do_remote_decode": True} and pbody["prompt"] == [1, 2, 3]
    assert dbody["max_tokens"] == 16 and dbody["stream"] is True and dbody["stream_options"]
    assert dbody["kv_transfer_params"] == {"kvxfer_room": "r1", "do_remote_prefill": True}
    (_, p1, chat_p), (_, _, chat_d) = seen[2], seen[3]
    assert {p0, p1} == {"p0", "p1"}                                          # round robin
    assert chat_p["max_completion_tokens"] == 1 and chat_d["max_completion_tokens"] == 9
    assert out["chat"] == (200, {"choices": [{"text": "hello world"}]})
    assert out["bad"] == 400 and out["models"] == {"data": [{"id": "m"}]}


def test_a_prefill_error_is_returned_and_decode_is_not_asked():
    seen, out = asyncio.run(scenario(fail=True))
    assert out["status"] == 400 and b"prompt too long" in b"".join(out["stream"])
    assert all(side == "P" for side, _, _ in seen)
