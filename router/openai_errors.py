"""OpenAI's error shape: the one exception every refusal of the OpenAI API is raised as. Its own module, so
that the request parsers (router/openai_protocol.py, router/structured_output.py, router/tool_calls.py)
share it without importing each other in a circle."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """A refusal with OpenAI's ErrorResponse shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers
        """HTTP headers the refusal carries (Retry-After on 429)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
