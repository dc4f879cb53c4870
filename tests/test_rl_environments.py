"""RL environments (k3jax/rl/environments.py, k3jax/rl/sandbox.py): the calculator's arithmetic and bounds,
the step rule shared by environments (one tool message per call, errors as text, no call ends the
episode), the Python sandbox's session, limits and refusals (each checked against an effect that would
happen without it), and loading environments by name."""

import gc
import json
import os
import socket
import threading
import time

import pytest

from k3jax.config.fields import ConfigError
from k3jax.rl.environments import Calculator, EnvTurn, calculate, load_environment
from k3jax.rl.sandbox import PythonSandbox, network_namespace_prefix
from k3jax.serving.assistant_reply import parse_reply
from k3jax.tokenizer import CLOSE, OPEN, SEP


def call(name, arguments, call_id="call_1"):
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}}


def turn(*calls):
    return [{"role": "user", "content": "compute"}, {"role": "assistant", "content": "", "tool_calls": list(calls)}]


# --- calculator ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("1 + 2", "3"), ("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("2 ** 3 ** 2", "512"), ("-2 ** 2", "-4"),
    ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("1.5 * 4", "6.0"), ("2 ** -1", "0.5"),
    ("10 ** 20", "100000000000000000000"), ("+-3", "-3"), (" 0.1 + 0.2 ", "0.30000000000000004"), ("1_000 + 1", "1001"),
])
def test_calculator_values(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("2 +", "invalid expression"),
    ("__import__('os').system('true')", "not arithmetic"), ("x + 1", "not arithmetic"), ("[1] * 3", "not arithmetic"),
    ("'a' * 3", "not arithmetic"), ("True + 1", "not arithmetic"), ("1j * 2", "not arithmetic"),
    ("(-8) ** 0.5", "not a real number"), ("1e308 * 10", "out of range"), ("2.0 ** 5000", "out of range"),
    ("(10 ** 999) * 10 ** 999", "more than 1000 digits"), ("1" * 1001, "longer than 1000"),
    ("-" * 999 + "1", "nested too deeply"),
])
def test_calculator_errors(expression, error):
    result = calculate(expression)
    assert result.startswith("error: ") and error in result, result


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "10 ** 10 ** 10", "(2 ** 3000) ** 5000", "7 ** 1200"])
def test_calculator_refuses_huge_powers_at_once(expression):
    start = time.perf_counter()
    assert calculate(expression) == "error: the result has more than 1000 digits"
    assert time.perf_counter() - start < 0.5
    assert calculate("2 ** 3000") == str(2 ** 3000)  # a large result within the bound


def test_step_answers_each_call_in_order_and_errors_as_text():
    env = Calculator()
    calls = [call("calculator", {"expression": "6 * 7"}, "a"), call("search", {"query": "x"}, "b"),
             call("calculator", "{not json", "c"), call("calculator", {}, "d"),
             call("calculator", {"expression": 3}, "e"),
             call("calculator", {"expression": "1", "precision": 2}, "f"), call("calculator", "[1, 2]", "g"),
             call("calculator", {"expression": "1/0"}, "h")]
    result = env.step(turn(*calls))
    assert not result.done and result.reward is None
    assert [m["role"] for m in result.messages] == ["tool"] * len(calls)
    assert [m["tool_call_id"] for m in result.messages] == list("abcdefgh")
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "42"
    assert contents[1] == "error: unknown tool 'search'; the tools are: calculator"
    assert contents[2].startswith("error: the arguments are not valid JSON")
    assert contents[3] == "error: missing argument 'expression'"
    assert contents[4] == "error: argument 'expression' must be a string, got 3"
    assert contents[5].startswith("error: unknown argument 'precision'")
    assert contents[6] == "error: the arguments must be a JSON object, got list"
    assert contents[7] == "error: division by zero"
    # arguments already parsed into an object (k3jax.data.chat accepts both forms)
    parsed = {"id": "p", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 ** 10"}}}
    assert env.step(turn(parsed)).messages[0]["content"] == "1024"


def test_no_tool_call_ends_the_episode():
    env = Calculator()
    assert env.step([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is 4."}]) \
        == EnvTurn(messages=(), done=True, reward=None)
    assert env.step(turn()).done
    with pytest.raises(ValueError, match="assistant"):
        env.step([{"role": "user", "content": "hi"}])


def test_step_reads_a_parsed_k3_reply():
    """A tool call as the serving parser produces it (K3's XTML) is answered."""
    text = (f"I should compute.{CLOSE}think{SEP}{OPEN}response{SEP}Computing.{CLOSE}response{SEP}{OPEN}tools{SEP}"
            f'{OPEN}call tool="calculator" index="1"{SEP}{OPEN}argument key="expression" type="string"{SEP}'
            f"(2 + 3) * 4{CLOSE}argument{SEP}{CLOSE}call{SEP}{CLOSE}tools{SEP}{CLOSE}message{SEP}")
    reply = parse_reply(text)
    assert len(reply.tool_calls) == 1
    messages = [{"role": "user", "content": "?"},
                {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}]
    result = Calculator().step(messages)
    assert result.messages == ({"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": "20"},)


# --- Python sandbox -----------------------------------------------------------------------------------


@pytest.fixture
def sandbox():
    made = []

    def make(**options):
        made.append(PythonSandbox(**options))
        return made[-1]

    yield make
    for box in made:
        box.close()


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def refused(output):
    return "PermissionError" in output and "is not allowed" in output


def test_sandbox_keeps_state_between_turns(sandbox):
    box = sandbox()
    assert box.tools[0]["function"]["name"] == "python"
    first = box.step(turn(call("python", {"code": "x = 41\ndef double(v):\n    return 2 * v"}, "a")))
    assert first.messages == ({"role": "tool", "tool_call_id": "a", "content": ""},) and not first.done
    assert box.run("print(x + 1)") == "42\n"
    assert box.run("double(x)") == "82\n"  # the value of a final expression
    assert box.run("import sys\nprint('to stderr', file=sys.stderr)\nNone") == "to stderr\n"
    assert box.run("1 / 0").endswith("ZeroDivisionError: division by zero\n")
    assert box.run("x") == "41\n"  # an error keeps the session
    assert box.step(turn(call("python", {"cmd": "1"}))).messages[0]["content"].startswith("error: missing argument")
    assert box.step(turn()).done


def test_sandbox_timeout_kills_and_restarts_fresh(sandbox):
    box = sandbox(timeout=1)
    box.run("x = 1")
    pid = box.pid
    start = time.monotonic()
    output = box.run("while True: pass")
    assert time.monotonic() - start < 3
    assert output.startswith("error: the code did not finish within the time limit of 1 s")
    assert "new Python process" in output
    assert not alive(pid) and box.pid is None
    after = box.run("print(x)")
    assert after.startswith("[note: this is a new Python process") and "NameError" in after
    assert box.run("print(2)") == "2\n"  # said once


def test_sandbox_survives_exits(sandbox):
    box = sandbox()
    box.run("x = 1")
    assert "SystemExit: 3" in box.run("raise SystemExit(3)")
    assert "KeyboardInterrupt" in box.run("raise KeyboardInterrupt")
    assert box.run("x") == "1\n"
    output = box.run("import os; os._exit(3)")
    assert output.startswith("error: the Python process died (exit code 3)") and "new Python process" in output
    assert "NameError" in box.run("x")


def test_sandbox_limits(sandbox):
    box = sandbox(memory_bytes=256 << 20, cpu_seconds=7, file_bytes=1 << 20)
    limits = box.run("import resource as r\nprint([r.getrlimit(k) for k in (r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_FSIZE,"
                     " r.RLIMIT_CORE)])")
    assert limits == f"{[(256 << 20, 256 << 20), (7, 8), (1 << 20, 1 << 20), (0, 0)]}\n"
    box.run("x = 5")
    assert box.run("b = bytearray(1 << 30)").endswith("MemoryError\n")  # would succeed without the limit
    assert box.run("l = [0] * (1 << 28)").endswith("MemoryError\n")
    assert box.run("print(len(bytearray(1 << 20)), x)") == "1048576 5\n"  # the session goes on
    written = box.run("open('big', 'wb').write(b'0' * (2 << 20))")
    assert "File too large" in written, written
    assert os.path.getsize(os.path.join(box.directory, "big")) <= 1 << 20


def test_sandbox_cpu_limit(sandbox):
    box = sandbox(timeout=20, cpu_seconds=1)
    start = time.monotonic()
    output = box.run("while True: pass")
    assert output.startswith("error: the Python process died (SIGXCPU: past the CPU time limit of 1 s)"), output
    assert time.monotonic() - start < 10
    assert box.run("print(1)").endswith("1\n")


def test_sandbox_writes_stay_inside(sandbox, tmp_path):
    box = sandbox()
    outside, keep = tmp_path / "outside.txt", tmp_path / "keep.txt"
    keep.write_text("kept")
    parent_file = os.path.join(os.path.dirname(box.directory), "escaped.txt")
    box.run("open('inside.txt', 'w').write('in')")
    attempts = [f"open({str(outside)!r}, 'w').write('x')", "open('../escaped.txt', 'w').write('x')",
                f"import os; os.close(os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT))",
                f"import pathlib; pathlib.Path({str(outside)!r}).write_text('x')",
                f"import shutil; shutil.copyfile('inside.txt', {str(outside)!r})",
                f"import os; os.rename('inside.txt', {str(outside)!r})", f"import os; os.remove({str(keep)!r})",
                f"import os; os.mkdir({str(tmp_path / 'newdir')!r})",
                f"import os; os.symlink({str(outside)!r}, 'link')",
                f"import sqlite3; sqlite3.connect({str(tmp_path / 'db.sqlite')!r}).execute('create table t (x)')",
                f"import sqlite3; sqlite3.connect('file:{tmp_path / 'uri.sqlite'}?mode=rwc', uri=True)"
                ".execute('create table t (x)')",
                f"import os; os.chdir({str(tmp_path)!r})", f"import os; os.open({str(tmp_path)!r}, os.O_RDONLY)",
                f"open({str(keep)!r}, 'a').write('x')",
                # '..' resolved against a directory fd, not the working directory the check would assume
                "import os\nroot = os.open('.', os.O_RDONLY)\nos.makedirs('s/t')\nos.chdir('s/t')\n"
                "os.close(os.open('../escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=root))"]
    for code in attempts:
        output = box.run(code)
        assert refused(output), (code, output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"] and keep.read_text() == "kept"
    assert not os.path.exists(parent_file)
    # inside the directory everything works
    inside = box.run(f"import os, shutil, sqlite3, tempfile\nos.chdir({box.directory!r})\nos.makedirs('d/e')\n"
                     "open('d/e/f', 'w').write('x')\n"
                     "os.rename('d/e/f', 'g')\nshutil.rmtree('d')\nos.close(tempfile.mkstemp()[0])\n"
                     "sqlite3.connect('db').execute('create table t (x)')\nos.chdir('.')\n"
                     "print(open('inside.txt').read(), sorted(f for f in os.listdir() if not f.startswith('tmp')))")
    assert inside == "in ['db', 'g', 'inside.txt', 's']\n", inside


def test_sandbox_has_no_network(sandbox, tmp_path):
    """With the audit hook alone (no network namespace): a listening TCP server and a Unix socket of the
    host stay unreached."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    unix_path = str(tmp_path / "host.sock")
    unix_server = socket.socket(socket.AF_UNIX)
    unix_server.bind(unix_path)
    unix_server.listen()
    unix_server.setblocking(False)
    port = server.getsockname()[1]
    box = sandbox(network_namespace=False)
    for code in ["import socket; socket.socket()", f"import socket; socket.create_connection(('127.0.0.1', {port}))",
                 "import socket; socket.getaddrinfo('localhost', 80)",
                 f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({unix_path!r})",
                 f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/')"]:
        output = box.run(code)
        assert refused(output), (code, output)
    for listener in (server, unix_server):
        with pytest.raises(BlockingIOError):
            listener.accept()
        listener.close()
    assert box.run("import asyncio; asyncio.run(asyncio.sleep(0)); 'asyncio works'") == "'asyncio works'\n"


@pytest.mark.skipif(not network_namespace_prefix(), reason="'unshare --net' does not work here")
def test_sandbox_network_namespace(sandbox):
    box = sandbox()  # default: a new network namespace where it works
    theirs = box.run("import os; print(os.readlink('/proc/self/ns/net'))").strip()
    assert theirs.startswith("net:[") and theirs != os.readlink("/proc/self/ns/net")
    assert sandbox(network_namespace=False).run("import os; print(os.readlink('/proc/self/ns/net'))").strip() \
        == os.readlink("/proc/self/ns/net")


def test_sandbox_cannot_start_processes(sandbox, tmp_path):
    box = sandbox()
    marker = str(tmp_path / "ran")
    for code in [f"import os; os.system('touch {marker}')", f"import subprocess; subprocess.run(['touch', {marker!r}])",
                 "import os; os.fork()", f"import os; os.posix_spawn('/usr/bin/touch', ['touch', {marker!r}], {{}})",
                 f"import os; os.execv('/usr/bin/touch', ['touch', {marker!r}])",
                 "import _posixsubprocess; _posixsubprocess.fork_exec()",
                 "import sys; del sys.modules['_posixsubprocess']; import _posixsubprocess",
                 "import ctypes; ctypes.CDLL(None).fork()", "import os; os.kill(1, 0)"]:
        output = box.run(code)
        assert refused(output), (code, output)
    assert not os.path.exists(marker)
    assert box.run("print('alive')") == "alive\n"


def test_sandbox_output_is_cut_in_the_middle(sandbox):
    box = sandbox(max_output=1000)
    output = box.run("print('A' * 5000 + 'B' * 5000)")
    assert len(output) < 1100
    assert output.startswith("A" * 500) and output.endswith("B" * 499 + "\n")
    assert "[... 9001 characters of output cut ...]" in output
    assert len(box.run("for i in range(100000): print(i)")) < 1100
    assert box.run("print('short')") == "short\n"


def test_sandbox_close_kills_and_removes(sandbox):
    box = sandbox()
    box.run("open('f', 'w').write('x')")
    pid, directory = box.pid, box.directory
    assert alive(pid) and os.path.exists(os.path.join(directory, "f"))
    box.close()
    assert not alive(pid) and not os.path.exists(directory)
    assert box.run("1") == "error: the sandbox is closed"
    box.close()


def test_sandbox_is_freed_when_dropped():
    box = PythonSandbox()
    box.run("1")
    pid, directory = box.pid, box.directory
    del box
    gc.collect()
    assert not alive(pid) and not os.path.exists(directory)


def test_sandboxes_run_side_by_side(sandbox):
    boxes = [sandbox() for _ in range(3)]
    for i, box in enumerate(boxes):
        box.run(f"x = {i}")
    results = {}

    def work(i):
        results[i] = boxes[i].run("import time; time.sleep(0.5); x")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start < 1.3  # one after the other would take 1.5 s
    assert results == {0: "0\n", 1: "1\n", 2: "2\n"}
    assert len({box.directory for box in boxes}) == 3


# --- loading ------------------------------------------------------------------------------------------


class Echo:
    """A custom environment for load_environment: answers every call with the record's field."""

    tools = []

    def __init__(self, record, prefix):
        self.record, self.prefix = record, prefix

    def step(self, messages):
        return EnvTurn(done=True, reward=1.0)

    def close(self):
        pass


def make_echo(record, prefix="> "):
    return Echo(record, prefix)


def test_load_environment():
    calculator = load_environment("calculator")({"question": "?"})
    assert isinstance(calculator, Calculator) and calculator.tools[0]["function"]["name"] == "calculator"
    python = load_environment("python", timeout=2)({})
    try:
        assert isinstance(python, PythonSandbox) and python.timeout == 2 and "2 s per call" in str(python.tools)
    finally:
        python.close()
    echo = load_environment(f"{__name__}:make_echo", prefix="# ")({"answer": "4"})
    assert isinstance(echo, Echo) and echo.record == {"answer": "4"} and echo.prefix == "# "
    for name, options, message in [
        ("calculater", {}, "unknown environment 'calculater' (did you mean 'calculator'?)"),
        ("python", {"timeot": 1}, "unexpected keyword argument 'timeot'"),
        ("python", {"timeout": -1}, "timeout must be a positive number"),
        ("python", {"cpu_seconds": 0.5}, "cpu_seconds must be a positive integer"),
        ("calculator", {"precision": 3}, "unexpected keyword argument 'precision'"),
        ("no_such_module_xyz:make", {}, "no module named 'no_such_module_xyz'"),
        (f"{__name__}:make_ehco", {}, "has no attribute 'make_ehco'"),
        (f"{__name__}:make_echo", {"suffix": 1}, "unexpected keyword argument 'suffix'"),
    ]:
        with pytest.raises(ConfigError, match="^train.rl.environment: ") as error:
            load_environment(name, **options)
        assert message in str(error.value), str(error.value)
