"""The ``python`` tool of agentic RL rollouts: code run in a sandboxed child process, one per rollout, whose
globals persist across the rollout's turns (a REPL: what the code prints, its errors, and the value of a
final expression).

How a :class:`PythonSandbox` confines its child, layer by layer:

- a process of its own (``python -I -B``: no user site, no ``PYTHON*`` variables, no bytecode written),
  started on the first call, in a session of its own (killed as a group), with a minimal environment
  (nothing of the trainer's, such as tokens, is inherited) and a private temporary working directory
  (also ``HOME`` and ``TMPDIR``) that :meth:`PythonSandbox.close` removes; fds 0-2 are ``/dev/null``
  (requests and replies go over private copies of the pipes, as JSON lines);
- kernel limits the child sets on itself before it reads any code (``resource``): address space
  (``memory_bytes``: a memory bomb gets a MemoryError), CPU seconds over the process's life
  (``cpu_seconds``: the kernel kills it past that, e.g. a thread left spinning between calls), the size
  of a file (``file_bytes``: a longer write fails with EFBIG), no core dumps;
- a wall-clock limit per call, kept by the parent (``timeout``): past it the process group is killed,
  the call's message says so, and the next call starts a fresh process (its output says the earlier
  state is gone; files in the directory remain). A process that dies (``os._exit``, a limit) is
  reported and replaced the same way; output beyond ``max_output`` characters is cut in the middle;
- a new network namespace (``unshare --net``, util-linux; ``network_namespace``, by default where it
  works, e.g. as root): no interface but a loopback that is down, so no network whatever the code does;
- an audit hook (``sys.addaudithook``: Python code cannot remove it), installed before any code runs,
  whose state is out of the code's reach (own globals and builtins, no references left), that refuses
  with PermissionError: sockets (all but AF_UNIX ones, which cannot connect, bind or send: asyncio's
  self-pipe works), new processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``,
  ``os.posix_spawn``, ``pty``; ``_posixsubprocess.fork_exec`` is replaced and not re-importable),
  signals to other processes, ``ctypes`` calls and loads, ``fcntl.ioctl``, sqlite extensions, syslog,
  changing resource limits, ``gc`` walks of all objects; writes outside the directory: ``open`` for
  writing or creating, ``os.remove``/``rename``/``mkdir``/``rmdir``/``truncate``/``chmod``/``chown``/
  ``utime``/xattr, ``shutil``'s copies, moves and deletions, and ``sqlite3.connect`` need a path inside
  it (``/dev/null`` aside); ``os.link``/``os.symlink`` are refused (so no link inside leads out), as are
  relative paths with ``..`` in those and in ``os.open`` (they could be resolved against a ``dir_fd``)
  and ``os.open`` of a directory outside (its fd could serve as a ``dir_fd``); ``os.chdir`` stays inside.

What it does NOT protect against:

- reading: the child runs as the trainer's user and may read whatever that user can (datasets and their
  answers, checkpoints, ``/proc`` of other processes); only the environment variables are withheld. (A
  separate unprivileged user would confine reads and writes by file permissions, but needs a Python
  installation that user can read, which a virtual environment under root's home is not.)
- a determined escape from the audit hook, which is a tripwire, not a boundary (PEP 578): native code
  (an extension module or library written into the directory and imported), interpreter internals,
  check-then-use races (a path-like object whose value changes, threads swapping files), the calls
  Python does not audit (``os.mkfifo``, ``os.mknod``). The kernel layers (limits, network namespace,
  process group) still hold then; the file system is not protected by them;
- disk use beyond one file's size (no quota on the number or total of files) and CPU contention with
  the trainer (no cgroup or nice level);
- the number of processes: ``RLIMIT_NPROC`` counts all the processes of a user (the trainer's threads
  too) and does not bind root, so it is not set; only the hook stops new processes.

One sandbox serves one rollout from one thread; sandboxes of concurrent rollouts run side by side.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

from k3jax.rl.environments import ToolEnvironment, function_tool

STARTUP_SECONDS = 30.0  # for a child to start and report ready (not counted in a call's time limit)
LOST_STATE = ("the next call runs in a new Python process, without the variables, functions and imports of "
              "earlier calls (files in the working directory remain)")
NEW_PROCESS = ("[note: this is a new Python process: the variables, functions and imports of earlier calls are "
               "gone]\n")

# The child: sets its limits, hides the protocol pipes, installs the audit hook, then runs requests.
SERVER = r'''
import ast, builtins, contextlib, io, json, linecache, os, resource, socket, stat, sys, traceback

config = json.loads(sys.argv[1])
root = config["root"]
cpu = config["cpu_seconds"]
for limit, soft, hard in ((resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
                          (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU, then SIGKILL
                          (resource.RLIMIT_FSIZE, config["file_bytes"], config["file_bytes"]),
                          (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(limit, (soft, hard))
requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
os.chdir(root)
import ctypes  # loaded now, so libraries that import it (numpy) still can; its loads and calls are refused
import _posixsubprocess


def _no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed")


_posixsubprocess.fork_exec = _no_fork_exec

HOOK = """
def deny(what):
    raise PermissionError("sandbox: " + what + " is not allowed")


def text(path):
    # a path argument as a plain str (not a subclass that could lie to the checks); None for an fd
    if isinstance(path, int):
        return None
    path = fspath(path)
    return bytes.decode(path, "utf-8", "surrogateescape") if isinstance(path, bytes) else "".join((path,))


def location(path, exact):
    # the absolute normalized path, '' for a relative one without '..', None for an fd
    path = text(path)
    if path is None:
        return None
    parts = path.split("/")
    if not path.startswith("/"):
        if ".." not in parts:
            return ""
        if not exact:
            deny("a relative path with '..' (" + repr(path) + ")")
        parts = getcwd().split("/") + parts
    out = []
    for part in parts:
        if part == "..":
            if out:
                out.pop()
        elif part and part != ".":
            out.append(part)
    return "/" + "/".join(out)


def inside(where):
    return where == "" or where == ROOT or where.startswith(ROOT + "/")


def check_write(path, what):
    where = location(path, False)
    if where is None:
        if what != "os.truncate":  # a file opened for writing is inside (or a pipe, /dev/null)
            deny(what + " on a file descriptor")
        return
    if not inside(where) and where != "/dev/null":
        deny(what + " " + repr(path) + " outside the working directory " + ROOT)


def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if flags & WRITE_FLAGS:
            if not isinstance(path, int):  # an fd is open already
                check_write(path, "writing")
        elif mode is None:  # os.open: no directory fd outside, which could serve as a dir_fd
            where = location(path, False)
            if where and not inside(where):
                try:
                    is_dir = S_ISDIR(stat(where).st_mode)
                except OSError:
                    is_dir = False
                if is_dir:
                    deny("opening the directory " + repr(where))
    elif event in WRITES:
        for i in WRITES[event]:
            if len(args) > i and args[i] is not None:
                check_write(args[i], event)
    elif event == "sqlite3.connect":  # ":memory:" and "" count as relative paths inside
        if text(args[0]).startswith("file:"):
            deny("an sqlite URI")
        check_write(args[0], event)
    elif event == "os.chdir":
        where = location(args[0], True)
        if where is not None and not inside(where):
            deny("changing directory to " + repr(args[0]))
    elif event == "socket.__new__":
        if args[1] != AF_UNIX:
            deny("the network")
    elif event.startswith(DENIED_PREFIXES) or event in DENIED:
        deny(event)
    elif event == "import" and args[0] == "_posixsubprocess":
        deny("re-importing _posixsubprocess")
"""
WRITE_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.truncate": (0,),
                "os.utime": (0,), "os.chmod": (0,), "os.chown": (0,), "os.chflags": (0,), "os.setxattr": (0,),
                "os.removexattr": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,),
                "shutil.copytree": (1,), "shutil.move": (0, 1), "shutil.rmtree": (0,), "shutil.chown": (0,),
                "shutil.make_archive": (0,), "shutil.unpack_archive": (1,)}
namespace = {"__builtins__": dict(vars(builtins)), "ROOT": root, "WRITES": WRITE_EVENTS,
             "WRITE_FLAGS": os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
             "DENIED_PREFIXES": ("socket.", "ctypes.", "syslog."),
             "DENIED": frozenset({"os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                                  "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "os.link", "os.symlink",
                                  "fcntl.ioctl", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
                                  "gc.get_referrers", "gc.get_referents", "sqlite3.enable_load_extension",
                                  "sqlite3.load_extension"}),
             "AF_UNIX": socket.AF_UNIX, "fspath": os.fspath, "getcwd": os.getcwd, "stat": os.stat,
             "S_ISDIR": stat.S_ISDIR}
exec(compile(HOOK, "<sandbox>", "exec"), namespace)
sys.addaudithook(namespace.pop("hook"))
del namespace, HOOK, WRITE_EVENTS


class Capture(io.TextIOBase):
    """stdout and stderr of a call: its first and last limit / 2 characters, and how many were cut."""
    encoding = "utf-8"

    def __init__(self, limit):
        self.head_limit, self.tail_limit = limit // 2, limit - limit // 2
        self.head, self.tail, self.total = "", "", 0

    def writable(self):
        return True

    def write(self, text):
        text = str(text)
        written = len(text)
        self.total += written
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += text[:room]
            text = text[room:]
        if text:
            self.tail = (self.tail + text[-self.tail_limit:])[-self.tail_limit:]
        return written

    def text(self):
        cut = self.total - len(self.head) - len(self.tail)
        return self.head + (f"\n[... {cut} characters of output cut ...]\n" if cut else "") + self.tail


def run(code, namespace, cell):
    name = f"<cell {cell}>"
    started = False
    try:
        tree = ast.parse(code, name, "exec")
        last = ast.Expression(tree.body.pop().value) if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        started = True
        exec(compile(tree, name, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, name, "eval"), namespace)
            if value is not None:
                print(repr(value))
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the session goes on
        tb = e.__traceback__.tb_next if started and e.__traceback__ is not None else None
        report = traceback.TracebackException(type(e), e, tb)
        for part in [report, report.__cause__, report.__context__]:  # the hook's frames are noise
            if part is not None:
                part.stack = traceback.StackSummary.from_list([f for f in part.stack if f.filename != "<sandbox>"])
        print("".join(report.format()), end="", file=sys.stderr)


namespace = {"__name__": "__main__", "__builtins__": builtins}
replies.write(b'{"ready": true}\n')
replies.flush()
for line in requests:
    request = json.loads(line)
    capture = Capture(config["max_output"])
    with contextlib.redirect_stdout(capture), contextlib.redirect_stderr(capture):
        run(request["code"], namespace, request["seq"])
    replies.write(json.dumps({"seq": request["seq"], "output": capture.text()}).encode() + b"\n")
    replies.flush()
'''


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """The command prefix that runs a program in a new network namespace here, or () where that fails
    (no ``unshare``, or not allowed: it needs root or unprivileged user namespaces)."""
    if shutil.which("unshare") is None:
        return ()
    for prefix in (("unshare", "--net"), ("unshare", "--user", "--net")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    return ()


class _Child:
    """A running server process: its pipes and the reply bytes read but not yet consumed."""

    def __init__(self, command: list[str], directory: str):
        env = {"PATH": os.defpath, "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=directory, env=env, start_new_session=True)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.pending = b""

    def send(self, data: bytes, deadline: float) -> bool:
        """Write ``data`` to the child by ``deadline``; False if it is gone or not reading."""
        fd = self.proc.stdin.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return False
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
            except OSError:  # the child is gone (EPIPE)
                return False
        return True

    def receive(self, seq: int | None, deadline: float, limit: int) -> dict | str:
        """The child's next reply (the ready line when ``seq`` is None; other lines are skipped), or why
        none came: ``"timeout"``, ``"died"`` (its output ended), ``"garbled"`` (a line over ``limit``)."""
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            line, newline, rest = self.pending.partition(b"\n")
            if newline:
                self.pending = rest
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue
                if isinstance(reply, dict) and reply.get("seq") == seq and (seq is not None or reply.get("ready")):
                    return reply
                continue
            if len(self.pending) > limit:
                return "garbled"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            if not poller.poll(remaining * 1000):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "died"
            self.pending += chunk

    def startup_errors(self) -> str:
        """What the child wrote to its stderr before hiding it; closes the pipe. Call once it has either
        exited or reported ready (then the text is empty and this does not block)."""
        if self.proc.poll() is None:
            self.proc.stderr.close()
            return ""
        with self.proc.stderr:
            return self.proc.stderr.read(4096).decode(errors="replace").strip()

    def kill(self) -> int | None:
        """Kill the process group, reap the child and close the pipes; its exit status (None if unknown)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            status = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            status = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return status


class _Resources:
    """What a sandbox holds, apart from the sandbox so that its finalizer (``weakref.finalize``, which
    also runs at exit) can free them: the child and the directory."""

    def __init__(self, directory: str):
        self.directory = directory
        self.child: _Child | None = None

    def kill_child(self) -> int | None:
        child, self.child = self.child, None
        return child.kill() if child is not None else None

    def __call__(self):
        self.kill_child()
        shutil.rmtree(self.directory, ignore_errors=True)


def _describe_exit(status: int | None, cpu_seconds: int) -> str:
    if status is None:
        return "it stopped answering"
    if status >= 0:
        return f"exit code {status}"
    if -status == signal.SIGXCPU:
        return f"SIGXCPU: past the CPU time limit of {cpu_seconds} s"
    return signal.Signals(-status).name if -status in signal.valid_signals() else f"signal {-status}"


class PythonSandbox(ToolEnvironment):
    """The ``python`` tool: a persistent Python session in a confined child process (module docstring).

    ``timeout``: wall-clock seconds per call; ``memory_bytes``: address-space limit of the process;
    ``cpu_seconds``: CPU-time limit of the process over all its calls; ``file_bytes``: the largest file
    it may write; ``max_output``: characters of a call's output kept (the first and last halves);
    ``network_namespace``: run it in a new network namespace (None: where that works here; True: fail if
    it does not)."""

    def __init__(self, timeout: float = 5.0, memory_bytes: int = 512 << 20, cpu_seconds: int = 60,
                 file_bytes: int = 16 << 20, max_output: int = 4096, network_namespace: bool | None = None):
        for option, value, kind in (("timeout", timeout, (int, float)), ("memory_bytes", memory_bytes, int),
                                    ("cpu_seconds", cpu_seconds, int), ("file_bytes", file_bytes, int),
                                    ("max_output", max_output, int)):
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                raise ValueError(f"{option} must be a positive {'integer' if kind is int else 'number'}, "
                                 f"got {value!r}")
        prefix = network_namespace_prefix() if network_namespace is not False else ()
        if network_namespace and not prefix:
            raise ValueError("network_namespace=True, but 'unshare --net' does not work here")
        self.timeout, self.max_output, self._cpu_seconds = float(timeout), max_output, cpu_seconds
        self.tools = [function_tool(
            "python", f"Run Python code in a persistent session: variables, functions and imports are kept "
            f"between calls. Returns what the code prints (stdout and stderr) and the value of a final "
            f"expression. Limits: {self.timeout:g} s per call, {memory_bytes >> 20} MiB of memory; no "
            f"network; files can only be written in the working directory.", code="the Python code to run")]
        self._resources = _Resources(os.path.realpath(tempfile.mkdtemp(prefix="k3jax-sandbox-")))
        self._finalizer = weakref.finalize(self, self._resources)
        config = {"root": self._resources.directory, "memory_bytes": memory_bytes, "cpu_seconds": cpu_seconds,
                  "file_bytes": file_bytes, "max_output": max_output}
        self._command = [*prefix, sys.executable, "-I", "-B", "-c", SERVER, json.dumps(config)]
        self._seq = 0
        self._restarted = False  # the next call runs in a new process after one was lost

    @property
    def directory(self) -> str:
        """The sandbox's working directory (removed by :meth:`close`)."""
        return self._resources.directory

    @property
    def pid(self) -> int | None:
        """The child's process id; None before the first call, after a lost process and after close."""
        child = self._resources.child
        return child.proc.pid if child is not None else None

    def run_tool(self, name: str, arguments: dict) -> str:
        return self.run(arguments["code"])

    def run(self, code: str) -> str:
        """Run ``code`` in the session: its output, or an error text when the call could not complete."""
        if not self._finalizer.alive:
            return "error: the sandbox is closed"
        note = NEW_PROCESS if self._restarted else ""
        child = self._resources.child or self._start()
        if isinstance(child, str):
            return child
        self._restarted = False
        self._seq += 1
        request = (json.dumps({"seq": self._seq, "code": code}) + "\n").encode()
        deadline = time.monotonic() + self.timeout
        reply = "timeout"  # or the child is gone: told apart below
        if child.send(request, deadline):  # a reply line is at most 12 bytes a character (JSON escapes)
            reply = child.receive(self._seq, deadline, 12 * self.max_output + 4096)
        if isinstance(reply, dict):
            return note + str(reply.get("output"))
        if reply == "timeout" and child.proc.poll() is None:
            self._lose()
            return (f"error: the code did not finish within the time limit of {self.timeout:g} s and was stopped; "
                    f"{LOST_STATE}")
        status = self._lose()
        what = "sent a malformed reply" if reply == "garbled" else f"died ({_describe_exit(status, self._cpu_seconds)})"
        return f"error: the Python process {what}; {LOST_STATE}"

    def _start(self) -> _Child | str:
        """A new child, ready for requests; an error text if it could not start."""
        try:
            child = _Child(self._command, self.directory)
        except OSError as e:
            return f"error: the Python sandbox could not start ({e})"
        ready = child.receive(None, time.monotonic() + STARTUP_SECONDS, 4096)
        if not isinstance(ready, dict):
            status = child.kill()
            return (f"error: the Python sandbox could not start ({_describe_exit(status, self._cpu_seconds)}): "
                    f"{child.startup_errors()}")
        child.startup_errors()  # none: from now on the child's fd 2 is /dev/null
        self._resources.child = child
        return child

    def _lose(self) -> int | None:
        """Kill the child after a failed call; the next call starts a fresh one."""
        self._restarted = True
        return self._resources.kill_child()

    def close(self) -> None:
        """Kill the child and remove the directory (idempotent)."""
        self._finalizer()
