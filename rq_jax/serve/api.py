"""An OpenAI-compatible HTTP server over an `EngineThread` (FastAPI, Server-Sent Events for streams).

    POST /v1/completions        prompt text or token ids (one or a list), max_tokens, temperature, top_p,
                                top_k, seed, stop, stop_token_ids, ignore_eos, stream (+ stream_options.
                                include_usage), logprobs (0-5), echo (the prompt, with its log-probabilities),
                                return_tokens_as_token_ids (vLLM's: logprobs tokens as "token_id:N")
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template; logprobs, top_logprobs
    GET  /v1/models, /health (503 while warming up or draining), /metrics (Prometheus text)

Request bodies are `rq_jax.serve.protocol`'s pydantic models (unknown fields refused, as OpenAI does).
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 naming the bad field,
404 for an unknown route and (code "model_not_found", as OpenAI and vLLM answer) for a model not served
here, 429 when the waiting queue is full, 503 while warming up or draining. A client that disconnects
cancels its requests, which frees their slots. The server never touches arrays: it turns JSON into
token ids and `SamplingParams`, and `Delta`s back into JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from rq_jax.serve.chat import ChatTemplate, ChatTemplateError
from rq_jax.serve.output import Delta, TokenLogprob
from rq_jax.serve.params import ParamError, SamplingParams
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, request_error, sampling_params
from rq_jax.serve.runner import EngineThread, NotReady, QueueFull
from rq_jax.serve.streams import Choice, LoopPost, gather, sse, sse_events


def error_response(err: APIError) -> JSONResponse:
    """`err` as OpenAI's error JSON with its status."""
    return JSONResponse(err.body(), err.status)


class Server:
    """The routes' shared state: the engine thread, tokenizer, model name, chat template and metrics."""

    def __init__(self, runner: EngineThread, tokenizer, model_name: str, chat_template: ChatTemplate | None,
                 metrics: ServeMetrics):
        self.runner, self.tokenizer, self.model_name = runner, tokenizer, model_name
        self.chat_template, self.metrics = chat_template, metrics
        self._ids = itertools.count()
        self._post: LoopPost | None = None  # for the event loop serving the requests

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def check_model(self, model: str | None) -> None:
        """404 model_not_found (OpenAI's answer) for a model other than the one served (None: that one)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {json.dumps(model)} is not served here; this server serves "
                           f"{json.dumps(self.model_name)}", "model", code="model_not_found")

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[Choice], asyncio.Queue]:
        """Queue one request per prompt; their deltas arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        if self._post is None or self._post.loop is not loop:
            self._post = LoopPost(loop)
        post, events = self._post.put, asyncio.Queue()

        def sink(delta: Delta) -> None:
            post(events, delta)

        choices: list[Choice] = []
        try:
            for i, prompt in enumerate(prompts):
                choice = Choice(i, f"{uuid.uuid4().hex[:12]}-{next(self._ids)}", prompt)
                self.runner.submit(prompt, params, sink, choice.request_id)
                choices.append(choice)
        except (NotReady, QueueFull, ParamError) as err:
            self.cancel(choices)
            if isinstance(err, NotReady):
                error = APIError(503, str(err), None, "service_unavailable")
            elif isinstance(err, QueueFull):
                error = APIError(429, f"the server is busy: {err}; retry later", None, "rate_limit_exceeded")
            else:
                error = APIError(400, str(err), err.param)
            self.metrics.refused(error.status)
            raise error from None
        return choices, events

    def cancel(self, choices: list[Choice]) -> None:
        for c in choices:
            if c.finish_reason is None:
                self.runner.cancel(c.request_id)

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(len(c.prompt) for c in choices)
        completion = sum(c.num_tokens for c in choices)
        return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # ---- completions -------------------------------------------------------------------------------

    def completion_logprobs(self, entries: list[TokenLogprob | None], tokens: list[int], as_ids: bool) -> dict:
        """OpenAI's legacy logprobs object over `tokens` (entries None where there is no log-probability:
        the prompt's first token); tokens spelled "token_id:N" when `as_ids`."""
        def name(t: int) -> str:
            return f"token_id:{t}" if as_ids else self.token_text(t)

        texts = [self.token_text(t) for t in tokens]
        return dict(tokens=[name(t) for t in tokens],
                    token_logprobs=[None if e is None else e.logprob for e in entries],
                    top_logprobs=[None if e is None else {name(i): lp for i, lp in e.top} for e in entries],
                    text_offset=list(itertools.accumulate([len(t) for t in texts[:-1]], initial=0)))

    def completion_choice(self, c: Choice, want_logprobs: bool, echo: bool, as_ids: bool) -> dict:
        text = "".join(c.text)
        logprobs = None
        generated = [e.token for e in c.logprobs]
        if echo:
            text = self.tokenizer.decode(c.prompt) + text
        if want_logprobs:
            entries = list(c.logprobs)
            tokens = list(generated)
            if echo:
                entries = list(c.prompt_logprobs or [None] * len(c.prompt)) + entries
                tokens = c.prompt + tokens
            logprobs = self.completion_logprobs(entries, tokens, as_ids)
        return dict(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        self.check_model(body.model)
        echo, as_ids, logprobs = bool(body.echo), bool(body.return_tokens_as_token_ids), body.logprobs
        choices, events = self.submit(body.prompts(self.tokenizer), sampling_params(body))
        head = dict(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
                    model=self.model_name)
        if body.stream:
            def chunk(c: Choice, d: Delta) -> dict:
                lp = None
                if logprobs is not None:
                    lp = self.completion_logprobs(list(d.logprobs), [e.token for e in d.logprobs], as_ids)
                return {**head, "choices": [dict(index=c.index, text=d.text, logprobs=lp,
                                                 finish_reason=d.finish_reason)]}

            def first(c: Choice) -> dict | None:
                if not echo:
                    return None
                return {**head, "choices": [dict(index=c.index, text=self.tokenizer.decode(c.prompt), logprobs=None,
                                                 finish_reason=None)]}

            def usage() -> dict:
                return {**head, "choices": [], "usage": self.usage(choices)}

            return sse(sse_events(choices, events, chunk, first, usage if body.include_usage else None, self.cancel))
        await gather(request, choices, events, self.cancel)
        return JSONResponse({**head, "choices": [self.completion_choice(c, logprobs is not None, echo, as_ids)
                                                 for c in choices], "usage": self.usage(choices)})

    # ---- chat --------------------------------------------------------------------------------------

    def chat_logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob], top: bool) -> dict:
        def item(token: int, lp: float) -> dict:
            text = self.token_text(token)
            return dict(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

        return dict(content=[{**item(e.token, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top] if top
                              else []} for e in entries])

    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        self.check_model(body.model)
        if self.chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json's chat_template); "
                           "use /v1/completions", "messages")
        want, top = bool(body.logprobs), bool(body.top_logprobs)
        params = sampling_params(body)
        try:
            text = self.chat_template.render(body.message_dicts(), add_generation_prompt=True)
        except ChatTemplateError as err:
            raise APIError(400, str(err), "messages") from None
        choices, events = self.submit([self.tokenizer.encode(text).ids], params)
        head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
                    model=self.model_name)
        if body.stream:
            head["object"] = "chat.completion.chunk"

            def chunk(c: Choice, d: Delta) -> dict:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                return {**head, "choices": [dict(index=c.index, delta=delta, finish_reason=d.finish_reason,
                                                 logprobs=self.chat_logprobs(d.logprobs, top) if want else None)]}

            def first(c: Choice) -> dict:
                return {**head, "choices": [dict(index=c.index, delta={"role": "assistant", "content": ""},
                                                 logprobs=None, finish_reason=None)]}

            def usage() -> dict:
                return {**head, "choices": [], "usage": self.usage(choices)}

            return sse(sse_events(choices, events, chunk, first, usage if body.include_usage else None, self.cancel))
        await gather(request, choices, events, self.cancel)
        return JSONResponse({**head, "choices": [
            dict(index=c.index, message={"role": "assistant", "content": "".join(c.text)},
                 finish_reason=c.finish_reason, logprobs=self.chat_logprobs(c.logprobs, top) if want else None)
            for c in choices],
            "usage": self.usage(choices)})


def create_app(server: Server, on_shutdown: Callable[[], Any] | None = None) -> FastAPI:
    """The FastAPI app of `server` (its engine thread started and stopped with the app's lifespan)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.runner.start()
        yield
        server.runner.stop()
        if on_shutdown is not None:
            on_shutdown()

    # strict_content_type=False: a body sent without a Content-Type is read as JSON, as before FastAPI's
    # strict default (clients such as httpx's `content=` send none); other types are refused.
    app = FastAPI(title="rq_jax", lifespan=lifespan, strict_content_type=False)
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError):
        return error_response(request_error(bodies[request.scope["route"].path], err.errors(), err.body))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found" if err.status_code == 404 else "invalid_request_error"
        return error_response(APIError(err.status_code, str(err.detail), None, kind))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        return error_response(APIError(500, f"internal error: {type(err).__name__}: {err}", None, "server_error"))

    @app.get("/health")
    async def health():
        if server.runner.ready:
            return {"status": "ok"}
        return error_response(APIError(503, f"the server is {server.runner.state}", None, "service_unavailable"))

    @app.get("/v1/models")
    async def models():
        engine = server.runner.engine
        return {"object": "list", "data": [dict(id=server.model_name, object="model", created=0, owned_by="rq_jax",
                                                max_model_len=engine.max_len)]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await server.completions(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await server.chat_completions(request, body)

    return app
