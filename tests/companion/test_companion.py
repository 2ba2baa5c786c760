"""The Agent Companion service: the real server process on loopback with a real SQLite file.

Isolation, bad input, durability across SIGKILL and restart, a damaged state row, and many
concurrent clients, each checked against the Python API replaying the same events.
"""

import hashlib
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from flax import serialization
from helpers import tiny_configs
from helpers.companion import KEY, assert_error_shape, http_request

from nested.companion.client import SERVE, Client, ServerProcess
from nested.companion.engine import Companion, CompanionError
from nested.companion.server import MAX_BODY
from nested.companion.store import SQLiteStore
from nested.run import config as nc
from nested.run import loading, pieces, train
from nested.run.checkpoint import CheckpointError
from nested.run.loading import Trained
from nested.run.locks import Busy

sys.path.insert(0, str(tiny_configs.ROOT / "experiments"))
from studies.companion import baselines, study  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The tiny companion config trained a few steps."""
    path = tmp_path_factory.mktemp("companion")
    train.train_and_evaluate(tiny_configs.config("companion"), path)
    return path


class Server(ServerProcess):
    """The server process; ``request`` talks to it with the API key by default."""

    def request(self, method, path, body=None, *, key=KEY, raw=None):
        client = Client(self.client.base, key)
        return client.request(method, path, body, raw=raw)

    def kill(self, sig=signal.SIGKILL):
        self.stop(sig)


@pytest.fixture(scope="module")
def server(workdir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    key_file = directory / "key"
    key_file.write_text(KEY + "\n")
    served = Server(workdir, directory / "agents.sqlite", api_key_file=key_file, max_batch=64)
    yield served
    served.kill(signal.SIGTERM)


def replay(workdir, tmp_path, events: dict[str, list[list[int]]]):
    """Each agent's events observed in order through the Python API on a fresh store:
    ``{agent: state}``."""
    companion = Companion.open(workdir, tmp_path / "replay.sqlite")
    rounds = max(len(e) for e in events.values())
    for r in range(rounds):
        companion.observe({a: e[r] for a, e in events.items() if r < len(e)})
    states, _, errors = companion.states(list(events))
    assert not errors
    return companion, states


def served_state(server, companion, agent):
    status, data = server.request("GET", f"/agents/{agent}/export")
    assert status == 200, data
    content = serialization.msgpack_restore(data)
    return serialization.from_state_dict(companion.template, content["state"])


def assert_states_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)


def tokens(seed, events=2):
    """``events`` events of the tiny task (4 tokens each: 3 features, a label)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(events):
        out += (1 + rng.choice(8, 3, replace=False)).tolist() + [int(9 + rng.integers(4))]
    return out


def test_agents_are_isolated_and_bad_input_writes_nothing(server):
    assert server.request("POST", "/agents/b/observe", {"tokens": tokens(1)})[0] == 200
    before = server.request("GET", "/agents/b/export")[1]
    status, body = server.request("POST", "/agents/a/observe", {"tokens": tokens(2)})
    assert status == 200 and body == {"agent_id": "a", "tokens": 8}
    weird = ["", "..%2Fb", "b%2F..%2Fa", "%C3%A9t%C3%A9", "a" * 10_000, "b.sqlite", "b%00"]
    for agent in weird:
        status, body = server.request("POST", f"/agents/{agent}/observe", {"tokens": tokens(3)})
        assert 400 <= status < 500, (agent, status)
        status, _ = server.request("GET", f"/agents/{agent}/export")
        assert 400 <= status < 500, (agent, status)
    bad = [
        ({"tokens": [1, 2, 99, 9]}, 422, "token ids in [1, 99], outside [0, 13)"),
        ({"tokens": [[1, 2, 3, 9]]}, 422, "tokens.0"),
        ({"tokens": []}, 422, "tokens"),
        ({"token": [1]}, 422, "tokens: Field required"),
    ]
    for body, status, message in bad:
        got, answer = server.request("POST", "/agents/b/observe", body)
        assert got == status and message in answer["error"] and "\n" not in answer["error"]
    nan = b'{"tokens": [1, NaN, 3, 9]}'
    assert server.request("POST", "/agents/b/observe", raw=nan)[0] == 422
    # A body announced over the limit is refused before it is read (headers only sent here:
    # a client still writing a body the server refused may see the connection closed).
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.putrequest("POST", "/agents/b/observe")
    connection.putheader("content-type", "application/json")
    connection.putheader("authorization", f"Bearer {KEY}")
    connection.putheader("content-length", str(2 << 20))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "limit" in json.loads(response.read())["error"]
    connection.close()
    assert server.request("POST", "/agents/b/observe", {"tokens": tokens(4)}, key=None)[0] == 401
    assert server.request("POST", "/agents/b/observe", {"tokens": tokens(4)}, key="nope")[0] == 401
    assert server.request("GET", "/agents/b/export")[1] == before  # bitwise
    status, fresh = server.request("POST", "/agents/nobody/recall", {"queries": [[1, 2, 3]]})
    probs = fresh["probs"][0]
    assert status == 200 and len(set(fresh["tokens"][0])) == 5  # the top 5, distinct tokens
    assert probs == sorted(probs, reverse=True) and probs[-1] > 0 and sum(probs) <= 1 + 1e-6
    assert server.request("GET", "/agents/nobody")[1]["tokens"] == 0  # recall wrote nothing


def test_many_concurrent_clients_lose_no_update(server, workdir, tmp_path):
    agents = [f"load-{i}" for i in range(200)]
    events = {a: [tokens(100 * i + r) for r in range(3)] for i, a in enumerate(agents)}
    errors = []

    def client(mine):
        for r in range(3):
            for a in mine:
                status, body = server.request(
                    "POST", f"/agents/{a}/observe", {"tokens": events[a][r]}
                )
                if status != 200:
                    errors.append((a, status, body))

    threads = [threading.Thread(target=client, args=(agents[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    companion, expected = replay(workdir, tmp_path, events)
    for a in agents[::7]:
        assert server.request("GET", f"/agents/{a}")[1]["tokens"] == 24
        assert_states_close(served_state(server, companion, a), expected[a])


def test_a_second_writer_on_a_served_store_is_refused_and_no_observe_is_lost(server, workdir):
    """While clients observe through the server, a second server and the Python API on the
    same store are refused in one line naming the holder; every acknowledged token is kept."""
    agents = [f"two-{i}" for i in range(4)]
    acked = dict.fromkeys(agents, 0)

    def client(agent):
        for r in range(6):
            status, _ = server.request("POST", f"/agents/{agent}/observe", {"tokens": tokens(r)})
            assert status == 200
            acked[agent] += 8

    threads = [threading.Thread(target=client, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    with pytest.raises(RuntimeError) as info:
        Server(workdir, server.store)
    pid = server.process.pid
    assert f"error: companion store {server.store} is in use by pid {pid} on host" in str(
        info.value
    )
    with pytest.raises(Busy, match=f"is in use by pid {pid} on host"):
        Companion.open(workdir, server.store)
    for t in threads:
        t.join(timeout=300)
    assert all(server.request("GET", f"/agents/{a}")[1]["tokens"] == acked[a] for a in agents)
    assert sum(acked.values()) == 4 * 6 * 8


@pytest.mark.slow
def test_a_killed_server_keeps_every_acknowledged_observe(workdir, tmp_path):
    store = tmp_path / "agents.sqlite"
    served = Server(workdir, store)
    assert served.request("POST", "/agents/victim/observe", {"tokens": tokens(9)})[0] == 200
    agents = [f"k{i}" for i in range(6)]
    events = {a: [tokens(1000 * i + r) for r in range(40)] for i, a in enumerate(agents)}
    acked = dict.fromkeys(agents, 0)

    def client(agent):
        for r, observed in enumerate(events[agent]):
            try:
                path = f"/agents/{agent}/observe"
                status, _ = served.request("POST", path, {"tokens": observed})
            except OSError:
                return
            if status != 200:
                return
            acked[agent] = r + 1

    threads = [threading.Thread(target=client, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    while sum(acked.values()) < 30:
        time.sleep(0.05)
    served.kill(signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    with sqlite3.connect(store) as db:  # damage one row while the server is down
        db.execute("UPDATE agents SET state = substr(state, 1, 40) WHERE id = 'victim'")
    restarted = Server(workdir, store)
    try:
        stored = {a: restarted.request("GET", f"/agents/{a}")[1]["tokens"] for a in agents}
        for a in agents:  # whole observes only; at least every acknowledged one
            assert stored[a] % 8 == 0 and stored[a] // 8 >= acked[a], (a, stored[a], acked[a])
        prefix = {a: events[a][: stored[a] // 8] for a in agents if stored[a]}
        companion, expected = replay(workdir, tmp_path, prefix)
        for a in prefix:
            assert_states_close(served_state(restarted, companion, a), expected[a])
        # The damaged row fails its agent's requests with a clear error; the others are served.
        status, body = restarted.request("POST", "/agents/victim/observe", {"tokens": tokens(7)})
        assert status == 409 and "'victim'" in body["error"] and "damaged" in body["error"]
        assert restarted.request("POST", "/agents/victim/recall", {"queries": [[1]]})[0] == 409
        assert restarted.request("POST", "/agents/k1/observe", {"tokens": tokens(7)})[0] == 200
    finally:
        restarted.kill(signal.SIGTERM)


def test_the_python_api_refuses_another_models_state(workdir, tmp_path):
    companion = Companion.open(workdir, tmp_path / "a.sqlite")
    companion.observe({"a": tokens(1)})
    data = companion.export_agent("a")
    content = serialization.msgpack_restore(data)
    content["fingerprint"] = json.dumps({"architecture": "0" * 16, "step": 8})
    with pytest.raises(CompanionError, match="written by another model"):
        companion.import_agent("b", serialization.msgpack_serialize(content))
    with pytest.raises(CompanionError, match="agent id '../a' is not valid"):
        companion.observe({"../a": tokens(1)})
    with pytest.raises(CompanionError, match=r"token ids in \[99, 99\], outside \[0, 13\)"):
        companion.observe({"a": [99]})
    assert companion.store.count() == 1 and os.path.exists(tmp_path / "a.sqlite")
    with pytest.raises(Busy, match=r"companion store .*a\.sqlite is in use by pid \d+ on host"):
        SQLiteStore(tmp_path / "a.sqlite")  # one writer per store
    companion.store.close()
    assert SQLiteStore(tmp_path / "a.sqlite").count() == 1


def test_consolidate_applies_what_a_longer_period_accumulated(tmp_path):
    config = tiny_configs.config("companion")
    config.model.cms = ("fast_cms", "slow_cms")
    config.levels.fast_cms = nc.level_config("cms", every=4, persist="stream", lr=0.1)
    config.levels.slow_cms = nc.level_config("cms", every=8, persist="stream", lr=0.1)
    exp = nc.build(config)
    companion = Companion(Trained(exp, pieces.init_state(exp), 0), SQLiteStore(tmp_path / "s"))
    assert companion.period == 4
    companion.observe({"a": tokens(1, events=1)})  # 4 tokens: slow_cms has 4 pending
    before = companion.states(["a"])[0]["a"]
    companion.consolidate(["a"])
    after = companion.states(["a"])[0]["a"]
    fast_before, slow_before = before[0]["cms"]
    fast_after, slow_after = after[0]["cms"]
    jax.tree.map(np.testing.assert_array_equal, fast_before.params, fast_after.params)
    assert not np.allclose(slow_before.params[0]["w"], slow_after.params[0]["w"])
    assert int(slow_after.cache.tick[0]) == 0 and not np.any(slow_after.cache.accum[0]["w"])
    with pytest.raises(CompanionError, match="no level that consolidates"):
        plain = nc.build(tiny_configs.config("companion"))
        Companion(
            Trained(plain, pieces.init_state(plain), 0), SQLiteStore(tmp_path / "t")
        ).consolidate(["a"])


def test_retrieval_and_oracle_baselines():
    memory = baselines.Retrieval(capacity=2, k=1, recency=None)
    keys = np.eye(3)
    for key, answer in zip(keys, (0, 1, 2), strict=True):
        memory.add(key, answer)
    assert memory.predict(keys[2], 3) == 2 and memory.predict(keys[1], 3) == 1
    assert memory.predict(keys[0], 3) != 0  # evicted: only the 2 newest are kept
    recent = baselines.Retrieval(capacity=None, k=2, recency=1.0)
    recent.add(keys[0], 0)
    recent.add(keys[0], 1)  # the same key later: its answer weighs more
    assert recent.predict(keys[0], 2) == 1
    companion_task = nc.build(tiny_configs.config("companion")).task
    agent = companion_task.agent(0, 0)
    inputs = companion_task.draw_inputs(np.random.default_rng(0), 200)
    answers = companion_task.answers(agent.rule, inputs)
    w = baselines.fit_oracle(companion_task, inputs, answers, steps=500)
    x = np.concatenate([baselines.one_hot(companion_task, inputs), np.ones((200, 1))], axis=1)
    assert np.mean(np.argmax(x @ w.T, axis=1) == answers) > 0.9


@pytest.mark.slow
def test_the_study_runs_every_method_session_by_session(workdir):
    trained = loading.load_trained(workdir)
    settings = study.Settings(agents=4, queries=4, latency_agents=4, latency_runs=1)
    result = study.run(trained, settings)
    sessions = trained.experiment.task.sessions
    assert set(result["sessions"]) == set(study.METHODS)
    for rows in result["sessions"].values():
        for name in ("novel", "facts", "stale", "regret"):
            assert len(rows[name]["mean"]) == sessions
        assert rows["stale"]["mean"][0] == 0  # no drift yet in session 1
    assert result["bytes"]["knn_capacity"] == result["bytes"]["companion"] // (4 * 16 + 4)
    assert result["latency"]["observe_s"] > 0
    assert "companion: novel accuracy by session" in study.format_summary(result)


def test_serving_on_a_port_in_use_fails_at_once_in_one_line(workdir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, str(SERVE), f"--workdir={workdir}", f"--port={port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --host=127.0.0.1 --port={port}: cannot listen there (Address already in use); "
        "pass another --port (or stop what uses it)"
    )
    assert time.monotonic() - began < 30  # before the model loads
    assert not (workdir / "companion.sqlite").exists()  # nothing opened


def test_health_reports_the_fingerprint_as_an_object(server):
    status, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["vocab"] == 13
    assert body["tokenizer"] is None  # an id task: token ids only
    assert set(body["fingerprint"]) == {"architecture", "step"}
    assert len(body["fingerprint"]["architecture"]) == 16
    assert server.started.endswith(" bucket sizes in 0.0 s)")  # --warm_s=0: none warmed
    assert "(warmed 0 of " in server.started


@pytest.mark.slow
def test_more_training_does_not_lock_agents_out(workdir, tmp_path):
    """States written by the slow weights of an earlier step are served on (and stored as the
    new step's at their next observe) or refused, as chosen; export works either way."""
    store = tmp_path / "agents.sqlite"
    old = Companion.open(workdir, store)
    old.observe({"a": tokens(1)})
    old.store.close()
    trained = loading.load_trained(workdir)
    later = Trained(trained.experiment, trained.state, trained.step + 50)  # trained on since
    refusing = Companion(later, SQLiteStore(store), other_steps="refuse")
    assert refusing.other_writers() == [
        f"1 agent(s) written by the slow weights of step {trained.step}: refused (--other_steps)"
    ]
    (answer,) = refusing.recall({"a": [[1]]}).values()
    assert (
        f"slow weights of step {trained.step}, these are of step {trained.step + 50}"
        in (answer["error"])
    )
    exported = serialization.msgpack_restore(refusing.export_agent("a"))
    assert json.loads(exported["fingerprint"])["step"] == trained.step and exported["tokens"] == 8
    refusing.store.close()
    serving = Companion(later, SQLiteStore(store))
    assert "served on those of step" in serving.other_writers()[0]
    assert "error" not in serving.recall({"a": [[1]]})["a"]
    serving.observe({"a": tokens(2)})  # continued on the new weights, stored as theirs
    assert serving.other_writers() == [] and serving.tokens_observed("a") == 16
    serving.import_agent("b", serialization.msgpack_serialize(exported))
    assert "error" not in serving.recall({"b": [[1]]})["b"]


# -- issue 27: refuse before reading, strict types, validated imports, no redirects -------------

ENDPOINTS = [
    ("POST", "/agents/b/observe"),
    ("POST", "/agents/b/recall"),
    ("POST", "/agents/b/consolidate"),
    ("GET", "/agents/b"),
    ("DELETE", "/agents/b"),
    ("GET", "/agents/b/export"),
    ("PUT", "/agents/b/import"),
]


def chunked(server, path, chunks, *, key=KEY, end=True):
    """A raw ``Transfer-Encoding: chunked`` POST: each of ``chunks`` sent as a chunk (and the
    last chunk, if ``end``); ``(status, decoded JSON body)`` of the answer, which must come
    within 20 s."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        if key is not None:
            head += f"authorization: Bearer {key}\r\n"
        s.sendall((head + "transfer-encoding: chunked\r\n\r\n").encode())
        for chunk in chunks:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        if end:
            s.sendall(b"0\r\n\r\n")
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, json.loads(response.read())


@pytest.mark.slow
def test_the_steps_a_store_needs_survive_more_training_and_serve_with_step(workdir, tmp_path):
    """A store pins the checkpoints of the steps that wrote its agents: training on with
    ``keep_checkpoints=1`` keeps them, and ``serve.py --step`` serves those weights (the real
    server process), where the latest step serves them on with a note."""
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    store = tmp_path / "agents.sqlite"
    first = Companion.open(run, store)
    written = json.loads(first.fingerprint)["step"]
    first.observe({"a": tokens(1)})
    first.store.close()
    more = {"train__steps": 2 * written, "train__keep_checkpoints": 1}
    train.train_and_evaluate(tiny_configs.config("companion", **more), run)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [written, 2 * written]  # kept: pinned; without the pin only the latest
    with pytest.raises(CheckpointError, match=rf"no checkpoint of step 3 in .*\[{written}, "):
        Companion.open(run, tmp_path / "other.sqlite", step=3)
    served = ServerProcess(run, store, step=written)
    try:
        status, body = served.client.request("GET", "/health")
        assert status == 200 and body["fingerprint"]["step"] == written
        assert served.notes == []  # the agents' own weights: nothing to say
        status, _ = served.client.request("POST", "/agents/a/observe", {"tokens": tokens(2)})
        assert status == 200
    finally:
        served.stop()
    latest = Companion.open(run, store)
    assert latest.other_writers() == [
        f"1 agent(s) written by the slow weights of step {written}: served on those of step "
        f"{2 * written} (--other_steps=refuse refuses them)"
    ]
    latest.store.close()


def test_the_key_is_checked_before_the_body_is_read(server):
    """Cause 1: no or a wrong key is a 401 on every endpoint, however malformed the body."""
    for method, path in ENDPOINTS + [("GET", "/nowhere"), ("POST", "/agents/b/")]:
        for key in (None, "nope", KEY[:-1]):
            status, headers, content = http_request(
                server, method, path, b'{"tokens": [1, 2,', key=key
            )
            assert status == 401, (method, path, key, status, content)
            assert_error_shape(content)
            assert "API key" in content["error"] and headers.get("www-authenticate") == "Bearer"
    # A chunked body without a key: refused at once, before any of it is sent.
    status, content = chunked(server, "/agents/b/observe", [], key=None, end=False)
    assert status == 401 and "API key" in content["error"]
    assert http_request(server, "GET", "/health", key=None)[0] == 200  # open: no body, no agent


def test_the_body_limit_holds_whatever_the_framing(server):
    """Cause 2: a chunked body is counted as it is read and refused once over the limit,
    without waiting for its end; one under the limit is served."""
    piece = b" " * (64 << 10)
    status, content = chunked(
        server, "/agents/b/observe", [piece] * 17, end=False
    )  # 1 MiB + 64 KiB
    assert status == 413 and "limit" in content["error"], content
    body = json.dumps({"tokens": tokens(5)}).encode()
    status, content = chunked(server, "/agents/chunky/observe", [body[:5], body[5:]])
    assert status == 200 and content == {"agent_id": "chunky", "tokens": 8}


def test_token_ids_are_strict_integers(server):
    """Cause 3: floats, strings and booleans are not token ids: 422 naming the field, nothing
    written."""
    lax = [
        "[1.0, 2.0, 3.0, 4.0]",
        "[1e1, 2, 3, 4]",
        '["1", "2", "3", "4"]',
        '[" 1 ", "2", "3", "4"]',
    ]
    lax += ["[true, false, true, true]", "[1, 2, 3, 4.0]"]
    for tokens_ in lax:
        body = f'{{"tokens": {tokens_}}}'.encode()
        status, _, content = http_request(server, "POST", "/agents/strict/observe", body)
        assert status == 422 and content["error"].startswith("tokens."), (tokens_, content)
        body = f'{{"queries": [[1, 2], {tokens_}]}}'.encode()
        status, _, content = http_request(server, "POST", "/agents/strict/recall", body)
        assert status == 422 and content["error"].startswith("queries.1."), (tokens_, content)
    assert server.request("GET", "/agents/strict")[1]["tokens"] == 0


def _edited(data: bytes, edit) -> bytes:
    content = serialization.msgpack_restore(data)
    edit(content)
    return serialization.msgpack_serialize(content)


def _first_leaf(tree) -> tuple[dict, str]:
    """The dict holding the first array of a state dict, and its key."""
    for key, value in tree.items():
        if isinstance(value, np.ndarray):
            return tree, key
        if isinstance(value, dict) and value:
            try:
                return _first_leaf(value)
            except LookupError:
                continue
    raise LookupError("no array")


def _set_leaf(value):
    def edit(content):
        holder, key = _first_leaf(content["state"])
        holder[key] = value(holder[key]) if callable(value) else value

    return edit


def test_an_import_is_checked_in_full_and_no_non_finite_state_is_served(server):
    """Cause 4: every edited export is a 422 naming what is wrong and writes nothing; an
    observe that would make a state non-finite is refused, the state kept."""
    assert server.request("POST", "/agents/src/observe", {"tokens": tokens(11)})[0] == 200
    exported = server.request("GET", "/agents/src/export")[1]
    nan = lambda x: np.full_like(x, np.nan)  # noqa: E731
    edits = [
        (_set_leaf(3), "got int 3"),
        (_set_leaf("w"), "got str 'w'"),
        (_set_leaf(lambda x: x.astype(np.float64)), "expected a float32 array"),
        (_set_leaf(lambda x: x[..., :1]), "of shape"),
        (_set_leaf(nan), "not finite"),
        (lambda c: c.__setitem__("state", jax.tree.map(nan, c["state"])), "not finite"),
        (lambda c: c["state"].__setitem__("extra", np.zeros(1)), "unexpected ['extra']"),
        (lambda c: c.__setitem__("state", 5), "state: expected a mapping"),
        (lambda c: c.pop("tokens"), "not a companion state file"),
        (lambda c: c.__setitem__("fingerprint", 7), "fingerprint: expected a string"),
    ]
    edits += [
        (lambda c, t=t: c.__setitem__("tokens", t), "tokens: expected an integer")
        for t in (2**63, -5, 1.5, "12", True)
    ]
    for edit, message in edits:
        status, content = server.request("PUT", "/agents/dst/import", raw=_edited(exported, edit))
        assert status == 422 and message in content["error"], (message, status, content)
        assert content["error"].startswith("import: ")
    assert server.request("GET", "/agents/dst")[1]["tokens"] == 0  # nothing was written
    # Finite but huge: imported, but the next observe would overflow it; refused, state kept.
    huge = _edited(
        exported,
        lambda c: c.__setitem__("state", jax.tree.map(lambda x: np.full_like(x, 3e38), c["state"])),
    )
    assert server.request("PUT", "/agents/dst/import", raw=huge) == (
        200,
        {"agent_id": "dst", "tokens": 8},
    )
    before = server.request("GET", "/agents/dst/export")[1]
    status, content = server.request("POST", "/agents/dst/observe", {"tokens": tokens(12)})
    assert status == 409 and "non-finite" in content["error"], content
    assert server.request("GET", "/agents/dst/export")[1] == before
    assert server.request("GET", "/agents/dst")[1]["tokens"] == 8


def test_no_redirects_and_an_invalid_id_in_a_path_is_400(server, tmp_path):
    """Cause 5: ``victim/``, ``victim%2F`` and the like are 400, never a redirect onto
    ``victim``; the Client does not follow a redirect."""
    assert server.request("POST", "/agents/victim/observe", {"tokens": tokens(13)})[0] == 200
    paths = [
        ("GET", "/agents/victim/"),
        ("DELETE", "/agents/victim/"),
        ("GET", "/agents/victim%2F"),
        ("DELETE", "/agents/victim%2F"),
        ("DELETE", "/agents/victim%2f"),
        ("GET", "/agents/victim/export/"),
        ("POST", "/agents/victim%2Fobserve"),
        ("POST", "/agents/..%2Fvictim/observe"),
        ("DELETE", "/agents/%76ictim"),
        ("GET", "/agents/"),
        ("DELETE", "/%61gents/victim"),
    ]
    for method, path in paths:
        status, headers, content = http_request(server, method, path, b'{"tokens": [1]}')
        assert status == 400 and "location" not in headers, (method, path, status, headers)
        assert_error_shape(content)
        assert "is not valid" in content["error"] or "percent-escapes" in content["error"]
    assert server.request("GET", "/agents/victim")[1]["tokens"] == 8  # not forgotten

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_DELETE(self):
            self.send_response(307)
            self.send_header("location", f"{server.client.base}/agents/victim")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting) as redirecting:
        threading.Thread(target=redirecting.serve_forever, daemon=True).start()
        client = Client(f"http://127.0.0.1:{redirecting.server_address[1]}", KEY)
        assert client.request("DELETE", "/agents/victim/")[0] == 307
        redirecting.shutdown()
    assert server.request("GET", "/agents/victim")[1]["tokens"] == 8


def test_every_error_has_the_documented_shape(server):
    """Cause 7: parse failures, 404, 405, 413 and validation errors are all ``{"error": ...}``
    (one line)."""
    cases = [
        ("POST", "/agents/b/observe", b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422),
        ("POST", "/agents/b/observe", b'{"tokens": [' + b"9" * 5000 + b"]}", 422),
        ("POST", "/agents/b/observe", b'{"tokens": [1], "x": "\xff\xfe"}', 422),
        ("POST", "/agents/b/observe", b'{"tokens": [1, 2,', 422),
        ("POST", "/agents/b/observe", b"", 422),
        ("POST", "/agents/b/recall", b'{"queries": "x"}', 422),
        ("GET", "/nowhere", b"", 404),
        ("GET", "/agents/b/elsewhere", b"", 400),
        ("PUT", "/agents/b/observe", b"", 405),
        ("POST", "/health", b"", 405),
        ("POST", "/agents/b/observe", b" " * (MAX_BODY + 1), 413),
    ]
    for method, path, body, expected in cases:
        status, _, content = http_request(server, method, path, body)
        assert status == expected, (method, path, body[:40], status, content)
        assert_error_shape(content)


def test_reads_that_need_no_model_do_not_wait_behind_one(server):
    """Health and tokens observed answer while long model calls run (maximal recalls of
    agents never seen, the first of their size: a compile, then 16 calls of 64 rows)."""
    server.request("POST", "/agents/reader/observe", {"tokens": tokens(14)})
    long = [[1 + i % 12] * 512 for i in range(256)]
    threads = [
        threading.Thread(
            target=server.request, args=("POST", f"/agents/long-{i}/recall", {"queries": long})
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the recalls read and queued (here they run some 4 s in all)
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/agents/reader")[1]["tokens"] == 8
    assert any(t.is_alive() for t in threads)  # answered while the recalls were still running
    for t in threads:
        t.join(timeout=300)


def test_warming_compiles_the_bucket_sizes_within_its_budget(workdir, tmp_path):
    companion = Companion.open(workdir, tmp_path / "warm.sqlite", max_batch=3)
    sizes = companion.buckets()
    assert ("observe", 1, companion.period) == sizes[0] and ("recall", 4, 512) in sizes
    assert {rows for _, rows, _ in sizes} == {1, 2, 4}
    warmed, total, seconds = companion.warm(budget_s=1.0)
    assert total == len(sizes) and 1 <= warmed < total and seconds < 30
    assert companion.warm(budget_s=0) == (0, total, pytest.approx(0, abs=1))


@pytest.mark.slow
def test_the_digest_covers_every_served_column_and_a_damaged_database_is_503(workdir, tmp_path):
    """Cause 6: a row whose tokens (or fingerprint) were edited with the server down is
    refused as damaged, a row of the former digest format is upgraded and served; cause 7: a
    damaged database file is a 503 saying so."""
    store = tmp_path / "agents.sqlite"
    served = Server(workdir, store)
    for agent in ("edited", "renamed", "legacy", "fine"):
        assert served.request("POST", f"/agents/{agent}/observe", {"tokens": tokens(15)})[0] == 200
    served.kill(signal.SIGTERM)
    with sqlite3.connect(store) as db:
        db.execute("UPDATE agents SET tokens = 999999 WHERE id = 'edited'")
        db.execute("UPDATE agents SET fingerprint = fingerprint || ' ' WHERE id = 'renamed'")
        (state,) = db.execute("SELECT state FROM agents WHERE id = 'legacy'").fetchone()
        db.execute(
            "UPDATE agents SET digest = ? WHERE id = 'legacy'", (hashlib.sha256(state).hexdigest(),)
        )
    served = Server(workdir, store)
    try:
        for agent in ("edited", "renamed"):
            for method, path in (("GET", f"/agents/{agent}"), ("POST", f"/agents/{agent}/recall")):
                status, content = served.request(method, path, {"queries": [[1]]})
                assert status == 409 and "damaged" in content["error"], (agent, path, content)
        assert served.request("GET", "/agents/legacy")[1]["tokens"] == 8
        assert served.request("GET", "/agents/fine")[1]["tokens"] == 8
    finally:
        served.kill(signal.SIGTERM)
    with sqlite3.connect(store) as db:
        assert (
            db.execute("SELECT digest FROM agents WHERE id = 'legacy'")
            .fetchone()[0]
            .startswith("sha256-row:")
        )
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,) = db.execute(
            "SELECT rootpage FROM sqlite_schema WHERE name = 'sqlite_autoindex_agents_1'"
        ).fetchone()
        (page,) = db.execute("PRAGMA page_size").fetchone()
    with open(store, "r+b") as file:  # the index of agent ids: a damaged page
        file.seek((root - 1) * page)
        file.write(b"\xff" * page)
    served = Server(workdir, store)
    try:
        for method, path in (
            ("GET", "/health"),
            ("GET", "/agents/fine"),
            ("POST", "/agents/fine/observe"),
        ):
            status, content = served.request(method, path, {"tokens": tokens(16)})
            assert status == 503 and "store is damaged" in content["error"], (path, content)
            assert_error_shape(content)
    finally:
        served.kill(signal.SIGTERM)
