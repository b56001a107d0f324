"""router/request_log.py over a small FastAPI app, through httpx2's ASGI transport: the request id goes out in
X-Request-Id (the client's own when usable), each 5xx is one log line with the id and the cause, an escaping
exception is logged with the id and re-raised (uvicorn logs its traceback), /health's 503 stays quiet."""

from __future__ import annotations

import asyncio
import logging

import httpx2
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pdserve.router.request_log import REQUEST_ID, RequestLog


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/down")
    async def down() -> JSONResponse:
        error = {
            "message": f"no serving node ({REQUEST_ID.get()})",
            "type": "server_error",
            "code": "no_nodes",
        }
        return JSONResponse({"error": error}, status_code=503)

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "unavailable"}, status_code=503)

    return app


def _get(path: str, headers: dict[str, str] | None = None) -> httpx2.Response:
    async def go() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=RequestLog(_app()), raise_app_exceptions=False)
        async with httpx2.AsyncClient(transport=transport, base_url="http://r") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(go())


def test_a_5xx_is_one_line_with_the_request_id_and_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pdserve.router.request_log"):
        r = _get("/v1/down")
    request_id = r.headers["x-request-id"]
    assert r.status_code == 503 and request_id.startswith("req-")
    assert request_id in r.json()["error"]["message"]  # bound while the request ran
    (line,) = [rec.getMessage() for rec in caplog.records]
    assert line == f"request {request_id} GET /v1/down answered 503: no_nodes: no serving node ({request_id})"


def test_the_clients_request_id_is_kept_when_usable(caplog: pytest.LogCaptureFixture) -> None:
    assert _get("/v1/down", {"x-request-id": "client-7.a:b"}).headers["x-request-id"] == "client-7.a:b"
    replaced = _get("/v1/down", {"x-request-id": "bad id\twith spaces"}).headers["x-request-id"]
    assert replaced.startswith("req-")


def test_an_internal_error_is_logged_with_the_id_and_raised_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pdserve.router.request_log"):
        r = _get("/v1/boom")
    assert r.status_code == 500
    (record,) = caplog.records
    assert record.levelname == "ERROR" and "GET /v1/boom: internal error" in record.getMessage()
    assert "RuntimeError('boom')" in record.getMessage()


def test_healths_503_is_in_the_access_log_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pdserve.router.request_log"):
        assert _get("/health").status_code == 503
    assert not caplog.records
