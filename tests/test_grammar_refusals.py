"""Structured-output specs at the edge of a real server with two API keys: a grammar that can
match no text is a 400 before the request reaches the decoder; grammar compiles are shared
fairly between clients and tenants; schemas too slow to compile give their compile slots back
at their deadline (the compile's process is killed), so the next request's schema compiles at
once. Clients are told apart by their address: each test client binds its own loopback one."""

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_harness import ServerProcess

CHAT = [{"role": "user", "content": "hello"}]
KEYS = ("key-a", "key-b", "key-c")
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def slow_schema(name: str) -> dict:
    # Sixty strings of distinct maxLength: tens of seconds to compile even for a tiny vocabulary.
    return {"type": "object", "properties": {f"{name}{i}": {"type": "string", "maxLength": 20 + 7 * i}
                                             for i in range(60)}}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    # Two compile slots (the default), so one per tenant and one per client.
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    server = ServerProcess(tiny_llama, "--grammar-compile-timeout", "3", *keys,
                           log_dir=tmp_path_factory.mktemp("grammar-refusal-logs"))
    yield server
    assert server.stop() == 0, server.log_text()


def post(server, path: str, body: dict, key: str = KEYS[0], client: str = "127.0.0.1") -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60, source_address=(client, 0))
    try:
        connection.request("POST", f"/v1/{path}", json.dumps(body),
                           {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("path,body", [
    ("chat/completions", {"messages": CHAT, "guided_grammar": "root ::= root"}),
    ("chat/completions", {"messages": CHAT, "guided_grammar": 'root ::= "a" root'}),
    ("chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}}),
    ("chat/completions", {"messages": CHAT, "guided_json": {
        "type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}}}),
    ("completions", {"prompt": "hi", "guided_grammar": "root ::= x\nx ::= x"}),
], ids=["self-rule", "endless-rule", "self-ref", "required-self-ref", "completions"])
def test_a_grammar_that_can_match_no_text_is_a_400(server, path, body):
    status, answer = post(server, path, {**body, "max_tokens": 4})
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_grammar" and "can match no text" in answer["error"]["message"]


def test_a_grammar_that_matches_only_the_empty_text_is_served(server):
    status, answer = post(server, "chat/completions", {"messages": CHAT, "guided_grammar": 'root ::= ""',
                                                      "max_tokens": 4})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == ""


def small_schema_answer(server, key: str, client: str, path: str = "chat/completions") -> tuple[int, dict]:
    body = {"messages": CHAT} if path == "chat/completions" else {"prompt": "hi"}
    return post(server, path, {**body, "guided_json": SMALL, "max_tokens": 32}, key, client)


def test_a_client_or_tenant_past_its_share_is_refused_while_others_are_served(server):
    with ThreadPoolExecutor(1) as pool:
        # Tenant A, client .2: one slow compile, its tenant's and its client's whole share.
        slow = pool.submit(post, server, "chat/completions",
                           {"messages": CHAT, "guided_json": slow_schema("share"), "max_tokens": 4}, KEYS[0],
                           "127.0.0.2")
        time.sleep(0.5)
        status, answer = small_schema_answer(server, KEYS[1], "127.0.0.2")
        assert status == 429 and answer["error"]["code"] == "grammar_busy", answer
        assert "this client holds its share" in answer["error"]["message"]
        status, answer = small_schema_answer(server, KEYS[0], "127.0.0.3", "completions")
        assert status == 429 and "this API key holds its share" in answer["error"]["message"], answer
        status, answer = small_schema_answer(server, KEYS[1], "127.0.0.3")
        assert status == 200, answer
        status, answer = slow.result()
        assert status == 400 and answer["error"]["code"] == "grammar_too_complex", answer


def test_slow_schemas_give_their_slots_back_at_the_deadline(server):
    def ask(key_and_client):
        key, client = key_and_client
        started = time.monotonic()
        status, answer = post(server, "chat/completions",
                              {"messages": CHAT, "guided_json": slow_schema(client), "max_tokens": 4}, key, client)
        return status, answer, time.monotonic() - started

    # Two tenants' slow schemas take both compile slots, until their deadline only. Neither is
    # key-a: its slow schema in the test before bars it from the last free slot for a while.
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(ask, [(KEYS[1], "127.0.0.4"), (KEYS[2], "127.0.0.5")]))
    for status, answer, seconds in outcomes:
        assert status == 400 and answer["error"]["code"] == "grammar_too_complex", answer
        assert seconds < 10.0
    # Their slots are free at once (a compile thread kept its slot until the compile ended,
    # tens of seconds later: 429 grammar_busy here).
    started = time.monotonic()
    status, answer = small_schema_answer(server, KEYS[0], "127.0.0.6")
    assert status == 200, answer
    assert json.loads(answer["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    assert time.monotonic() - started < 5.0
