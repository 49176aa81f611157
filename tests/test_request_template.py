"""A request's own chat_template (--trust-request-chat-template) renders in a worker process
(entry.py ChatTemplateWorker): a template that would take the server's memory or hold its GIL in one C call
is a 400 naming chat_template, the server stays healthy, and what renders, renders as in the server's process.
One server (and so one worker) for the file. Nothing waits on a clock but with deadlines far past a loaded
machine's needs; the one short limit applies only to a render that no machine finishes within it."""
from __future__ import annotations

import json
import logging
import resource
import socket
import sys
import threading
import time

import httpx
import pytest

from nanoserve import entry
from test_server import ServerThread, _check_error

pytestmark = pytest.mark.timeout(180)

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
# each allocates a gigabyte or more in one C call (in the server's process too, before this change): the worker's
# 512 MiB cap is what stops it. Sized to fail a regression without taking the test machine down with it.
MEMORY_BOMBS = ["{{ 'x' * 10**9 }}", "{{ 'x'.ljust(10**9) }}", "{{ '%0999999999d' % 1 }}",
                "{{ '{:>999999999}'.format(1) }}", "{{ 'ab' | center(10**9) }}", "{{ [0] * 10**8 }}"]
# one C call that computes for minutes (a 100-million-digit power), holding the GIL throughout
TIME_BOMB = "{{ 10**(10**8) }}"


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model, "--trust-request-chat-template") as s:
        yield s


def _post(server, body: dict, path: str = "/v1/chat/completions", timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def _worker_pid(server) -> int:
    """The worker's pid, once it runs (it starts with the server, on a thread)."""
    worker = server.app.state.server.template_worker
    deadline = time.monotonic() + 60
    while worker.proc is None or worker.proc.poll() is not None:
        assert time.monotonic() < deadline, "the template worker did not start"
        time.sleep(0.01)
    return worker.proc.pid


def _healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    r = _post(server, {"messages": USER, "max_tokens": 1})  # the server's own template, in its own process
    assert r.status_code == 200, r.text
    r = _post(server, {"messages": USER, "chat_template": "{{ messages[0].content }}!", "max_tokens": 1,
                       "return_prompt_text": True})
    assert r.status_code == 200 and r.json()["prompt_text"] == "hi!", r.text


@pytest.mark.parametrize("template", MEMORY_BOMBS)
def test_a_template_past_the_memory_cap_is_a_400_and_the_server_keeps_its_memory(server, template):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB: the server runs in this process
    for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
                       ("/tokenize", {"messages": USER})):
        err = _check_error(_post(server, {**body, "chat_template": template}, path), 400, "chat_template")
        assert "needed more than 512 MiB to render" in err["message"], err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # the bomb's 1 GB went elsewhere
    _healthy(server)


def test_a_template_past_the_time_limit_is_killed_and_the_worker_replaced(server, monkeypatch):
    """The render holds the worker's GIL in one C call, so only a kill stops it: /health and other requests
    answer meanwhile, the request gets a 400, and a new worker renders the next template."""
    pid = _worker_pid(server)
    monkeypatch.setattr(entry, "CHAT_TEMPLATE_TIMEOUT_S", 1.0)  # read as each request renders
    result = {}
    sender = threading.Thread(target=lambda: result.setdefault("r", _post(
        server, {"messages": USER, "chat_template": TIME_BOMB, "max_tokens": 1})))
    sender.start()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert _post(server, {"prompt": "hi", "max_tokens": 1}, "/v1/completions").status_code == 200
    sender.join(60)
    err = _check_error(result["r"], 400, "chat_template")
    assert "chat_template did not render within 1 s" in err["message"], err
    monkeypatch.setattr(entry, "CHAT_TEMPLATE_TIMEOUT_S", 60.0)
    _healthy(server)
    assert _worker_pid(server) != pid


def _send(server, path: str, body: dict) -> socket.socket:
    """The request sent on a socket of its own, its answer never read: closing it is the client leaving."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _until(what, why: str) -> None:
    deadline = time.monotonic() + 60  # far past a loaded machine's needs, far short of the 600 s limit
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.01)


@pytest.mark.parametrize("path,body", [("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})])
def test_a_client_that_leaves_mid_render_stops_it_at_once(server, monkeypatch, path, body):
    """The client leaves while its template renders: the render is killed then, not at the limit, and the
    slot of a render waiting its turn behind it frees as its own client leaves (vLLM's with_cancellation)."""
    worker, state = server.app.state.server.template_worker, server.app.state.server
    pid = _worker_pid(server)
    monkeypatch.setattr(entry, "CHAT_TEMPLATE_TIMEOUT_S", 600.0)  # the kill cannot be the limit's
    body = {**body, "messages": USER, "chat_template": TIME_BOMB}
    rendering = _send(server, path, body)
    _until(lambda: worker.current is not None, "the bomb did not start rendering")
    waiting = _send(server, path, body)
    _until(lambda: state.template_renders == 2, "the second render did not wait its turn")
    waiting.close()
    _until(lambda: state.template_renders == 1, "the slot of a render whose client left was not freed")
    assert worker.current is not None and worker.proc.pid == pid  # the first still renders
    rendering.close()
    _until(lambda: state.template_renders == 0 and worker.current is None, "the render went on")
    monkeypatch.setattr(entry, "CHAT_TEMPLATE_TIMEOUT_S", 60.0)
    r = _post(server, {"messages": USER, "chat_template": "{{ 'fine' }}", "return_token_strs": True}, "/tokenize")
    assert r.status_code == 200 and "".join(r.json()["token_strs"]) == "fine", r.text
    assert _worker_pid(server) != pid


def test_renders_past_the_queue_limit_are_a_503(server):
    """One worker renders one template at a time; with MAX_TEMPLATE_RENDERS rendering or waiting their turn,
    the next request template is a 503 at once, not a wait of 10 s per template ahead of it."""
    worker, state = server.app.state.server.template_worker, server.app.state.server
    _worker_pid(server)
    body = {"messages": USER, "chat_template": "{{ 'queued' }}", "return_token_strs": True}
    results: list[httpx.Response] = []
    with worker.turn:  # the worker is busy: every render waits for its turn
        senders = [threading.Thread(target=lambda: results.append(_post(server, body, "/tokenize")))
                   for _ in range(entry.MAX_TEMPLATE_RENDERS)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 60
        while state.template_renders < entry.MAX_TEMPLATE_RENDERS:
            assert time.monotonic() < deadline, state.template_renders
            time.sleep(0.01)
        err = _check_error(_post(server, body, "/tokenize"), 503, None)
        assert "one at a time: retry later" in err["message"], err
    for t in senders:
        t.join(60)
    assert [r.status_code for r in results] == [200] * entry.MAX_TEMPLATE_RENDERS, [r.text for r in results]
    assert state.template_renders == 0


def test_a_render_ended_by_shutdown_is_killed_at_once(tiny_model, monkeypatch):
    """The drain ends a request still rendering (a cancellation, as any other end of its handler): its render
    is killed then, not at the limit, and the worker ends with the server."""
    monkeypatch.setattr(entry, "CHAT_TEMPLATE_TIMEOUT_S", 600.0)  # the kill cannot be the limit's
    result = {}
    with ServerThread(tiny_model, "--trust-request-chat-template", graceful=0.3) as s:
        worker = s.app.state.server.template_worker
        _worker_pid(s)
        sender = threading.Thread(target=lambda: result.setdefault("r", _post(
            s, {"messages": USER, "chat_template": TIME_BOMB}, "/tokenize")))
        sender.start()
        deadline = time.monotonic() + 60
        while worker.current is None:  # the bomb is rendering
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc = worker.proc
    sender.join(60)  # far less than the render's 600 s
    assert result["r"].status_code == 503 and "shutting down" in result["r"].text, result["r"].text
    assert proc.poll() is not None and worker.proc is None


CASES = {  # body fields -> a template that reads them
    "tools and kwargs": ({"tools": TOOLS, "chat_template_kwargs": {"flavor": "mint"}},
                         "{{ bos_token }}{% for t in tools %}[{{ t.function.name }}:{{ t.function.parameters | "
                         "tojson }}]{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}{{ flavor }}{{ eos_token }}"),
    "documents": ({"documents": [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]},
                  "{% for d in documents %}({{ d.title }}={{ d.text }}){% endfor %}{{ messages | tojson }}"),
    "continue_final_message": ({"messages": USER + [{"role": "assistant", "content": "Once upon"}],
                                "add_generation_prompt": False, "continue_final_message": True},
                               "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"),
    "openai content format": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}]},
                              "{% for m in messages %}{% for p in m['content'] %}{{ p.type }}:{{ p.text }};"
                              "{% endfor %}{% endfor %}"),
    "a tool call's arguments": ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]},
        "{% for m in messages %}{{ m.tool_calls | default([]) | tojson }}{{ m.content }}{% endfor %}"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_request_template_renders_as_in_the_server(server, case):
    """The worker's prompt is the one the server's own process renders (entry.render_chat given the engine's
    tokenizer, as the server rendered before the worker), for the chat and /tokenize paths."""
    fields, template = CASES[case]
    body = {"messages": USER, **fields, "chat_template": template}
    req = entry.ChatCompletionRequest.model_validate(body)
    expected = entry.render_chat(server.app.state.server, req, req.tools, server.engine.tokenizer)
    choice = {"tool_choice": "none"} if "tools" in body else {}  # "auto" needs a tool parser; the tools still render
    r = _post(server, {**body, **choice, "max_tokens": 1, "return_prompt_text": True})
    assert r.status_code == 200 and r.json()["prompt_text"] == expected, r.text
    r = _post(server, body, "/tokenize")
    assert r.status_code == 200 and r.json()["tokens"] == server.engine.tokenize(expected, False)[1], r.text


@pytest.mark.parametrize("template, param", [("{% for %}", "chat_template"), ("{{ raise_exception('nope') }}",
                                                                             "messages"), ("{{ 1 / 0 }}", "messages")])
def test_a_template_that_fails_fails_as_in_the_server(server, template, param):
    req = entry.ChatCompletionRequest.model_validate({"messages": USER, "chat_template": template})
    with pytest.raises(entry.InvalidInput) as expected:
        entry.render_chat(server.app.state.server, req, None, server.engine.tokenizer)
    err = _check_error(_post(server, {"messages": USER, "chat_template": template, "max_tokens": 1}), 400, param)
    assert expected.value.param == param and err["message"] == str(expected.value), err


def test_a_server_without_a_worker_refuses_request_templates(server, monkeypatch):
    """Where no worker can start (the platform, the tokenizer), request templates are a 400 saying why."""
    monkeypatch.setattr(server.app.state.server.template_worker, "error", "no worker process can start (test)")
    err = _check_error(_post(server, {"messages": USER, "chat_template": "{{ 'x' }}", "max_tokens": 1}), 400,
                       "chat_template")
    assert "cannot run a request's chat_template: no worker process can start (test)" in err["message"], err
    assert _post(server, {"messages": USER, "max_tokens": 1}).status_code == 200  # the server's own still renders


def test_where_no_worker_can_start_one_line_says_so_at_start(tiny_model, monkeypatch, caplog):
    """A tokenizer class with its own apply_chat_template (the worker runs transformers'), or a platform where
    no process starts: one warning at start-up, no worker, and render_own_template's 400 names the reason."""
    from transformers import AutoTokenizer
    from nanoserve.entry import ChatTemplateWorker
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    class Own(type(tokenizer)):
        def apply_chat_template(self, *args, **kwargs):
            return "its own"
    tokenizer.__class__ = Own
    caplog.set_level(logging.WARNING, logger="nanoserve")
    own = ChatTemplateWorker(tokenizer, None)
    own.start_soon()
    assert own.proc is None and own.error == "Own has its own apply_chat_template, which the worker does not run"
    tokenizer.__class__ = Own.__bases__[0]
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    none = ChatTemplateWorker(tokenizer, None)
    none.start_soon()
    deadline = time.monotonic() + 60
    while none.error is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert none.proc is None and none.error.startswith("no worker process can start (")
    deadline = time.monotonic() + 60
    while len(caplog.records) < 2:  # logged after the error is set, on the starting thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("requests' own chat templates will be refused" in line for line in lines), lines
