"""The FastAPI app of the agent endpoint (:class:`~nemo_rl.experience.agent_endpoint.AgentEndpoint`): its
routes, the bearer-token check, and OpenAI error bodies for every refused request (malformed bodies, unknown
routes and methods included). Imported only when an endpoint starts (FastAPI is an optional dependency)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nemo_rl.experience.agent_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EndpointError,
    validation_error,
)

if TYPE_CHECKING:
    from nemo_rl.experience.agent_endpoint import AgentEndpoint

SESSION_PREFIX = "/sessions/{trajectory_id}/v1"
"""Where a trajectory's OpenAI routes live (its base URL's path)."""

ROUTES = "POST /chat/completions, POST /completions and GET /models under /sessions/<trajectory_id>/v1"
"""The routes, as error messages name them."""


def build_app(endpoint: AgentEndpoint) -> FastAPI:
    """The app serving ``endpoint``'s routes (see the endpoint's module docstring)."""
    app = FastAPI(title="nemo_rl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    _add_routes(app, endpoint)
    _add_error_handlers(app, endpoint)
    return app


def _refuse(
    endpoint: AgentEndpoint, err: EndpointError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    status, content = endpoint.error_response(err)
    return JSONResponse(content, status_code=status, headers=headers)


def _add_routes(app: FastAPI, endpoint: AgentEndpoint) -> None:
    """The OpenAI routes, each answering only a caller holding the endpoint's token."""

    async def answer(
        authorization: str | None, body: Callable[[], Awaitable[dict[str, Any]]]
    ) -> JSONResponse:
        try:
            endpoint.check_token(authorization)
            return JSONResponse(await body())
        except EndpointError as err:
            return _refuse(endpoint, err)

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


def _token_refusal(endpoint: AgentEndpoint, request: Request) -> JSONResponse | None:
    """The answer to a request that lacks the endpoint's token; None when it holds it."""
    try:
        endpoint.check_token(request.headers.get("authorization"))
    except EndpointError as err:
        return _refuse(endpoint, err)
    return None


def _add_error_handlers(app: FastAPI, endpoint: AgentEndpoint) -> None:
    """Requests that reach no handler are answered in OpenAI's format too, but only to a caller holding the
    token: without it every request gets the same 401, whatever it asks."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        refusal = _token_refusal(endpoint, request)
        return refusal if refusal is not None else _refuse(endpoint, validation_error(err.errors()))

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, err: HTTPException) -> JSONResponse:
        refusal = _token_refusal(endpoint, request)
        if refusal is not None:
            return refusal
        where = f"{request.method} {request.url.path}"
        if err.status_code == 405:
            message = f"Method not allowed ({where}): the routes are {ROUTES}"
        elif err.status_code == 404:
            message = f"Invalid URL ({where}): the routes are {ROUTES}"
        else:
            message = f"{where}: {err.detail}"
        return _refuse(endpoint, EndpointError(err.status_code, message), headers=err.headers)
