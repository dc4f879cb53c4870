"""The server's API key (``infer.py --serve --api-key KEY`` or ``$K3JAX_API_KEY``), as vLLM and SGLang take
it: every request but ``GET /health`` (a load balancer's probe) must carry ``Authorization: Bearer KEY``;
one without it, or with another key, gets 401 and OpenAI's error body (``invalid_api_key``), before its
body is read."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

OPEN_PATHS = ("/health",)


class RequireApiKey:
    """ASGI middleware around ``app`` (a plain ASGI wrapper, not Starlette's ``BaseHTTPMiddleware``, so
    streamed responses and the client-disconnect messages they watch for pass through untouched)."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty")
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        response = JSONResponse({"error": {"message": "a valid API key is required: send 'Authorization: Bearer "
                                           "<key>'", "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)  # constant time: the key is not guessable by timing
