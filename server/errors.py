"""Errors in the shape of the API that was called: OpenAI's {"error": {"message", "type", "param",
"code"}} everywhere but under /v1/messages, where Anthropic's {"type": "error", "error": {"type",
"message"}} is what its SDK and Claude Code read.

Validation problems are 400 (not FastAPI's 422); the server keeps serving after any of them.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
        anthropic_message: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.anthropic_message = anthropic_message  # where Anthropic's API words it otherwise

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": _anthropic_type(self.status, self.type),
                                           "message": self.anthropic_message or self.message}}

    def response(self, path: str = "") -> JSONResponse:
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def _anthropic_type(status: int, openai_type: str) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _is_union_tag(part) -> bool:
    """pydantic names the union member that failed in `loc` ('str', 'list[MessageItem]',
    'MessageItem', 'function-after[...]'): not part of the field's path."""
    text = str(part)
    return not isinstance(part, int) and (text.lower() in _TYPE_TAGS or "[" in text or text[:1].isupper())


def _param_path(loc) -> Optional[str]:
    parts = [str(p) for p in loc if p != "body" and not _is_union_tag(p)]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # Of a union's alternatives, the one that got furthest says what is wrong (a list of items
        # that fails as a list of items, not as the plain string the first alternative wanted).
        first = max(errors, key=lambda e: len([p for p in e.get("loc", ()) if not _is_union_tag(p)]), default={})
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip()
            return bad_request(message).response(request.url.path)
        param = _param_path(first.get("loc", ()))
        if param is None:  # `[]`, `"x"`, an empty body: nothing to name
            return bad_request("the request body must be a JSON object of the request's fields").response(request.url.path)
        if first.get("type") == "extra_forbidden":
            message = f"unsupported parameter: {param}"
        elif first.get("type") == "missing":
            message = f"missing required parameter: {param}"
        else:
            message = f"invalid value for {param}: {first.get('msg', 'invalid')}"
        return bad_request(message, param=param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)  # 405: Allow
        return error.response(request.url.path)

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError):
        return bad_request(f"the request body is not valid JSON: {exc}").response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return error.response(request.url.path)
