"""vLLM's `/tokenize` and `/detokenize` on the router, with vLLM's request and response shapes.

/tokenize takes a `prompt` (add_special_tokens, default true) or chat `messages` (add_generation_prompt,
continue_final_message, chat_template_kwargs, add_special_tokens default false) and answers
{count, max_model_len, tokens, token_strs}: the ids exactly as a completion or chat request would send them
(the chat path's own parsing and tokenization, router/handler.py). /detokenize takes {tokens} and answers
{prompt}, special tokens kept, so that a round trip gives the text back.

Invariants: both routes are behind the API key like every /v1 route; errors are OpenAI's ErrorResponse;
`max_model_len` is the smallest context of the nodes in view (null while the router sees none).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.router.chat_bridge import read_body
from pdserve.router.handler import Incoming, Reply, RequestHandler, error_reply
from pdserve.router.openai_protocol import OpenAIError
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

_TOKENIZE_ONLY = ("return_token_strs",)
"""vLLM's /tokenize fields the generation requests do not have."""


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt] = Field(min_length=1)


class TokenizeAPI:
    def __init__(self, handler: RequestHandler, max_body_bytes: int) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes

    async def _body(self, incoming: Incoming) -> dict[str, Any]:
        self.handler.authenticate(incoming.authorization)
        body = await read_body(incoming.body, self.max_body_bytes)
        if not isinstance(body, dict):
            raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        model = body.get("model")
        served = self.handler.config.served_model_names
        if model is not None and model not in served:
            raise OpenAIError(
                404,
                f"The model {model!r} does not exist; this server serves {', '.join(served)}",
                param="model",
                code="model_not_found",
            )
        return {**body, "model": served[0]}

    async def tokenize(self, incoming: Incoming) -> Reply:
        try:
            body = await self._body(incoming)
            if body.get("return_token_strs"):
                raise OpenAIError(
                    400,
                    "return_token_strs is not supported by this server; /detokenize turns ids back into text",
                    param="return_token_strs",
                )
            body = {k: v for k, v in body.items() if k not in _TOKENIZE_ONLY}
            if "messages" in body:
                if "prompt" in body:
                    raise OpenAIError(400, "send either `prompt` or `messages`, not both", param="prompt")
                ids = await self.handler.prompt_ids("chat", body)
            elif isinstance(body.get("prompt"), str):
                ids = await self.handler.prompt_ids("completions", body)
            else:
                raise OpenAIError(400, "/tokenize needs a `prompt` string or chat `messages`", param="prompt")
            nodes = await self.handler.membership.nodes()
            max_len = min((s.info.max_model_len for s in nodes), default=None)
            tokens = list(ids[0])
            return Reply(
                200, {"count": len(tokens), "max_model_len": max_len, "tokens": tokens, "token_strs": None}
            )
        except OpenAIError as exc:
            return error_reply(exc)

    async def detokenize(self, incoming: Incoming) -> Reply:
        try:
            body = await self._body(incoming)
            try:
                req = DetokenizeRequest.model_validate(body)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise OpenAIError(400, f"{where}: {err['msg']}", param="tokens") from exc
            vocab = self.handler.tokenizer.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(
                    400, f"tokens holds {bad[0]}, outside the vocabulary [0, {vocab})", param="tokens"
                )
            text = await asyncio.to_thread(self.handler.tokenizer.decode, req.tokens, False)
            return Reply(200, {"prompt": text})
        except OpenAIError as exc:
            return error_reply(exc)
