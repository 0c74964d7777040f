"""Grammar compiles for the front end's check, in processes that a deadline can stop.

xgrammar cannot interrupt a compile, and a thread running one holds its core until it ends,
however long that is (a ~350-byte JSON schema takes seconds, a 64 KiB one over an hour). Here
each compile runs in a child process of one *compile server*, a process the front end starts
and talks to over its stdin and stdout. The server builds the tokenizer's grammar tables once
and forks its children from itself, so a child starts with them ready and a child killed at
its deadline (or because nobody waits for its compile any more) is replaced by a fork that
costs milliseconds, not a fresh interpreter that would import torch again (seconds).

The server itself never compiles: it forwards jobs to idle children, enforces each job's
deadline from the moment its child takes it, and answers every job exactly once unless the
job was cancelled. A server whose front end goes away reads end-of-file and exits; its
children die with it (PR_SET_PDEATHSIG) or at their next read.

Run as `python -m frontend.grammar_workers` by GrammarWorkers; not a command for people.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import time
from collections import deque

import msgspec

from engine.sampling_params import StructuredOutput

logger = logging.getLogger("antiphon.grammar_workers")

# A server that has not answered a job this long after the job's deadline is taken for hung:
# killed and started again (forking a replacement child takes milliseconds, so this is slack).
SERVER_SLACK_S = 10.0
# The compile server's start: an interpreter, torch and xgrammar imported, the tables built.
START_TIMEOUT_S = 180.0
# After a failed start, compiles are refused this long before the next try: a server that
# cannot start must not cost a fresh interpreter per constrained request.
RESTART_BACKOFF_S = 10.0
_LENGTH = struct.Struct(">I")


# ---- messages: the front end and the compile server, the server and its children --------

class Setup(msgspec.Struct, tag=True):
    tokenizer: bytes  # the Hugging Face tokenizer, pickled by the front end that loaded it
    vocab_size: int
    children: int


class Ready(msgspec.Struct, tag=True):
    pid: int


class Compile(msgspec.Struct, tag=True):
    job: int
    kind: str
    spec: str
    deadline_s: float


class Cancel(msgspec.Struct, tag=True):
    job: int


class Outcome(msgspec.Struct, tag=True):
    job: int
    # None: it compiled. "invalid": a GrammarError (message says why). "timeout": past the
    # deadline, the child was killed. "failed": the child died on it (message says how).
    refusal: str | None = None
    message: str = ""
    seconds: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_to_server = msgspec.msgpack.Decoder(Setup | Compile | Cancel)
_to_child = msgspec.msgpack.Decoder(Compile)
_from_server = msgspec.msgpack.Decoder(Ready | Outcome)
_from_child = msgspec.msgpack.Decoder(Outcome)


def _frame(message) -> bytes:
    data = _encoder.encode(message)
    return _LENGTH.pack(len(data)) + data


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, decoder):
    (size,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    return decoder.decode(_read_exactly(fd, size))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---- the front end's side -----------------------------------------------------------------

class WorkersUnavailable(Exception):
    """The compile server could not start, or was lost during this compile."""


class GrammarWorkers:
    """The front end's handle on the compile server: started on first use (a server that
    never sees a constrained request starts no process), started again if it dies.

    `compile` answers one job; cancelling the task that awaits it cancels the job, and the
    server kills the child compiling it."""

    def __init__(self, tokenizer, vocab_size: int, processes: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.processes = processes  # worker processes, each compiling one spec at a time
        self._process: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._jobs = itertools.count()
        # job -> the server it was sent to and its answer, later.
        self._waiting: dict[int, tuple[asyncio.subprocess.Process, asyncio.Future]] = {}
        self._failed_at = float("-inf")
        self.server_pid: int | None = None
        self._warming: asyncio.Future | None = None

    async def compile(self, spec: StructuredOutput, deadline_s: float) -> Outcome:
        process = await self._started()
        job = next(self._jobs)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[job] = process, answer
        try:
            if process.returncode is not None or self._reader is None or self._reader.done():
                raise WorkersUnavailable("the grammar compile server exited")
            process.stdin.write(_frame(Compile(job, spec.kind, spec.spec, deadline_s)))
            # The server counts the deadline from when a child takes the job; this bound
            # only catches a server that stopped answering.
            async with asyncio.timeout(deadline_s + SERVER_SLACK_S):
                return await answer
        except TimeoutError:
            logger.error("the grammar compile server did not answer within %.0f s of a deadline; restarting it",
                         SERVER_SLACK_S)
            self._stop(process)
            raise WorkersUnavailable("the grammar compile server stopped answering") from None
        except asyncio.CancelledError:
            # Cancelling this task cancels `answer` too: a job without its outcome is cancelled.
            answered = answer.done() and not answer.cancelled()
            if not answered and process.returncode is None and not process.stdin.is_closing():
                process.stdin.write(_frame(Cancel(job)))
            raise
        finally:
            self._waiting.pop(job, None)

    def start_soon(self) -> None:
        """Starts the compile server in the background (at the server's start), so that the
        first constrained requests do not each hold a compile slot through its cold start."""
        async def start() -> None:
            try:
                await self._started()
            except WorkersUnavailable:
                pass  # logged by _start; the first check tries again

        self._warming = asyncio.ensure_future(start())

    async def _started(self) -> asyncio.subprocess.Process:
        process = self._process
        if process is not None and process.returncode is None and self._reader is not None \
                and not self._reader.done():
            return process
        if self._starting is None or self._starting.done():
            if time.monotonic() - self._failed_at < RESTART_BACKOFF_S:
                raise WorkersUnavailable("the grammar compile server failed to start; it is tried again shortly")
            self._starting = asyncio.create_task(self._start(), name="grammar-workers-start")
        # Shielded: one waiter going away does not stop a start the others wait for.
        return await asyncio.shield(self._starting)

    async def _start(self) -> asyncio.subprocess.Process:
        started = time.monotonic()
        setup = await asyncio.to_thread(
            lambda: _frame(Setup(pickle.dumps(self._tokenizer), self._vocab_size, self.processes)))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "frontend.grammar_workers", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        try:
            process.stdin.write(setup)
            async with asyncio.timeout(START_TIMEOUT_S):
                await process.stdin.drain()
                ready = await _next_message(process.stdout)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self._stop(process)
            self._failed_at = time.monotonic()
            logger.error("the grammar compile server did not start (%s)", type(exc).__name__)
            raise WorkersUnavailable(f"the grammar compile server did not start ({type(exc).__name__})") from None
        except BaseException:
            self._stop(process)
            raise
        self._process, self.server_pid = process, ready.pid
        self._reader = asyncio.create_task(self._read(process), name="grammar-workers-read")
        logger.info("grammar compile server ready in %.1f s (pid %d, %d workers)", time.monotonic() - started,
                    process.pid, self.processes)
        return process

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        try:
            while True:
                outcome = await _next_message(process.stdout)
                _, answer = self._waiting.get(outcome.job, (None, None))
                if answer is not None and not answer.done():
                    answer.set_result(outcome)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass
        finally:
            self._stop(process)
            if process is self._process:
                self._process = None
            for server, answer in self._waiting.values():
                if server is process and not answer.done():
                    answer.set_exception(WorkersUnavailable("the grammar compile server exited"))

    def _stop(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            process.kill()
        if process is self._process:
            self._process = None

    async def close(self) -> None:
        process, self._process = self._process, None
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if process is not None and process.returncode is None:
            process.stdin.close()  # the server reads end-of-file, kills its children and exits
            try:
                async with asyncio.timeout(5):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


async def _next_message(stream: asyncio.StreamReader):
    (size,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
    return _from_server.decode(await stream.readexactly(size))


# ---- the compile server -------------------------------------------------------------------

class _Child:
    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid = pid
        self.channel = channel
        self.job: Compile | None = None
        self.deadline = 0.0
        self.started = 0.0


class CompileServer:
    def __init__(self, setup: Setup, requests_fd: int, answers_fd: int) -> None:
        from engine.grammars import GrammarCompiler

        tokenizer = pickle.loads(setup.tokenizer)
        # No xgrammar cache: the front end remembers each digest's outcome itself.
        self.compiler = GrammarCompiler(lambda: tokenizer, setup.vocab_size, cache_bytes=0)
        # Built here, once: every child is forked with the tables ready.
        self.compiler.build_tables()
        self.requests_fd = requests_fd
        self.answers_fd = answers_fd
        self.selector = selectors.DefaultSelector()
        self.selector.register(requests_fd, selectors.EVENT_READ)
        self.children: list[_Child] = []
        self.queue: deque[Compile] = deque()
        for _ in range(setup.children):
            self._fork()

    def serve(self) -> None:
        _write_all(self.answers_fd, _frame(Ready(os.getpid())))
        while True:
            busy = [child for child in self.children if child.job is not None]
            wait = min((child.deadline for child in busy), default=None)
            events = self.selector.select(None if wait is None else max(0.0, wait - time.monotonic()))
            for key, _ in events:
                if key.fd == self.requests_fd:
                    try:
                        message = _read_frame(self.requests_fd, _to_server)
                    except EOFError:
                        return  # the front end is gone
                    self._take(message)
                elif key.data in self.children:  # not one replaced earlier in this round
                    self._answered(key.data)
            now = time.monotonic()
            for child in [child for child in self.children if child.job is not None and now >= child.deadline]:
                self._answer(Outcome(child.job.job, "timeout", seconds=now - child.started))
                self._replace(child)
            self._dispatch()

    def _take(self, message) -> None:
        if isinstance(message, Compile):
            self.queue.append(message)
        elif isinstance(message, Cancel):
            self.queue = deque(job for job in self.queue if job.job != message.job)
            for child in [child for child in self.children if child.job is not None and child.job.job == message.job]:
                self._replace(child)

    def _answered(self, child: _Child) -> None:
        try:
            outcome = _read_frame(child.channel.fileno(), _from_child)
        except (EOFError, OSError):
            _, status = os.waitpid(child.pid, 0)
            child.pid = -1
            if child.job is not None:
                self._answer(Outcome(child.job.job, "failed", f"the compile process ended ({_exit_status(status)})",
                                     time.monotonic() - child.started))
            self._replace(child)
            return
        child.job = None
        self._answer(outcome)

    def _answer(self, outcome: Outcome) -> None:
        _write_all(self.answers_fd, _frame(outcome))

    def _dispatch(self) -> None:
        for child in self.children:
            if not self.queue:
                return
            if child.job is None:
                job = self.queue.popleft()
                child.job, child.started = job, time.monotonic()
                child.deadline = child.started + job.deadline_s
                try:
                    child.channel.sendall(_frame(job))
                except OSError:
                    pass  # it died: its socket reads end-of-file next, and the job is answered "failed"

    def _replace(self, child: _Child) -> None:
        """Kills the child (whatever it is doing) and forks a fresh one in its place."""
        self.selector.unregister(child.channel)
        child.channel.close()
        if child.pid > 0:
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
            child.pid = -1
        self.children.remove(child)
        self._fork()

    def _fork(self) -> None:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                # What belongs to the server or to other children: a child holding the
                # server's answer pipe would keep the front end from seeing the server die.
                for fd in (self.requests_fd, self.answers_fd, self.selector.fileno()):
                    os.close(fd)
                for other in self.children:
                    other.channel.close()
                _serve_child(self.compiler, theirs)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        child = _Child(pid, ours)
        self.children.append(child)
        self.selector.register(ours, selectors.EVENT_READ, child)


def _serve_child(compiler, channel: socket.socket) -> None:
    from engine.grammars import GrammarError

    _die_with_parent()
    fd = channel.fileno()
    while True:
        try:
            job = _read_frame(fd, _to_child)
        except EOFError:
            return
        started = time.monotonic()
        try:
            compiler.compile(StructuredOutput(job.kind, job.spec))
            outcome = Outcome(job.job, seconds=time.monotonic() - started)
        except GrammarError as exc:
            outcome = Outcome(job.job, "invalid", str(exc), time.monotonic() - started)
        channel.sendall(_frame(outcome))


def _die_with_parent() -> None:
    """SIGKILL when the compile server dies (Linux), so no orphan compiles on for minutes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def _exit_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def main() -> None:
    # The protocol's pipes move off 0 and 1: anything a library prints goes to stderr.
    requests_fd, answers_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    # Ctrl-C in a terminal reaches the whole process group: the front end decides when this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        setup = _read_frame(requests_fd, _to_server)
    except EOFError:
        return
    if not isinstance(setup, Setup):
        raise SystemExit("the grammar compile server expects its Setup first")
    server = CompileServer(setup, requests_fd, answers_fd)
    try:
        server.serve()
    finally:
        for child in server.children:
            if child.pid > 0:
                os.kill(child.pid, signal.SIGKILL)
                os.waitpid(child.pid, 0)


if __name__ == "__main__":
    main()
