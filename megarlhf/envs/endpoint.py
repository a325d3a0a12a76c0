"""The HTTP face of an agent run: an OpenAI-compatible endpoint (aiohttp) on loopback.

It only translates: a request's API key and JSON body go to the runner's handler, whose
(status, JSON) comes back as the response. What a call means (which episode, which tokens)
is the runner's (envs/agents.py). Non-streaming only.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

Handler = Callable[[str, str, dict], Awaitable[tuple[int, dict]]]
"""(route: 'chat' or 'completions', API key, JSON body) -> (HTTP status, JSON payload)."""


def error(status: int, message: str, kind: str) -> tuple[int, dict]:
    """An OpenAI-style error payload (the `openai` client raises it as its APIError)."""
    return status, {"error": {"message": message, "type": kind, "code": status}}


class Endpoint:
    def __init__(self, handler: Handler, *, model: str, host: str, max_requests: int):
        """`model`: the one model /v1/models lists; `max_requests`: requests served at once
        (more are answered 429 at once, never queued without bound)."""
        self.handler, self.model, self.host = handler, model, host
        self.max_requests, self._running = max_requests, 0
        self._runner: web.AppRunner | None = None
        self.base_url: str | None = None

    async def start(self) -> str:
        """Listen on a free port of `host`; the base URL an OpenAI client takes."""
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._route("chat"))
        app.router.add_post("/v1/completions", self._route("completions"))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "megarlhf"}]})

    def _route(self, route: str):
        async def serve(request: web.Request) -> web.Response:
            key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if self._running >= self.max_requests:
                return _respond(*error(429, f"more than agent_max_requests="
                                            f"{self.max_requests} requests at once",
                                       "rate_limit_exceeded"))
            self._running += 1  # counted from here: reading the body may wait
            try:
                try:
                    body = await request.json()
                except ValueError:
                    return _respond(*error(400, "the body is not JSON",
                                           "invalid_request_error"))
                if not isinstance(body, dict):
                    return _respond(*error(400, "the body must be a JSON object",
                                           "invalid_request_error"))
                return _respond(*await self.handler(route, key, body))
            finally:
                self._running -= 1

        return serve


def _respond(status: int, payload: dict) -> web.Response:
    return web.json_response(payload, status=status)
