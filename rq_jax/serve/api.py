"""An OpenAI-compatible HTTP server over an `EngineThread` (FastAPI, Server-Sent Events for streams).

    POST /v1/completions        prompt text or token ids (one or a list), max_tokens, temperature, top_p,
                                top_k, seed, stop, stop_token_ids, ignore_eos, stream (+ stream_options.
                                include_usage), logprobs (0-5), echo (the prompt, with its log-probabilities),
                                return_tokens_as_token_ids (vLLM's: logprobs tokens as "token_id:N")
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template; logprobs, top_logprobs
    GET  /v1/models, /health (503 while warming up or draining), /metrics (Prometheus text)

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 naming the bad field,
404 for an unknown route, 429 when the waiting queue is full, 503 while warming up or draining. A client
that disconnects cancels its requests, which frees their slots. The server never touches arrays: it
turns JSON into token ids and `SamplingParams`, and `Delta`s back into JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from rq_jax.serve.chat import ChatTemplate, ChatTemplateError
from rq_jax.serve.engine import Delta, ParamError, SamplingParams, TokenLogprob
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.serve.programs import TOP_LOGPROBS
from rq_jax.serve.runner import EngineThread, NotReady, QueueFull

#: How often a non-streaming request checks whether its client is still there (seconds).
DISCONNECT_POLL = 0.1


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.kind)


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


# ---- request parsing -------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, name: str, default: float, check: Callable[[float], bool], what: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not check(value):
        raise APIError(400, f"{name} must be {what}, got {json.dumps(value)}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, check: Callable[[int], bool], what: str) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not check(value):
        raise APIError(400, f"{name} must be {what}, got {json.dumps(value)}", name)
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {json.dumps(value)}", name)
    return value


def _unsupported(body: dict) -> None:
    """400 for the OpenAI fields this server does not implement, when set to anything but their no-op."""
    if body.get("n", 1) not in (1, None):
        raise APIError(400, f"n must be 1 (one choice per prompt), got {json.dumps(body['n'])}", "n")
    if body.get("best_of", 1) not in (1, None):
        raise APIError(400, "best_of is not supported (it must be 1)", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, 0) not in (0, None):
            raise APIError(400, f"{name} is not supported (it must be 0)", name)
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise APIError(400, "suffix is not supported", "suffix")


def sampling_params(body: dict, max_tokens_field: str = "max_tokens", logprobs: int = 0,
                    echo: bool = False) -> SamplingParams:
    """`SamplingParams` from an OpenAI request body; APIError(400) naming the first bad field.

    OpenAI's defaults: max_tokens 16, temperature 1. A request without a seed is greedy-reproducible
    (seed 0, the Sampler's) at temperature 0 and drawn from a fresh random seed otherwise."""
    _unsupported(body)
    max_tokens = _integer(body, max_tokens_field, 16, lambda v: v >= 1, "an integer ≥ 1")
    temperature = _number(body, "temperature", 1.0, lambda v: v >= 0, "a finite number ≥ 0")
    top_p = _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _integer(body, "top_k", 0, lambda v: v >= -1, "an integer ≥ 0 (0 or -1: off)")
    seed = _integer(body, "seed", None, lambda v: True, "an integer")
    if seed is None:
        seed = 0 if temperature == 0 else secrets.randbelow(2**31)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop must be a string or a list of strings, got {json.dumps(body.get('stop'))}", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise APIError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                              seed=seed % 2**31, stop=tuple(s for s in stop if s), stop_token_ids=tuple(stop_ids),
                              ignore_eos=_boolean(body, "ignore_eos"), logprobs=logprobs, prompt_logprobs=echo)
    except ParamError as err:
        raise APIError(400, str(err), err.param) from None


def prompts_of(body: dict, tokenizer) -> list[list[int]]:
    """The completion request's prompts as token ids: a string, a list of strings, a list of ids, or a
    list of lists of ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such "
                       "lists", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(tokenizer.encode(p).ids)
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            out.append(list(p))
        else:
            raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                           "such lists", "prompt")
    return out


def messages_of(body: dict) -> list[dict]:
    """The chat request's messages: a non-empty list of {role, content} with string content (or text parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # text parts
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        out.append({**m, "content": content})
    return out


# ---- responses -----------------------------------------------------------------------------------


class _Choice:
    """What one prompt's request has produced (text, tokens, log-probabilities), from its deltas."""

    def __init__(self, index: int, request_id: str, prompt: list[int]):
        self.index, self.request_id, self.prompt = index, request_id, prompt
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.logprobs += delta.logprobs
        self.num_tokens += len(delta.tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason


class Server:
    """The routes' shared state: the engine thread, tokenizer, model name, chat template and metrics."""

    def __init__(self, runner: EngineThread, tokenizer, model_name: str, chat_template: ChatTemplate | None,
                 metrics: ServeMetrics):
        self.runner, self.tokenizer, self.model_name = runner, tokenizer, model_name
        self.chat_template, self.metrics = chat_template, metrics
        self._ids = itertools.count()

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(400, f"model {json.dumps(model)} is not served here; this server serves "
                           f"{json.dumps(self.model_name)}", "model", "model_not_found")

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[_Choice], asyncio.Queue]:
        """Queue one request per prompt; their deltas arrive on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(delta: Delta) -> None:
            loop.call_soon_threadsafe(events.put_nowait, delta)

        choices: list[_Choice] = []
        try:
            for i, prompt in enumerate(prompts):
                choice = _Choice(i, f"{uuid.uuid4().hex[:12]}-{next(self._ids)}", prompt)
                self.runner.submit(prompt, params, sink, choice.request_id)
                choices.append(choice)
        except (NotReady, QueueFull, ParamError) as err:
            self.cancel(choices)
            if isinstance(err, NotReady):
                raise APIError(503, str(err), None, "service_unavailable") from None
            if isinstance(err, QueueFull):
                raise APIError(429, f"the server is busy: {err}; retry later", None, "rate_limit_exceeded") from None
            raise APIError(400, str(err), err.param) from None
        return choices, events

    def cancel(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.finish_reason is None:
                self.runner.cancel(c.request_id)

    async def results(self, request: Request, choices: list[_Choice], events: asyncio.Queue) -> None:
        """Wait for every choice to finish; a client that disconnects meanwhile cancels them (APIError 499)."""
        by_id = {c.request_id: c for c in choices}
        pending = len(choices)
        try:
            while pending:
                try:
                    delta = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "the client disconnected") from None
                    continue
                choice = by_id[delta.request_id]
                choice.add(delta)
                pending -= delta.finish_reason is not None
        finally:
            self.cancel(choices)

    async def stream(self, choices: list[_Choice], events: asyncio.Queue, chunk: Callable[[_Choice, Delta], dict],
                     first: Callable[[_Choice], dict | None], usage: Callable[[], dict] | None) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta (and an opening one per choice when `first` gives one),
        a usage chunk when asked for, then [DONE]. Closing the stream early cancels what is left."""
        by_id = {c.request_id: c for c in choices}
        pending = len(choices)
        try:
            for c in choices:
                opening = first(c)
                if opening is not None:
                    yield f"data: {json.dumps(opening)}\n\n"
            while pending:
                delta = await events.get()
                choice = by_id[delta.request_id]
                choice.add(delta)
                pending -= delta.finish_reason is not None
                if delta.finish_reason == "cancelled":
                    return
                yield f"data: {json.dumps(chunk(choice, delta))}\n\n"
            if usage is not None:
                yield f"data: {json.dumps(usage())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.cancel(choices)

    def usage(self, choices: list[_Choice]) -> dict:
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

    def completion_choice(self, c: _Choice, want_logprobs: bool, echo: bool, as_ids: bool) -> dict:
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

    async def completions(self, request: Request) -> Response:
        body = await json_body(request)
        self.check_model(body)
        stream = _boolean(body, "stream")
        echo = _boolean(body, "echo")
        as_ids = _boolean(body, "return_tokens_as_token_ids")
        logprobs = _integer(body, "logprobs", None, lambda v: 0 <= v <= TOP_LOGPROBS,
                            f"an integer in [0, {TOP_LOGPROBS}]")
        params = sampling_params(body, logprobs=logprobs or 0, echo=echo and logprobs is not None)
        prompts = prompts_of(body, self.tokenizer)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        choices, events = self.submit(prompts, params)
        head = dict(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
                    model=self.model_name)
        if stream:
            def chunk(c: _Choice, d: Delta) -> dict:
                lp = None
                if logprobs is not None:
                    lp = self.completion_logprobs(list(d.logprobs), [e.token for e in d.logprobs], as_ids)
                return {**head, "choices": [dict(index=c.index, text=d.text, logprobs=lp,
                                                 finish_reason=d.finish_reason)]}

            def first(c: _Choice) -> dict | None:
                if not echo:
                    return None
                return {**head, "choices": [dict(index=c.index, text=self.tokenizer.decode(c.prompt), logprobs=None,
                                                 finish_reason=None)]}

            def usage() -> dict:
                return {**head, "choices": [], "usage": self.usage(choices)}

            return sse(self.stream(choices, events, chunk, first, usage if include_usage else None))
        await self.results(request, choices, events)
        return JSONResponse({**head, "choices": [self.completion_choice(c, logprobs is not None, echo, as_ids)
                                                 for c in choices], "usage": self.usage(choices)})

    # ---- chat --------------------------------------------------------------------------------------

    def chat_logprobs(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob], top: bool) -> dict:
        def item(token: int, lp: float) -> dict:
            text = self.token_text(token)
            return dict(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

        return dict(content=[{**item(e.token, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top] if top
                              else []} for e in entries])

    async def chat_completions(self, request: Request) -> Response:
        body = await json_body(request)
        self.check_model(body)
        if self.chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json's chat_template); "
                           "use /v1/completions", "messages")
        messages = messages_of(body)
        stream = _boolean(body, "stream")
        want = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, lambda v: 0 <= v <= TOP_LOGPROBS, f"an integer in [0, {TOP_LOGPROBS}]")
        if top and not want:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        params = sampling_params(body, field, logprobs=top)
        try:
            text = self.chat_template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as err:
            raise APIError(400, str(err), "messages") from None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        choices, events = self.submit([self.tokenizer.encode(text).ids], params)
        head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
                    model=self.model_name)
        if stream:
            head["object"] = "chat.completion.chunk"

            def chunk(c: _Choice, d: Delta) -> dict:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                return {**head, "choices": [dict(index=c.index, delta=delta, finish_reason=d.finish_reason,
                                                 logprobs=self.chat_logprobs(d.logprobs, bool(top)) if want else None)]}

            def first(c: _Choice) -> dict:
                return {**head, "choices": [dict(index=c.index, delta={"role": "assistant", "content": ""},
                                                 logprobs=None, finish_reason=None)]}

            def usage() -> dict:
                return {**head, "choices": [], "usage": self.usage(choices)}

            return sse(self.stream(choices, events, chunk, first, usage if include_usage else None))
        await self.results(request, choices, events)
        return JSONResponse({**head, "choices": [
            dict(index=c.index, message={"role": "assistant", "content": "".join(c.text)},
                 finish_reason=c.finish_reason, logprobs=self.chat_logprobs(c.logprobs, bool(top)) if want else None)
            for c in choices],
            "usage": self.usage(choices)})


async def json_body(request: Request) -> dict:
    """The request's JSON object; APIError(400) when it is not one."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(server: Server, on_shutdown: Callable[[], Any] | None = None) -> FastAPI:
    """The FastAPI app of `server` (its engine thread started and stopped with the app's lifespan)."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.runner.start()
        yield
        server.runner.stop()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="rq_jax", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), None, "not_found" if err.status_code == 404 else
                              "invalid_request_error")

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        return error_response(500, f"internal error: {type(err).__name__}: {err}", None, "server_error")

    @app.get("/health")
    async def health():
        if server.runner.ready:
            return {"status": "ok"}
        return error_response(503, f"the server is {server.runner.state}", None, "service_unavailable")

    @app.get("/v1/models")
    async def models():
        engine = server.runner.engine
        return {"object": "list", "data": [dict(id=server.model_name, object="model", created=0, owned_by="rq_jax",
                                                max_model_len=engine.max_len)]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    return app
