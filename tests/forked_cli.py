"""`ster` for a test that runs many command lines: one server process imports the command line (and
torch under it) once, then forks a fresh process per command, which runs `python -m ster_dist.cli`'s
module as __main__ with the caller's argv, working directory, environment, umask and
stdin/stdout/stderr.

A command started this way pays none of the few seconds each `python -m ster_dist.cli` spends
importing; what it runs is the same: the same module, a process of its own (its own Ray driver,
atexit handlers, exit status). The caller is a small client (`python forked_cli.py SOCKET ARGS...`,
no torch) standing where the command would: it hands over its three descriptors, forwards the
signals it gets (`kill -TERM %1` reaches the command) and exits as the command did.

The server imports nothing that starts threads or holds sockets (never Ray: gRPC does not survive a
fork), so each forked command starts as clean as a new interpreter past its imports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

# Run as a script, this file's folder would come first on sys.path, and tests/' part folders share names
# with installed packages (tests/kernels with Hugging Face's `kernels`, which Transformers imports): the
# commands it runs import only the installed ones.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

# what most commands import before their first step; Ray and DeepSpeed stay out (see above)
WARM = ("ster_dist.cli", "ster_dist.jobqueue.queue", "ster_dist.engine", "ster_dist.load")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _send(conn: socket.socket, data: dict, fds: list[int] = ()) -> None:
    body = json.dumps(data).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], list(fds))


def _recv(conn: socket.socket, want_fds: int = 0) -> tuple[dict | None, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, want_fds)
    if len(head) < 4:
        return None, fds
    size, body = struct.unpack("!I", head)[0], b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# -- the server
# --------------------------------------------------------------------------------------


def serve(path: str) -> None:
    import importlib

    for name in WARM:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-command waiters reap themselves
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            code = 1
            try:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                code = _wait_for_one(conn)
            finally:  # never back into this loop: the waiter ends here, whatever happened
                os._exit(code)
        conn.close()


def _wait_for_one(conn: socket.socket) -> int:
    """The waiter: forks the command, tells the client its pid, then how it ended."""
    request, fds = _recv(conn, 3)
    if request is None or len(fds) != 3:
        return 1
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_command(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"pid": pid})
    except OSError:  # the client is gone: so is the command
        os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    try:
        _send(conn, {"status": status})
    except OSError:
        return 1
    return 0


def _run_command(request: dict, fds: list[int]) -> None:
    import atexit
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, as a command is not in the server's
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        sys.stderr = sys.__stderr__ = open(
            2, "w", buffering=1, errors="backslashreplace", closefd=False
        )
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.umask(request["umask"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["ster", *request["argv"]]
        del sys.modules["ster_dist.cli"]  # run as __main__ alone, as `python -m` runs it
        try:
            runpy.run_module("ster_dist.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:  # what the interpreter does with sys.exit's argument
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # as interpreter exit: non-daemon threads, then atexit, then flush
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# -- the client
# --------------------------------------------------------------------------------------


def client(path: str, argv: list[str]) -> int:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    umask = os.umask(0)
    os.umask(umask)
    _send(
        conn, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask}, [0, 1, 2]
    )
    started, _ = _recv(conn)
    if started is None:
        print("tests/forked_cli.py: the server did not start the command", file=sys.stderr)
        return 1
    pid = started["pid"]

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it has ended; its status is on the way
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    ended, _ = _recv(conn)
    if ended is None:
        print("tests/forked_cli.py: the server lost the command", file=sys.stderr)
        return 1
    status = ended["status"]
    if os.WIFSIGNALED(status):  # end as the command did
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
