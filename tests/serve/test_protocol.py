"""The request models and their errors, in process: `create_app` over a stand-in engine thread that
records each request's `SamplingParams` and finishes it at once (no model, no compile)."""

import pathlib

import pytest
from fastapi.testclient import TestClient

from rq_jax.serve.api import Server, create_app
from rq_jax.serve.chat import ChatTemplate
from rq_jax.serve.output import Delta
from rq_jax.serve.params import SamplingParams
from rq_jax.serve.metrics import ServeMetrics
from rq_jax.tokenizer import load_tokenizer

FOLDER = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "huginn-small"


class Runner:
    """An engine thread that answers every request with one token ("7", finish_reason length)."""

    ready, state = True, "ready"

    def __init__(self, tokenizer):
        self.engine = type("Engine", (), {"max_len": 48})()
        self.token = tokenizer.encode("7").ids[0]
        self.params: list[SamplingParams] = []

    def start(self):
        return self

    def stop(self):
        pass

    def submit(self, prompt, params, sink, request_id):
        self.params.append(params)
        sink(Delta(request_id, "7", (self.token,), (), "length"))

    def cancel(self, request_id):
        pass


@pytest.fixture(scope="module")
def api():
    tokenizer = load_tokenizer(FOLDER)
    runner = Runner(tokenizer)
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    app = create_app(Server(runner, tokenizer, "tiny", template, ServeMetrics("tiny", "dense")))
    with TestClient(app) as client:
        client.runner = runner
        yield client


def error(r, status=400) -> dict:
    assert r.status_code == status, r.text
    (body,) = r.json().values()
    assert set(body) == {"message", "type", "param", "code"} and "\n" not in body["message"]
    return body


def test_a_request_maps_to_sampling_params_with_openais_defaults(api):
    r = api.post("/v1/completions", json=dict(prompt="1+1=", temperature=0, top_k=-1, seed=2**31 + 3,
                                              stop=["", "\n"], stop_token_ids=[0], logprobs=2, echo=True))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "1+1=7"
    assert api.runner.params[-1] == SamplingParams(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=3,
                                                   stop=("\n",), stop_token_ids=(0,), logprobs=2,
                                                   prompt_logprobs=True)
    chat = dict(messages=[{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text",
                                                                                          "text": "1="}]}])
    r = api.post("/v1/chat/completions", json=dict(chat, max_completion_tokens=3, logprobs=True, top_logprobs=1))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "7"
    params = api.runner.params[-1]
    assert (params.max_tokens, params.logprobs, params.temperature) == (3, 1, 1.0) and params.seed < 2**31


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/completions", b"{not json", None, "the request body is not valid JSON: Expecting property name"),
    ("/v1/completions", b"[1, 2]", None, "the request body must be a JSON object"),
    ("/v1/completions", dict(prompt="1+1=", min_p=0.1), "min_p", "Unrecognized request argument supplied: min_p"),
    ("/v1/completions", dict(prompt="1+1=", stream_options={"usage": True}), "stream_options",
     "Unrecognized request argument supplied: stream_options.usage"),
    ("/v1/completions", dict(max_tokens=3), "prompt", "prompt is required: a string, a list of strings"),
    ("/v1/completions", dict(prompt=["1+", 5]), "prompt", 'prompt must be a string, a list of strings, a list of '
     'token ids or a list of such lists, got ["1+", 5]'),
    ("/v1/completions", dict(prompt="1+1=", max_tokens="8"), "max_tokens", 'max_tokens must be an integer ≥ 1, '
     'got "8"'),
    ("/v1/completions", dict(prompt="1+1=", max_tokens=0), "max_tokens", "max_tokens must be an integer ≥ 1, got 0"),
    ("/v1/completions", dict(prompt="1+1=", temperature=True), "temperature", "temperature must be a finite number"),
    ("/v1/completions", dict(prompt="1+1=", top_k=-2), "top_k", "top_k must be an integer ≥ 0 (0: off), got -2"),
    ("/v1/completions", dict(prompt="1+1=", presence_penalty=0.5), "presence_penalty", "presence_penalty must be 0"),
    ("/v1/completions", dict(prompt="1+1=", logit_bias={"5": 1}), "logit_bias", "logit_bias must be empty"),
    ("/v1/completions", dict(prompt="1+1=", best_of=2), "best_of", "best_of must be 1 (best_of is not supported)"),
    ("/v1/chat/completions", dict(messages=[{"role": "user"}]), "messages", "messages must be a non-empty list"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "1"}], max_completion_tokens=0),
     "max_completion_tokens", "max_completion_tokens must be an integer ≥ 1, got 0"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "1"}], logprobs=True, top_logprobs=9),
     "top_logprobs", "top_logprobs must be an integer in [0, 5], got 9"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "1"}], logprobs=2), "logprobs",
     "logprobs must be true or false, got 2"),
])
def test_a_bad_body_is_one_line_naming_its_field(api, path, body, param, message):
    kw = dict(content=body) if isinstance(body, bytes) else dict(json=body)
    e = error(api.post(path, **kw))
    assert (e["param"], e["type"], e["code"]) == (param, "invalid_request_error", None)
    assert e["message"].startswith(message), e["message"]
    assert api.post("/v1/completions", json=dict(prompt="1+1=")).status_code == 200  # and it serves on


def test_json_in_another_content_type_and_an_unknown_model(api):
    e = error(api.post("/v1/completions", content=b'{"prompt": "1"}', headers={"content-type": "text/plain"}))
    assert "Content-Type: application/json" in e["message"]
    e = error(api.post("/v1/completions", json=dict(model="gpt-4", prompt="1")), 404)
    assert (e["param"], e["type"], e["code"]) == ("model", "invalid_request_error", "model_not_found")
    assert api.post("/v1/completions", json=dict(model="tiny", prompt="1")).status_code == 200
