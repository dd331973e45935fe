"""A sandboxed Python runner for tool calls: each program runs in a fresh `python -I -S -B`
subprocess, in an empty temporary directory, under

- a wall-clock timeout (the whole process group is killed) and RLIMIT_CPU;
- RLIMIT_AS (memory) and RLIMIT_FSIZE = 0 (no file grows);
- a cap on the output bytes read back (the process is killed past it);
- an audit hook, installed before the program runs, that refuses sockets, subprocesses,
  exec/fork/spawn, ctypes, and any open for writing or creating, deleting, renaming or making
  files and directories (audit hooks cannot be removed from Python code);
- where the OS allows an unprivileged `unshare -rn`, an empty network namespace besides.

A failing, malformed or runaway program is a `SandboxResult` (an observation), never an exception."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

# Runs in the child: read the program, install the hook, run it; a last expression's value is
# printed, as a REPL (or a calculator) would.
_BOOTSTRAP = r'''
import ast, os, resource, sys
# The limits first (argv: CPU seconds, address-space bytes): lowered, they cannot be raised again.
cpu, memory = int(sys.argv[1]), int(sys.argv[2])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, 0),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
src = sys.stdin.read()
sys.stdin.close()
_W = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DENY = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.link", "os.symlink", "os.truncate",
         "os.chmod", "os.chown", "os.utime", "os.system", "os.fork", "os.forkpty", "os.kill",
         "os.killpg", "os.chdir", "os.setxattr", "os.removexattr", "shutil.rmtree", "pty.spawn",
         "mmap.__new__", "sys.remote_exec"}
_PREFIX = ("socket.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.", "_ctypes.",
           "winreg.", "webbrowser.", "urllib.", "http.", "ftplib.", "smtplib.", "telnetlib.")
_BAD_MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "_socket", "socket", "ssl", "_ssl", "mmap",
                "_posixshmem", "_multiprocessing"}
def _hook(event, args):
    if event in _DENY or event.startswith(_PREFIX):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and isinstance(args[2], int) and args[2] & _W:
        raise PermissionError(f"sandbox: opening {args[0]!r} for writing is not allowed")
    if event == "import" and args[0].split(".")[0] in _BAD_MODULES:
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
sys.addaudithook(_hook)
del _hook
# Calls that make files but raise no audit event: gone from os and posix.
import posix
for _name in ("mkfifo", "mknod"):
    for _module in (os, posix):
        if hasattr(_module, _name):
            delattr(_module, _name)
tree = ast.parse(src, "<tool>")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
env = {"__name__": "__main__", "__builtins__": __builtins__}
exec(compile(tree, "<tool>", "exec"), env)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), env)
    if value is not None:
        print(repr(value))
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock
    memory_bytes: int = 256 * 1024**2  # address space
    max_output_bytes: int = 16 * 1024  # stdout and stderr together
    max_program_chars: int = 64 * 1024


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str  # the program's traceback, or what the sandbox did to it
    returncode: int | None
    timed_out: bool = False
    killed: bool = False  # by a limit (time, memory, CPU, output)
    truncated: bool = False  # output beyond max_output_bytes was cut off

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not (self.timed_out or self.killed)

    def observation(self) -> str:
        """What the model is shown: the output, then what went wrong, if anything."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.timed_out:
            parts.append("error: timed out")
        elif self.killed:
            parts.append("error: killed (a resource limit was exceeded)")
        if self.truncated:
            parts.append("(output truncated)")
        if self.stderr.strip() and not self.ok:
            parts.append(self._last_error())
        return "\n".join(parts) if parts else "(no output)"

    def _last_error(self) -> str:
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        return "error: " + (lines[-1] if lines else "failed")


@functools.cache
def _netns_prefix() -> tuple[str, ...]:
    """`unshare -rn --` if an unprivileged user can make a network namespace here, else nothing
    (the audit hook refuses sockets either way)."""
    tool = shutil.which("unshare")
    if tool is None:
        return ()
    try:
        ok = subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (tool, "-rn", "--") if ok else ()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_python(program: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `program` in the sandbox; its printed output (and a last expression's value) back."""
    if len(program) > limits.max_program_chars:
        return SandboxResult("", f"the program is longer than {limits.max_program_chars} characters", None)
    # The child sets its own rlimits (no preexec_fn: this may run from any thread).
    cmd = [*_netns_prefix(), sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP,
           str(int(limits.timeout_s) + 1), str(limits.memory_bytes)]
    with tempfile.TemporaryDirectory(prefix="rose-tool-") as cwd:
        os.chmod(cwd, 0o500)  # read-only for the program too
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=cwd, start_new_session=True,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except OSError as e:
            return SandboxResult("", f"the sandbox could not start: {e}", None)
        try:
            return _collect(proc, program, limits)
        finally:
            _kill(proc)
            proc.wait()
            os.chmod(cwd, 0o700)


def _collect(proc: subprocess.Popen[bytes], program: str, limits: SandboxLimits) -> SandboxResult:
    assert proc.stdin and proc.stdout and proc.stderr
    try:
        proc.stdin.write(program.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.timeout_s
    out: dict[Any, bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for f in out:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                out[key.fileobj] += chunk
            if sum(len(b) for b in out.values()) > limits.max_output_bytes:
                truncated = True
                break
    if timed_out or truncated:
        _kill(proc)
    try:
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill(proc)
        code, timed_out = proc.wait(), True
    cap = limits.max_output_bytes
    stdout = bytes(out[proc.stdout])[:cap].decode(errors="replace")
    stderr = bytes(out[proc.stderr])[:max(0, cap - len(out[proc.stdout]))].decode(errors="replace")
    killed = timed_out or truncated or code < 0
    return SandboxResult(stdout, stderr, None if killed else code, timed_out, killed, truncated)


# The tools' OpenAI function schemas; `run_tool` answers a call of either.
PYTHON_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "python",
    "description": "Run a short Python program (no network, no file writes, limited time and memory) "
                   "and return what it prints; the value of a last expression is printed too.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}
CALCULATOR_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "calculator",
    "description": ("Evaluate an arithmetic expression in Python syntax, e.g. (3 + 4) ** 2 / 7 "
                    "or math.sqrt(2)."),
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
TOOLS = {"python": PYTHON_TOOL, "calculator": CALCULATOR_TOOL}


def run_tool(name: str, arguments: dict[str, Any], limits: SandboxLimits = SandboxLimits()) -> str:
    """The observation for a call of `python` or `calculator`; bad arguments are an error observation."""
    key = {"python": "code", "calculator": "expression"}.get(name)
    if key is None:
        return f"error: unknown tool {name!r}; the tools are {sorted(TOOLS)}"
    value = arguments.get(key)
    if not isinstance(value, str):
        return f"error: {name} needs a string argument {key!r}"
    program = value if name == "python" else f"import math\n({value})"
    return run_python(program, limits).observation()
