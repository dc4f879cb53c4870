"""``infer.py --serve --api-key`` (or ``$K3JAX_API_KEY``; k3jax/serving/auth.py), through the ``openai``
client as a user meets it: no key or another key is 401 (``openai.AuthenticationError``, OpenAI's error
body), the key is 200, ``/health`` stays open. The engine is scripted (tests/test_server_shutdown.py), so no
model runs."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

import openai
import pytest

from k3jax.serving.server import add_arguments
from k3jax.tokenizer import ByteTokenizer
from test_server_shutdown import SlowEngine
from test_serving import running_server

KEY = "sk-k3jax-test"


@pytest.fixture(scope="module")
def url():
    with running_server(SlowEngine(), tokenizer=ByteTokenizer(), api_key=KEY) as url:
        yield url


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.parametrize("key", ["none", "sk-wrong"])  # (the client cannot send no key: "none" is the usual filler)
def test_requests_with_another_key_are_401(url, key):
    for call in (lambda c: c.completions.create(model="tiny", prompt="hi", max_tokens=2),
                 lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2),
                 lambda c: c.models.list()):
        with pytest.raises(openai.AuthenticationError) as err:
            call(_client(url, key))
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key" and err.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/metrics"])
def test_requests_without_a_key_are_401(url, path):
    """No Authorization header (curl without -H): every path but /health, refused before its body is read."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode() if path != "/metrics" else None
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(url + path, data=body), timeout=30)
    assert err.value.code == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(err.value.read())["error"]["code"] == "invalid_api_key"


def test_requests_with_the_key_are_served(url):
    c = _client(url, KEY)
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=3).choices[0].text == "aaa"
    stream = c.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == "aa"
    assert [m.id for m in c.models.list()] == ["tiny"]


def test_health_stays_open(url):
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}


def test_the_option_and_its_environment_variable(monkeypatch):
    def parse(*argv):
        ap = argparse.ArgumentParser()
        add_arguments(ap)
        return ap.parse_args(list(argv)).api_key

    monkeypatch.delenv("K3JAX_API_KEY", raising=False)
    assert parse() is None and parse("--api-key", "k1") == "k1"
    monkeypatch.setenv("K3JAX_API_KEY", "k2")
    assert parse() == "k2" and parse("--api-key", "k1") == "k1"
