"""Middlewares as users add them to vLLM's own API server (`vllm serve --middleware IMPORT.PATH`), for the apps rows
of the gateway matrix (collectors/engines/gateways.py): a line of logging per request, written the two ways vLLM
takes one. Copied beside the row as cw_middleware.py and imported by the engine's API server from there.

  LogLine    a class: vLLM adds it with app.add_middleware(); it subclasses Starlette's BaseHTTPMiddleware (the
             middleware of vLLM issue 10087)
  log_line   a coroutine function: vLLM hands it to app.middleware("http"), which Starlette wraps in a
             BaseHTTPMiddleware itself

Nothing here decides what the matrix finds: each row's verdict is measured on the engine's evidence.
"""

from __future__ import annotations

import logging

from starlette.middleware.base import BaseHTTPMiddleware

# under vLLM's logger: its lines land in the engine's log, in its format (what shows the middleware ran)
log = logging.getLogger("vllm.cw_middleware")


class LogLine(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        response = await call_next(request)
        log.info("LogLine: %s %s -> %s", request.method, request.url.path, response.status_code)
        return response


async def log_line(request, call_next):
    response = await call_next(request)
    log.info("log_line: %s %s -> %s", request.method, request.url.path, response.status_code)
    return response
