"""The OpenAI request bodies as pydantic models, and what the server makes of them: `SamplingParams`,
token-id prompts, chat messages, and OpenAI's error for a body the models refuse.

Validation runs once per boundary. The models check the JSON: each field's type (strict: no "1" for
1, no true for 1), the prompt's and the messages' shapes, and OpenAI's fields this server does not
implement (n, best_of, the penalties, logit_bias, suffix), accepted only at their no-op values. The
sampling values' ranges (max_tokens ≥ 1, top_p in (0, 1], ...) are `SamplingParams`'s own checks, which
every caller of the engine gets; `sampling_params` maps a request onto it and names the request's field
when it refuses one. What only the engine can know (the vocabulary, a slot's length) is `Engine.check`'s.

Unknown fields are refused (400 "Unrecognized request argument supplied: NAME", the field as `param`),
as OpenAI's API refuses them. vLLM accepts and ignores them with a logged warning (its protocol's
`extra="allow"`); here a sampling option of another server (min_p, repetition_penalty) would then change
nothing while the client believed it did, with no sign in the answer. Chat messages are the exception:
their extra keys (name, tool_calls, ...) go to the chat template, which may read them.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from rq_jax.serve.params import ParamError, SamplingParams
from rq_jax.serve.programs import TOP_LOGPROBS


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        """The error's JSON."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """Unknown fields refused, JSON types taken as they are (no "1" for 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


#: A list of at least one item (a prompt's list forms).
_NON_EMPTY = Field(min_length=1)


class StreamOptions(_Strict):
    """OpenAI's stream_options: include_usage adds a usage chunk before [DONE]."""

    include_usage: bool = Field(False, description="true or false")


class TextPart(_Strict):
    """A text part of a message's content (the only kind served)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; keys beyond role and content are kept for the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart]


class OpenAIRequest(_Strict):
    """The fields both endpoints share (OpenAI's, and vLLM's top_k, ignore_eos, stop_token_ids). Defaults
    are OpenAI's: max_tokens 16, temperature 1; top_k -1 is vLLM's "off", as 0 is."""

    model: str | None = Field(None, description="a string: the served model's id (/v1/models)")
    max_tokens: int | None = Field(None, description="an integer ≥ 1")
    temperature: float | None = Field(None, description="a finite number ≥ 0")
    top_p: float | None = Field(None, description="a number in (0, 1]")
    top_k: int | None = Field(None, description="an integer ≥ 0 (0 or -1: off)")
    seed: int | None = Field(None, description="an integer")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    stop_token_ids: list[int] | None = Field(None, description="a list of integers")
    ignore_eos: bool | None = Field(None, description="true or false")
    stream: bool | None = Field(None, description="true or false")
    stream_options: StreamOptions | None = Field(None, description='{"include_usage": true or false}')
    user: str | None = Field(None, description="a string (OpenAI's end-user id; not used)")
    n: Literal[1] | None = Field(None, description="1 (one choice per prompt)")
    presence_penalty: Literal[0] | None = Field(None, description="0 (penalties are not supported)")
    frequency_penalty: Literal[0] | None = Field(None, description="0 (penalties are not supported)")
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = Field(
        None, description="empty (logit_bias is not supported)")

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions: a prompt (text or token ids, one or a list); logprobs alternatives per token,
    echo (the prompt, with its log-probabilities when logprobs is set), and vLLM's
    return_tokens_as_token_ids ("token_id:N" for the logprobs tokens)."""

    prompt: (str | Annotated[list[str], _NON_EMPTY] | Annotated[list[int], _NON_EMPTY]
             | Annotated[list[list[int]], _NON_EMPTY]) = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists")
    logprobs: int | None = Field(None, description=f"an integer in [0, {TOP_LOGPROBS}]")
    echo: bool | None = Field(None, description="true or false")
    return_tokens_as_token_ids: bool | None = Field(None, description="true or false")
    best_of: Literal[1] | None = Field(None, description="1 (best_of is not supported)")
    suffix: Literal[""] | None = Field(None, description="empty (suffix is not supported)")

    def prompts(self, tokenizer) -> list[list[int]]:
        """The prompts as token ids, one list per prompt (text through `tokenizer`)."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            prompt = [prompt]
        return [tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in prompt]


class ChatCompletionRequest(OpenAIRequest):
    """POST /v1/chat/completions: messages rendered with the checkpoint's chat template; OpenAI's
    max_completion_tokens (max_tokens is its older name), logprobs and top_logprobs."""

    messages: list[ChatMessage] = Field(min_length=1, description="a non-empty list of {role, content} objects "
                                        "with string content (or text parts)")
    max_completion_tokens: int | None = Field(None, description="an integer ≥ 1")
    logprobs: bool | None = Field(None, description="true or false")
    top_logprobs: int | None = Field(None, description=f"an integer in [0, {TOP_LOGPROBS}]")

    def message_dicts(self) -> list[dict]:
        """The messages as the chat template reads them: dicts, text parts joined into one string."""
        return [{**m.model_dump(), "content": m.content if isinstance(m.content, str) else
                 "".join(part.text for part in m.content)} for m in self.messages]


def sampling_params(request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's `SamplingParams` (OpenAI's defaults filled in); APIError(400) naming the request's
    field when `SamplingParams` refuses a value. A request without a seed is greedy-reproducible (seed 0,
    the Sampler's) at temperature 0 and drawn from a fresh random seed otherwise."""
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        logprobs_field, logprobs, echo = "top_logprobs", request.top_logprobs, False
    else:
        max_field, logprobs_field, logprobs = "max_tokens", "logprobs", request.logprobs
        echo = bool(request.echo) and logprobs is not None
    max_tokens = getattr(request, max_field)
    temperature = 1.0 if request.temperature is None else request.temperature
    seed = request.seed
    if seed is None:
        seed = 0 if temperature == 0 else secrets.randbelow(2**31)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    try:
        return SamplingParams(max_tokens=16 if max_tokens is None else max_tokens, temperature=temperature,
                              top_p=1.0 if request.top_p is None else request.top_p,
                              top_k=0 if request.top_k in (None, -1) else request.top_k, seed=seed % 2**31,
                              stop=tuple(s for s in stop if s), stop_token_ids=tuple(request.stop_token_ids or ()),
                              ignore_eos=bool(request.ignore_eos), logprobs=logprobs or 0, prompt_logprobs=echo)
    except ParamError as err:  # its message begins with its own field's name: say the request's instead
        field = {"max_tokens": max_field, "logprobs": logprobs_field}.get(err.param, err.param)
        raise APIError(400, field + str(err).removeprefix(err.param), field) from None


def _shown(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def request_error(model: type[BaseModel], errors: Sequence[dict], body: Any) -> APIError:
    """OpenAI's 400 for a body `model` refused (pydantic's `errors`, locations starting at "body" as
    FastAPI reports them): a one-line message about the first error, naming its top-level field as
    `param` with that field's description ("max_tokens must be an integer ≥ 1, got "8"")."""
    error = errors[0]
    loc = tuple(error["loc"])[1:]
    if error["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {error.get('ctx', {}).get('error', '')}")
    if not loc or not isinstance(body, dict):
        return APIError(400, "the request body must be a JSON object (sent as Content-Type: application/json)")
    name = str(loc[0])
    if error["type"] == "extra_forbidden":  # a nested one (stream_options.x) by its path
        return APIError(400, f"Unrecognized request argument supplied: {'.'.join(map(str, loc))}", name)
    what = model.model_fields[name].description
    if name not in body:
        return APIError(400, f"{name} is required: {what}", name)
    return APIError(400, f"{name} must be {what}, got {_shown(body[name])}", name)
