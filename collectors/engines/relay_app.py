"""An app server that owns an in-process vLLM AsyncLLM and passes cancels on through the Relay.

It is the `inproc` scenario's target and an example for app authors: streaming completions
(OpenAI-shaped SSE; a whole JSON answer where the body asks `"stream": false`, its client watched while the engine
works, so that a client that gives up has its request aborted too), an explicit `POST /cancel/{request_id}` (owner in `X-Owner`) that goes through
the relay to `AsyncLLM.abort()`, and the engine's Prometheus metrics on `/metrics`. The app issues
each request's id and returns it in the `X-Relay-Request-Id` header (the client's own X-Request-Id
is only echoed in `X-Client-Request-Id`); a client that goes away closes the relay's stream at once,
so the engine is told then, not when the garbage collector gets to it.
Runs under the engine's Python:

    python -m cancelwatch.collectors.engines.relay_app --model DIR --port 8100 [--load-format dummy] [shape flags]
        [--replica a --peer b=http://127.0.0.1:8101]

Its answer to a cancel is never "released" (vLLM's abort() acknowledges nothing): `abort_sent` once abort()
returned, `abort_failed`, `abort_unconfirmed` (a retry the scheduler's gauges did not bear out) or
`abort_pending` (still retrying when /cancel stopped waiting, which is the relay's worst case); release is the
verdict's to say. With `--replica`, a cancel for another replica's id is passed on to that replica (`--peer`)
and its answer returned with `forwarded_to`, or answered `not_here` (HTTP 404).
"""
# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run time


import argparse
import asyncio
import json
import logging
import time

from cancelwatch.collectors.engines.relay import Relay, RequestCancelled


DISCONNECT_POLL_S = 0.05  # how often a non-streaming answer's client is looked at while the engine works
# the relay's word on an accepted cancel, once its abort settled (Entry.abort)
ABORT_ANSWER = {"sent": "abort_sent", "failed": "abort_failed", "unconfirmed": "abort_unconfirmed", None: "abort_pending"}


def scheduler_count() -> float | None:
    """Running + waiting requests on this process's own vLLM gauges (what its /metrics serves); None when
    the gauges are not there yet."""
    from prometheus_client import REGISTRY

    total, seen = 0.0, False
    for family in REGISTRY.collect():
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            for sample in family.samples:
                total, seen = total + sample.value, True
    return total if seen else None


def build_app(llm, served_name: str, relay: Relay | None = None, replica: str | None = None,
              peers: dict[str, str] | None = None):
    """The app around `llm`; `relay` replaces the default one (tests count its aborts). `replica`: this
    replica's name (part of every id it issues); `peers`: the other replicas' URLs by name, where a cancel
    for their ids is passed on."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    class ClosingStreamingResponse(StreamingResponse):
        """Closes its body however the response ends. Starlette cancels the streaming task when the
        client goes, but leaves the body generator suspended where it was (at a `yield`, while a
        chunk was being sent): only closing it runs the relay's finally, and so the abort."""

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()

    relay = relay or Relay(generate=lambda engine_id, p: llm.generate(p["prompt"], p["params"], engine_id),
                           abort=llm.abort, replica=replica, scheduler_count=scheduler_count)
    peers = dict(peers or {})
    # made once, up front: importing httpx and building a client took seconds on a loaded machine, inside
    # the very cancel it was to pass on
    forwarder = None
    if peers:
        import httpx

        forwarder = httpx.AsyncClient(timeout=relay.abort_worst_case_s + 5.0, trust_env=False)
    app = FastAPI()
    app.state.relay = relay

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        rid = relay.issue_id()
        owner = request.headers.get("x-owner", "anonymous")
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)), ignore_eos=bool(body.get("ignore_eos")),
                                temperature=float(body.get("temperature", 1.0)), output_kind=RequestOutputKind.DELTA)
        payload = {"prompt": body["prompt"], "params": params}

        async def sse():
            stream = relay.stream(rid, owner, payload)
            try:
                async for out in stream:
                    c = out.outputs[0]
                    chunk = {"id": rid, "object": "text_completion", "model": served_name,
                             "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            except RequestCancelled:
                return
            finally:
                await stream.aclose()

        headers = {"X-Relay-Request-Id": rid}
        if request.headers.get("x-request-id"):
            headers["X-Client-Request-Id"] = request.headers["x-request-id"]
        if body.get("stream") is False:
            return await whole_answer(request, rid, relay.stream(rid, owner, payload), headers)
        return ClosingStreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    async def whole_answer(request: Request, rid: str, stream, headers: dict):
        """A non-streaming answer: the outputs gathered in a task while the client is watched. A handler that only
        awaited the answer would keep the request after its client left (the FastAPI relays of the gateway
        matrix do); here the client's leaving cancels the task, and closing the relay's stream aborts the request."""
        async def gather():
            text, reason = [], None
            try:
                async for out in stream:
                    text.append(out.outputs[0].text)
                    reason = out.outputs[0].finish_reason or reason
            finally:
                await stream.aclose()
            return "".join(text), reason

        task = asyncio.ensure_future(gather())
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499, headers=headers)  # nobody reads it: the client is gone
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        try:
            text, reason = task.result()
        except RequestCancelled:
            return JSONResponse({"id": rid, "object": "text_completion", "model": served_name, "choices": []},
                                headers=headers)
        return JSONResponse({"id": rid, "object": "text_completion", "model": served_name,
                             "choices": [{"index": 0, "text": text, "finish_reason": reason}]}, headers=headers)

    @app.post("/cancel/{rid}")
    async def cancel(rid: str, request: Request):
        owner = request.headers.get("x-owner", "anonymous")
        result = await relay.cancel(rid, owner)
        if result == "not_here":
            home = relay.replica_of(rid)
            if home in peers and not request.headers.get("x-relay-forwarded"):
                return JSONResponse(await forward(peers[home], rid, owner, home))
            return JSONResponse({"result": "not_here", "replica": relay.replica, "status": None}, status_code=404)
        if result == "cancelled":
            # answer once the serving task's finally has settled abort(): every attempt and the scheduler's
            # confirmation may take the relay's worst case, and an answer before it would guess
            deadline = time.monotonic() + relay.abort_worst_case_s + 0.5
            while time.monotonic() < deadline and relay.status(rid)["abort_ok"] is None:
                await asyncio.sleep(0.002)
            result = ABORT_ANSWER[relay.status(rid)["abort"]]
        return JSONResponse({"result": result, "status": relay.status(rid)})

    async def forward(url: str, rid: str, owner: str, home: str) -> dict:
        import httpx

        t0 = time.monotonic()
        try:
            resp = await forwarder.post(f"{url.rstrip('/')}/cancel/{rid}",
                                        headers={"X-Owner": owner, "X-Relay-Forwarded": relay.replica or "?"})
            doc = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            doc = {"result": "forward_failed", "error": f"{type(exc).__name__}: {exc}", "status": None}
        logging.getLogger("cancelwatch.relay").info("cancel %s passed on to %s: %s (%.0f ms)", rid, home,
                                                    doc.get("result"), 1000 * (time.monotonic() - t0))
        return {**doc, "forwarded_to": home}

    @app.get("/relay/{rid}")
    async def status(rid: str):
        st = relay.status(rid)
        return JSONResponse(st or {}, status_code=200 if st else 404)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description="cancelwatch relay app: AsyncLLM + Relay over HTTP")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--served-model-name", default="tiny")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--replica", default=None, help="this replica's name: part of every id it issues")
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                    help="another replica, where a cancel for its ids is passed on (repeatable)")
    args = ap.parse_args()
    peers = dict(p.split("=", 1) for p in args.peer)
    # the relay's cancels and alerts, in arrival order, in the app's log
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    relay_log = logging.getLogger("cancelwatch.relay")
    relay_log.setLevel(logging.INFO)
    relay_log.addHandler(handler)
    relay_log.propagate = False

    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(
        model=args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        disable_log_stats=False, served_model_name=[args.served_model_name],
    )

    async def serve():
        llm = AsyncLLM.from_engine_args(engine_args)
        try:
            config = uvicorn.Config(build_app(llm, args.served_model_name, replica=args.replica, peers=peers),
                                    host=args.host, port=args.port,
                                    log_level="warning")
            await uvicorn.Server(config).serve()
        finally:
            llm.shutdown()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
