"""Who may call the server: the API key and the browsers' origins, as Starlette middleware (create_app's).

With an API key (the CLI's --api-key or JAXLLM_API_KEY), every endpoint but OPEN_PATHS (load balancers' and
scrapers' probes) answers 401 in OpenAI's error JSON (code "invalid_api_key") unless the request carries
`Authorization: Bearer <key>`, as vLLM and llama-server do. With allowed origins (--allowed-origin), browsers'
cross-origin requests from them are answered (CORS), preflights before the key check: a preflight carries no
key.
"""
from __future__ import annotations

import hmac
from typing import Sequence

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from jaxllm.serve import protocol as P

OPEN_PATHS = ("/health", "/metrics")   # answered without the API key


class RequireKey:
  """ASGI middleware: an HTTP (or websocket) request outside OPEN_PATHS without `Authorization: Bearer <key>`
  (the scheme in any case) gets a 401, the key compared in constant time; the rest pass through untouched
  (streamed responses too)."""

  def __init__(self, app, key: str):
    self.app, self.expected = app, key.encode()

  async def __call__(self, scope, receive, send):
    if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS:
      given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
      scheme, _, token = given.partition(b" ")
      if not (scheme.lower() == b"bearer") & hmac.compare_digest(token, self.expected):
        if scope["type"] == "websocket":
          await send({"type": "websocket.close", "code": 1008})     # policy violation
          return
        what = "no API key was given" if not given else "the API key is not this server's"
        error = P.ApiError(401, f"{what}: send the header 'Authorization: Bearer <key>'", code="invalid_api_key",
                           kind="invalid_request_error", headers={"WWW-Authenticate": "Bearer"})
        await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
        return
    await self.app(scope, receive, send)


def middleware(api_key: str | None, allowed_origins: Sequence[str]) -> list[Middleware]:
  """The app's middleware, the outermost first: CORS for allowed_origins ("*": any), then the key check (none
  for None or "")."""
  out = []
  if allowed_origins:
    out.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                          allow_headers=["Authorization", "Content-Type"]))
  if api_key:
    out.append(Middleware(RequireKey, key=api_key))
  return out
