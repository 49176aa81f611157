"""A request's own chat template (--trust-request-chat-template), rendered in a process of its own.

A template is code: Jinja's sandbox stops attribute escapes, not cost. ``{{ 'x' * 10**10 }}`` is one C call that
allocates 10 GB, ``{{ 10**10**8 }}`` one that computes for hours, and string methods, ``format``, ``%`` and filters
such as ``center`` or ``wordwrap`` are more of them: in the server's process, no thread can stop such a call, and
the memory is the server's. Intercepting the sandbox's operators (``intercepted_binops``) leaves every C path
through a method or filter, so the render runs in a worker process instead, with a memory cap (RLIMIT_DATA and
RLIMIT_AS) and a wall-clock limit past which it is killed and replaced.

The worker renders with transformers' own ``PreTrainedTokenizerBase.apply_chat_template`` (and so its
``render_jinja_template``: the sandboxed environment, its filters and globals) on a stand-in tokenizer that holds
what a render reads: the tokenizer's chat template(s) and its special tokens. The server keeps everything else
of engine.apply_chat_template (its checks, the content format, the messages as vLLM hands them on): only the
render crosses, as ``tokenizer.apply_chat_template``'s arguments (``WorkerTokenizer``).

The worker is run as this file (``python -c`` + runpy), not as ``nanoserve.template_worker``: importing the package
imports torch (2 s, 300 MB). So the top level here imports only the standard library.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("nanoserve.entry")

MEMORY_BYTES = 512 * 2**20  # a render's own memory, on top of the worker's (its imports): a prompt is megabytes
START_TIMEOUT_S = 120.0     # the worker's imports (transformers, jinja2): about a second when the machine is idle

# run in the worker: this file by path (not the package), without the current directory on sys.path
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__nanoserve_template_worker__')"


class ChatTemplateWorker:
    """The server's side of the worker: one render at a time (``render``, on the request's own thread), the worker
    started on first need and killed past a limit, or when the request's client leaves (``abandon``), then
    replaced in the background. ``error`` says why none can run (the platform, the tokenizer): requests'
    templates are then refused."""

    def __init__(self, tokenizer: Any, max_chars: int | None, memory_bytes: int = MEMORY_BYTES):
        self.error: str | None = _unsupported(tokenizer)
        self.setup = None if self.error else {
            "chat_template": tokenizer.chat_template, "special_tokens_map": tokenizer.special_tokens_map,
            "memory_bytes": memory_bytes, "max_chars": max_chars}
        self.memory_bytes, self.max_chars = memory_bytes, max_chars
        self.turn = threading.Lock()  # one render (or start) at a time
        self.guard = threading.Lock()  # proc and current, between a render's thread and abandon's
        self.proc: subprocess.Popen | None = None
        self.conns: tuple[Connection, Connection] | None = None  # (to the worker, from it)
        self.current: threading.Event | None = None  # the render running: its "client left" event
        self.closed = False

    def start_soon(self) -> None:
        """Start the worker on a thread (the server's start-up does not wait); one line in the log if it cannot."""
        def start() -> None:
            with self.turn:
                try:
                    self._ensure_started()
                except OSError as e:  # no process can start here: every request template is refused
                    if self.closed:  # the server stopped as it started
                        return
                    self.error = f"no worker process can start ({e})"
            if self.error:
                logger.warning("[entry] --trust-request-chat-template: requests' own chat templates will be "
                               "refused: %s", self.error)
        if self.error:
            logger.warning("[entry] --trust-request-chat-template: requests' own chat templates will be refused: %s",
                           self.error)
        else:
            threading.Thread(target=start, name="nanoserve-template-start", daemon=True).start()

    def render(self, kwargs: dict[str, Any], limit: float, left: threading.Event) -> dict[str, Any]:
        """The worker's answer to tokenizer.apply_chat_template(**kwargs): {"text": ...}, or {"syntax": str,
        "lineno": n} / {"error": str} as the render raised them, or {"limit": "time"|"memory"|"length"|"crash"|
        "left"} where it was stopped. Blocks the calling thread (never the event loop's)."""
        with self.turn:
            if left.is_set():
                return {"limit": "left"}
            self._ensure_started()
            to_worker, from_worker = self.conns
            with self.guard:
                self.current = left
            try:
                to_worker.send_bytes(pickle.dumps((kwargs, limit), protocol=pickle.HIGHEST_PROTOCOL))
                if from_worker.poll(limit):
                    return json.loads(from_worker.recv_bytes())
                outcome = {"limit": "time"}
            except (EOFError, OSError):  # killed by abandon, or it died (a C stack overflow, the OOM killer)
                outcome = {"limit": "left" if left.is_set() else "crash"}
            finally:
                with self.guard:
                    self.current = None
            self._kill()
        self._replace_soon()
        return outcome

    def abandon(self, left: threading.Event) -> None:
        """The client of the render ``left`` stands for has gone: that render (if it runs now) is killed."""
        left.set()
        with self.guard:
            if self.current is left and self.proc is not None:
                self.proc.kill()

    def close(self) -> None:
        self.closed = True
        with self.guard:
            if self.proc is not None:
                self.proc.kill()
        if self.turn.acquire(timeout=5):  # a render still running ends at the kill
            try:
                self._kill()
            finally:
                self.turn.release()

    def _ensure_started(self) -> None:
        """The worker, started if none runs (under ``turn``); raises OSError where it cannot start."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self._kill()
        if self.closed:
            raise OSError("the server is shutting down")
        r_worker, w_server = os.pipe()
        r_server, w_worker = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(r_worker),
                                     str(w_worker)], pass_fds=(r_worker, w_worker),
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # not the server's ^C
        except BaseException:
            for fd in (w_server, r_server):
                os.close(fd)
            raise
        finally:
            os.close(r_worker)
            os.close(w_worker)
        conns = Connection(w_server, readable=False), Connection(r_server, writable=False)
        with self.guard:
            self.proc, self.conns = proc, conns
        try:
            conns[0].send_bytes(pickle.dumps(self.setup))
            if not conns[1].poll(START_TIMEOUT_S):
                raise OSError(f"the worker did not start within {START_TIMEOUT_S:g} s")
            ready = json.loads(conns[1].recv_bytes())
        except (EOFError, OSError) as e:
            self._kill()
            raise OSError(str(e) or "the worker ended as it started") from None
        if "error" in ready or self.closed:
            self._kill()
            raise OSError(ready.get("error", "the server is shutting down"))

    def _kill(self) -> None:
        with self.guard:
            proc, conns, self.proc, self.conns = self.proc, self.conns, None, None
        if proc is not None:
            proc.kill()
            proc.wait()
        for conn in conns or ():
            conn.close()

    def _replace_soon(self) -> None:
        """A new worker, started now on a thread: the next request finds it ready."""
        def replace() -> None:
            with self.turn:
                try:
                    self._ensure_started()
                except OSError as e:  # the next render tries again, and says why if it fails too
                    logger.warning("[entry] the chat-template worker could not be replaced: %s", e)
        if not self.closed:
            threading.Thread(target=replace, name="nanoserve-template-start", daemon=True).start()


def _unsupported(tokenizer: Any) -> str | None:
    """Why the worker cannot render as ``tokenizer`` would (None where it can): it runs transformers' own
    apply_chat_template, which a tokenizer class may have replaced."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError as e:
        return f"transformers cannot be imported ({e})"
    if tokenizer is None:
        return "the engine runs without a tokenizer"
    for name in ("apply_chat_template", "get_chat_template"):
        if getattr(type(tokenizer), name, None) is not getattr(PreTrainedTokenizerBase, name):
            return f"{type(tokenizer).__name__} has its own {name}, which the worker does not run"
    try:
        pickle.dumps((tokenizer.chat_template, tokenizer.special_tokens_map))
    except Exception as e:
        return f"the tokenizer's chat template or special tokens cannot be sent to the worker ({e})"
    if not hasattr(os, "pipe") or sys.platform == "win32":
        return "this platform has no pipes for a worker process"
    return None


# =========================================================================== the server's side of a render

LIMIT_WORDS = {
    "time": "chat_template did not render within {limit:g} s: simplify it (loops within loops, very long strings)",
    "memory": "chat_template needed more than {mib} MiB to render: simplify it (very long strings or lists)",
    "length": "chat_template rendered a prompt longer than {max_chars} characters, more than max_model_len "
              "tokens can hold",
    "crash": "chat_template ended the process that renders it (too deep a recursion?): simplify it",
    "left": "the client left before chat_template rendered",
}


class WorkerTokenizer:
    """The tokenizer as engine.apply_chat_template uses it, whose ``apply_chat_template`` renders in the worker:
    the rest (its chat template for the content format, its signature for the reserved kwargs) is the
    tokenizer's own. What the render raised is raised again here with the same words, so that the engine's
    400s are those of a render in the server; a limit is a 400 naming chat_template."""

    def __init__(self, tokenizer: Any, worker: ChatTemplateWorker, limit: float, left: threading.Event):
        self.tokenizer, self.worker, self.limit, self.left = tokenizer, worker, limit, left
        # the signature the engine reads for the renderer's own arguments (chat_template_kwargs cannot set them)
        self.apply_chat_template = functools.wraps(tokenizer.apply_chat_template)(
            lambda conversation, **kwargs: self._render(conversation, **kwargs))

    @property
    def chat_template(self) -> Any:
        return self.tokenizer.chat_template

    def get_chat_template(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.get_chat_template(*args, **kwargs)

    def _render(self, conversation: Any, **kwargs: Any) -> str:
        from nanoserve.engine import InvalidInput
        try:
            out = self.worker.render({"conversation": conversation, **kwargs}, self.limit, self.left)
        except OSError as e:  # no worker could be started for it
            raise InvalidInput("chat_template", f"this server cannot render a request's chat_template now: {e}") \
                from None
        if "text" in out:
            return out["text"]
        if "syntax" in out:
            raise _RenderedSyntaxError(out["syntax"], out["lineno"])
        if "error" in out:
            raise _RenderError(out["error"])
        raise InvalidInput("chat_template", LIMIT_WORDS[out["limit"]].format(
            limit=self.limit, mib=self.worker.memory_bytes >> 20, max_chars=self.worker.max_chars))


class _RenderError(Exception):
    """An exception the render raised, by its words (``str(e) or type(e).__name__``, as the engine words it)."""

    def __init__(self, words: str):
        super().__init__(words)
        self.words = words

    def __str__(self) -> str:
        return self.words


def _RenderedSyntaxError(words: str, lineno: int | None) -> Exception:
    """jinja2's TemplateSyntaxError as the render raised it: its words and line."""
    import jinja2

    class RenderedSyntaxError(jinja2.TemplateSyntaxError):
        def __str__(self) -> str:
            return words
    return RenderedSyntaxError(words, lineno)


# =========================================================================== the worker process

def _serve(r_fd: int, w_fd: int) -> None:
    """Render each request that comes, until the server closes the pipe (or ends)."""
    import signal
    from_server, to_server = Connection(r_fd, writable=False), Connection(w_fd, readable=False)
    try:
        setup = pickle.loads(from_server.recv_bytes())
    except EOFError:  # the server gave up on it
        return
    try:
        import jinja2
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import _compile_jinja_template
        _compile_jinja_template("{{ messages }}")  # its first compile imports what every render needs
        _cap_memory(setup["memory_bytes"])
    except Exception as e:
        to_server.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    tokenizer = _stand_in(PreTrainedTokenizerBase, setup)
    to_server.send_bytes(b'{"ready": true}')
    while True:
        try:
            kwargs, limit = pickle.loads(from_server.recv_bytes())
        except EOFError:
            return
        # The server kills a render at its limit; should the server itself end meanwhile, SIGALRM's default
        # action ends the worker, even in a C call that holds the GIL (a Python handler would wait for it).
        signal.alarm(int(limit) + 10)
        out = _render(tokenizer, kwargs, setup["max_chars"], jinja2)
        signal.alarm(0)
        try:
            data = json.dumps(out).encode()  # ASCII: a lone surrogate goes escaped, as the render made it
        except MemoryError:
            data = b'{"limit": "memory"}'
        del out
        to_server.send_bytes(data)


def _render(tokenizer: Any, kwargs: dict[str, Any], max_chars: int | None, jinja2: Any) -> dict[str, Any]:
    try:
        text = tokenizer.apply_chat_template(kwargs.pop("conversation"), **kwargs)
    except MemoryError:
        return {"limit": "memory"}
    except jinja2.TemplateSyntaxError as e:
        return {"syntax": str(e), "lineno": e.lineno}
    except Exception as e:
        return {"error": str(e) or type(e).__name__}
    if max_chars is not None and len(text) > max_chars:
        return {"limit": "length"}
    return {"text": text}


def _stand_in(base: type, setup: dict[str, Any]) -> Any:
    """What transformers' apply_chat_template reads of a tokenizer when it only renders (tokenize=False): its
    chat template(s) and special tokens; the methods are transformers' own."""
    class TemplateTokenizer:
        apply_chat_template = base.apply_chat_template
        get_chat_template = base.get_chat_template

        def __init__(self) -> None:
            self.chat_template = setup["chat_template"]
            self.special_tokens_map = setup["special_tokens_map"]
    return TemplateTokenizer()


def _cap_memory(extra: int) -> None:
    """No more than ``extra`` bytes beyond what the worker holds now: past it, an allocation is a MemoryError
    (RLIMIT_DATA: the heap and private mappings, where Python's large objects go; RLIMIT_AS as well, for
    kernels before 4.7, where RLIMIT_DATA did not cover mappings)."""
    import resource
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    for limit, key in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        cap = int(status[key].split()[0]) * 1024 + extra
        resource.setrlimit(limit, (cap, cap))



if __name__ == "__nanoserve_template_worker__":
    _serve(int(sys.argv[2]), int(sys.argv[3]))
