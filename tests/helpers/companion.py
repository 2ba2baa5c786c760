"""The companion tests' shared pieces: the server's test key, a raw HTTP request, the error
shape, and the tiny text companion run with its events."""

import contextlib
import http.client
import json

import numpy as np

from helpers import tiny_configs
from nested.run import train

KEY = "test-key-0123"


def http_request(server, method, path, body=b"", *, key=KEY, headers=()):
    """``(status, headers, decoded JSON or bytes)`` of one raw request (http.client: nothing
    between the test and the server)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    sent = {"content-type": "application/json", **dict(headers)}
    if key is not None:
        sent["authorization"] = f"Bearer {key}"
    connection.request(method, path, body, sent)
    response = connection.getresponse()
    content = response.read()
    connection.close()
    with contextlib.suppress(ValueError):
        content = json.loads(content)
    return response.status, {k.lower(): v for k, v in response.getheaders()}, content


def assert_error_shape(content):
    assert isinstance(content, dict) and list(content) == ["error"], content
    assert isinstance(content["error"], str) and "\n" not in content["error"]


def text_run(tmp_path_factory):
    """A workdir of the tiny companion config, text variant, trained a few steps."""
    path = tmp_path_factory.mktemp("companion_text")
    train.train_and_evaluate(tiny_configs.config("companion", task__text=True), path)
    return path


def events(task, seed, count=1):
    """``count`` sequences of agent 0 in session 0: ``(text, token ids)``."""
    rng = np.random.default_rng(seed)
    agent = task.agent(0, 0)
    sentences, ids = [], []
    for _ in range(count):
        inputs, answers = task.sequence(agent, 0, rng)
        sentences += [task.sentence(x, y) for x, y in zip(inputs, answers, strict=True)]
        ids += task.encode(inputs, answers).tolist()
    return " ".join(sentences), ids
