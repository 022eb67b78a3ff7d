"""The resident worker inside a container sandbox, and the host side of its wire format.

A warm container runs ``python3 -I -S -c WORKER`` as its main process, blocked on stdin. The
host sends one job: a 4-byte big-endian length, a JSON header, then ``stdin_len`` bytes of stdin
for the tool. The worker answers on stdout with frames ``kind (1 byte) | length (4 bytes) | data``:

    o  a chunk of the tool's stdout        e  a chunk of the tool's stderr
    x  exit: {"code", "signal", "cpu_s", "max_rss_kb", "oom_kills"} as JSON
    f  an output file: 4-byte header length, JSON {"path", "size"}, then its bytes
    r  a refused output entry: JSON {"path", "why"}   (symlinks, devices, over the caps)
    d  done: nothing more follows
    R  ready (sent once, before the first job)

``python`` jobs run in the worker's own process (its interpreter is already up: that is what
makes a warm call fast); ``exec`` jobs are forked and exec'd. The worker shares the tool's uid, so
the host treats every frame as untrusted output of the tool: it is capped, parsed defensively,
and file paths are rebuilt by the host, never trusted as given.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

WORKER = r'''
import json, os, resource, signal, struct, sys, selectors, socket, subprocess, time, traceback

def write_all(data):
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]

def frame(kind, data):
    write_all(kind + struct.pack(">I", len(data)) + data)

def read_exact(n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(0, min(n - got, 1 << 20))
        if not chunk:
            os._exit(0)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)

class Framed:
    """sys.stdout/sys.stderr for in-process python tools: every write becomes a frame."""
    def __init__(self, kind):
        self.kind = kind
    def write(self, text):
        if text:
            frame(self.kind, text.encode("utf-8", "replace"))
        return len(text)
    def flush(self):
        pass

def oom_kills():
    for path in ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events"):
        try:
            for line in open(path):
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
    return 0

def start_bridge():
    # The egress proxy's socket is mounted at /run/stockade/egress.sock; tools reach it as an
    # ordinary HTTP proxy on 127.0.0.1:3128.
    subprocess.Popen(["socat", "TCP-LISTEN:3128,bind=127.0.0.1,fork,reuseaddr",
                      "UNIX-CONNECT:/run/stockade/egress.sock"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        probe = socket.socket()
        try:
            if probe.connect_ex(("127.0.0.1", 3128)) == 0:
                return
        finally:
            probe.close()
        time.sleep(0.002)

def reap_leftovers():
    """Kill every other process of this uid in the container (the tool's descendants), and reap them.
    The kill is repeated until none is left: a process forked while one kill was being delivered
    can miss it (seen under gVisor), and would otherwise be waited for until the call timed out."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)

def run_python(job, payload):
    # The job's environment (proxy, credential placeholders, CA bundle) replaces the last job's.
    os.environ.clear()
    os.environ.update(job.get("env", {}))
    before = resource.getrusage(resource.RUSAGE_SELF)
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Framed(b"e"), Framed(b"e")
    code = 0
    try:
        spec = json.loads(payload)
        namespace = {"__name__": "stockade_tool"}
        exec(compile(spec["source"], "<tool>", "exec"), namespace)
        fn = namespace.get(spec["entrypoint"])
        if not callable(fn):
            raise SystemExit("stockade: entrypoint %r is not defined by the tool source" % spec["entrypoint"])
        frame(b"o", json.dumps({"result": fn(**spec["args"])}).encode())
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            frame(b"e", (str(exc.code) + "\n").encode())
    except BaseException:
        code = 1
        frame(b"e", traceback.format_exc().encode())
    sys.stdout, sys.stderr = real_out, real_err
    reap_leftovers()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"code": code, "signal": 0, "cpu_s": cpu, "max_rss_kb": after.ru_maxrss}

def run_exec(job, payload):
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(r_in, 0); os.dup2(w_out, 1); os.dup2(w_err, 2)
            for fd in (r_in, w_in, r_out, w_out, r_err, w_err):
                os.close(fd)
            os.chdir(job.get("cwd", "/tmp"))
            os.execvpe(job["argv"][0], job["argv"], job["env"])
        except BaseException as exc:
            os.write(2, ("stockade: cannot run %r: %s\n" % (job["argv"][0], exc)).encode())
        os._exit(127)
    for fd in (r_in, w_out, w_err):
        os.close(fd)
    sel = selectors.DefaultSelector()
    sel.register(r_out, selectors.EVENT_READ, b"o")
    sel.register(r_err, selectors.EVENT_READ, b"e")
    pending = memoryview(payload)
    if pending:
        os.set_blocking(w_in, False)
        sel.register(w_in, selectors.EVENT_WRITE, None)
    else:
        os.close(w_in)
    status = usage = None
    drain_until = None
    while len(sel.get_map()):
        if status is None:
            done, status_now, usage_now = os.wait4(pid, os.WNOHANG)
            if done:
                status, usage = status_now, usage_now
                # The tool is gone: whatever it left running goes too, and holds no pipe open.
                reap_leftovers()
                drain_until = time.monotonic() + 0.5
        if drain_until is not None and time.monotonic() > drain_until:
            break
        for key, _ in sel.select(0.02 if status is None else 0.05):
            if key.data is None:
                try:
                    pending = pending[os.write(w_in, pending[:65536]):]
                except BlockingIOError:
                    continue
                except OSError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(w_in); os.close(w_in)
                continue
            chunk = os.read(key.fd, 65536)
            if chunk:
                frame(key.data, chunk)
            else:
                sel.unregister(key.fd); os.close(key.fd)
    if status is None:
        _, status, usage = os.wait4(pid, 0)
        reap_leftovers()
    code = os.waitstatus_to_exitcode(status)
    return {"code": code if code >= 0 else 128 - code, "signal": -code if code < 0 else 0,
            "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_kb": usage.ru_maxrss}

def send_outputs(limits):
    import stat
    count, total = 0, 0
    for root, dirs, files in os.walk("/out", followlinks=False):
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, "/out")
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                continue
            why = None
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file"
            elif count + 1 > limits["max_files"]:
                why = "over the file count cap"
            elif total + st.st_size > limits["max_bytes"]:
                why = "over the total size cap"
            if why:
                frame(b"r", json.dumps({"path": rel, "why": why}).encode())
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            data = b""
            with os.fdopen(fd, "rb") as handle:
                data = handle.read(limits["max_bytes"] - total + 1)
            head = json.dumps({"path": rel, "size": len(data)}).encode()
            frame(b"f", struct.pack(">I", len(head)) + head + data)
            count += 1
            total += len(data)

def main():
    session = os.environ.get("STOCKADE_WORKER_MODE") == "session"
    frame(b"R", b"")  # up and waiting: the host pools this container only after seeing it
    while True:
        header = json.loads(read_exact(struct.unpack(">I", read_exact(4))[0]))
        payload = read_exact(header["stdin_len"])
        if header.get("egress"):
            start_bridge()
        result = run_python(header, payload) if header["kind"] == "python" else run_exec(header, payload)
        result["oom_kills"] = oom_kills()
        frame(b"x", json.dumps(result).encode())
        if header.get("outputs"):
            send_outputs(header["outputs"])
        frame(b"d", b"")
        if not session:
            # Wait for the host to hang up, so the container stays alive while it reads.
            while os.read(0, 65536):
                pass
            return

main()
'''


@dataclass
class WorkerReply:
    """What the worker sent back for one job, parsed and capped by the host."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    exit: dict[str, float] | None = None
    files: list[tuple[str, bytes]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    done: bool = False
    over_cap: bool = False
    malformed: str = ""


def encode_job(header: dict[str, object], stdin: bytes) -> bytes:
    """The bytes that hand one job to a worker."""
    body = json.dumps({**header, "stdin_len": len(stdin)}).encode()
    return struct.pack(">I", len(body)) + body + stdin


class FrameReader:
    """Parses worker frames from a byte stream, enforcing the output cap on stdout+stderr
    and separate caps on files, and refusing anything malformed."""

    def __init__(self, output_cap: int, file_cap_bytes: int) -> None:
        self.reply = WorkerReply()
        self._buffer = bytearray()
        self._output_cap = output_cap
        self._file_cap = file_cap_bytes
        self._file_bytes = 0

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 5 and not self.reply.done and not self.reply.malformed:
            kind = bytes(self._buffer[:1])
            (length,) = struct.unpack(">I", self._buffer[1:5])
            if length > max(self._output_cap, self._file_cap) + (1 << 16):
                self.reply.malformed = f"frame of {length} bytes is over every cap"
                return
            if len(self._buffer) < 5 + length:
                return
            body = bytes(self._buffer[5 : 5 + length])
            del self._buffer[: 5 + length]
            self._take(kind, body)

    def _take(self, kind: bytes, body: bytes) -> None:
        reply = self.reply
        if kind in (b"o", b"e"):
            room = self._output_cap - len(reply.stdout) - len(reply.stderr)
            (reply.stdout if kind == b"o" else reply.stderr).extend(body[: max(room, 0)])
            if len(body) > room:
                reply.over_cap = True
        elif kind == b"x":
            reply.exit = _json_object(body)
        elif kind == b"f":
            (head_len,) = struct.unpack(">I", body[:4])
            head = _json_object(body[4 : 4 + head_len])
            data = body[4 + head_len :]
            self._file_bytes += len(data)
            path = head.get("path") if head else None
            if isinstance(path, str) and self._file_bytes <= self._file_cap:
                reply.files.append((path, data))
            else:
                reply.refused.append((str(path)[:200], "over the total size cap"))
        elif kind == b"r":
            info = _json_object(body) or {}
            reply.refused.append((str(info.get("path"))[:200], str(info.get("why"))[:200]))
        elif kind == b"d":
            reply.done = True
        else:
            reply.malformed = f"unknown frame kind {kind!r}"


def _json_object(data: bytes) -> dict[str, float] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
