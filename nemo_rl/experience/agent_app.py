"""The FastAPI app of the agent endpoint (:class:`~nemo_rl.experience.agent_endpoint.AgentEndpoint`): its
routes, the bearer-token check, and OpenAI error bodies for refused requests. Imported only when an endpoint
starts (FastAPI is an optional dependency)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from nemo_rl.experience.agent_openai import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from nemo_rl.experience.agent_endpoint import AgentEndpoint

SESSION_PREFIX = "/sessions/{trajectory_id}/v1"
"""Where a trajectory's OpenAI routes live (its base URL's path)."""


def build_app(endpoint: AgentEndpoint) -> FastAPI:
    """The app serving ``endpoint``'s routes (see the endpoint's module docstring)."""
    from nemo_rl.experience.agent_endpoint import EndpointError

    app = FastAPI(title="nemo_rl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    async def answer(
        authorization: str | None, body: Callable[[], Awaitable[dict[str, Any]]]
    ) -> JSONResponse:
        try:
            endpoint.check_token(authorization)
            return JSONResponse(await body())
        except EndpointError as err:
            status, content = endpoint.error_response(err)
            return JSONResponse(content, status_code=status)

    @app.post(SESSION_PREFIX + "/chat/completions")
    async def chat_completions(
        trajectory_id: str, request: ChatCompletionRequest, authorization: str | None = Header(default=None)
    ) -> JSONResponse:
        return await answer(authorization, lambda: endpoint.chat(trajectory_id, request))

    @app.post(SESSION_PREFIX + "/completions")
    async def completions(
        trajectory_id: str, request: CompletionRequest, authorization: str | None = Header(default=None)
    ) -> JSONResponse:
        return await answer(authorization, lambda: endpoint.complete(trajectory_id, request))

    @app.get(SESSION_PREFIX + "/models")
    async def models(trajectory_id: str, authorization: str | None = Header(default=None)) -> JSONResponse:
        async def body() -> dict[str, Any]:
            return endpoint.model_list()

        return await answer(authorization, body)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        # A malformed body is answered in OpenAI's format too, but only to a caller holding the token.
        try:
            endpoint.check_token(request.headers.get("authorization"))
        except EndpointError as auth_err:
            status, content = endpoint.error_response(auth_err)
            return JSONResponse(content, status_code=status)
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        status, content = endpoint.error_response(
            EndpointError(400, f"invalid request body at {where or 'body'}: {first.get('msg', 'invalid')}")
        )
        return JSONResponse(content, status_code=status)

    return app
