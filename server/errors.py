"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

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
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_path(loc) -> Optional[str]:
    parts = [str(p) for p in loc if p != "body"]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip()).response()
        param = _param_path(first.get("loc", ()))
        if param is None:  # `[]`, `"x"`, an empty body: nothing to name
            return bad_request("the request body must be a JSON object of the request's fields").response()
        if first.get("type") == "extra_forbidden":
            message = f"unsupported parameter: {param}"
        elif first.get("type") == "missing":
            message = f"missing required parameter: {param}"
        else:
            message = f"invalid value for {param}: {first.get('msg', 'invalid')}"
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()  # 405: Allow

    @app.exception_handler(json.JSONDecodeError)
    async def _json(request: Request, exc: json.JSONDecodeError):
        return bad_request(f"the request body is not valid JSON: {exc}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()
