"""The resident worker inside a container sandbox, and the host side of its wire format.

A warm container runs ``env -i python3 -I -S -c WORKER pool|session`` as its main process, blocked
on stdin, with an empty environment: what a tool needs (proxy variables, credential placeholders)
comes with each job and goes to that job's tool only. The host sends one job: a 4-byte big-endian
length, a JSON header, then ``stdin_len`` bytes of stdin for the tool. The worker answers on
stdout with frames ``kind (1 byte) | length (4 bytes) | data``:

    o  a chunk of the tool's stdout        e  a chunk of the tool's stderr
    x  exit: {"code", "signal", "cpu_s", "max_rss_kb", "oom_kills"} as JSON (the job's own OOM kills)
    f  an output file: 4-byte header length, JSON {"path", "size"}, then its bytes
    r  a refused output entry: JSON {"path", "why"}   (symlinks, devices, over the caps)
    d  done: nothing more follows
    R  ready (sent once, before the first job)

Every tool runs in a child of the worker, its stdin, stdout and stderr on pipes the worker
frames: ``exec`` jobs are forked and exec'd; ``python`` jobs are forked only (the interpreter is
already up: that is what makes a warm call fast). The child is forked ahead of its job: a spare,
waiting on a pipe for it, forked at the worker's start; forking, costly under gVisor, is off the
call path. A session's worker, once a job's reply is sent, its leftovers killed and ``/out``
emptied, executes itself again: the next job's spare is forked from an interpreter that never held
an earlier job (a python tool, forked from the worker, could read anything in its memory). The
tool runs as the worker's uid, so what it can change of the worker's process, its resource limits
(prlimit) and its priority, it could hand to every later job of the session: each next job checks
them against the session's first (`conditions`) and is not run if they changed (the container is
replaced). When the tool's process ends the worker kills whatever it left running. The host
treats every frame as untrusted output of the tool: it is capped, parsed defensively, and file
paths are rebuilt by the host, never trusted as given. The worker makes itself not dumpable, so a
tool cannot read its ``/proc`` entries (environment, memory), and as PID 1 of the container under
runc it takes no signal from the tool. gVisor lets a process of its uid signal PID 1: a tool can
end its own call there (an error, its output lost), never another session's.

A job with egress gets a bridge from ``127.0.0.1:3128`` to the proxy's socket: one process forked
from the worker for the job's length, serving every connection with a selector loop.
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass, field

WORKER = r'''
import ctypes, json, os, signal, struct, sys, selectors, socket, time, traceback

def write_all(data, fd=1):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

def frame(kind, data):
    write_all(kind + struct.pack(">I", len(data)) + data)

def read_exact(n, fd=0):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            os._exit(0)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)

class Unbuffered:
    """sys.stdout/sys.stderr for python tools: every write goes to the descriptor at once, so
    the tool's prints and a traceback reach the host in the order they were made."""
    def __init__(self, fd):
        self.fd = fd
    def write(self, text):
        if text:
            write_all(text.encode("utf-8", "replace"), self.fd)
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

BRIDGE_CONNECTIONS = 64  # open at once; more wait in the listen backlog
# Connections the kernel queues meanwhile. Past it the kernel drops handshakes, and a client that
# believed itself connected is reset: a tool opening many connections at once should just wait.
BRIDGE_BACKLOG = 1024
BRIDGE_BUFFER = 1 << 16  # bytes held per direction before the sender is no longer read
BRIDGE_LINGER = 0.5  # seconds a connection the proxy has ended stays open for the tool's last bytes

def start_bridge(held):
    # The egress proxy's socket is mounted at /run/stockade/egress.sock; tools reach it as an
    # ordinary HTTP proxy on 127.0.0.1:3128. One forked process serves every connection: a
    # process per connection (socat's fork) costs about five host threads each under gVisor,
    # counted against the container's pids limit, and a tool opening ~20 connections took the
    # whole sandbox down. The listener is up before the tool starts: no readiness probe.
    listener = socket.socket()
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 3128))
        listener.listen(BRIDGE_BACKLOG)
    except OSError as exc:
        listener.close()
        frame(b"e", ("stockade: the egress bridge could not listen on 127.0.0.1:3128: %s\n" % exc).encode())
        return
    if os.fork() == 0:
        # Never on the worker's stdin/stdout (the host's frames); reap_leftovers ends it with the job.
        # Nor on the spare's pipes (``held``): holding their write ends, it would keep the tool
        # from ever seeing the end of its job or of its stdin.
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        for fd in held:
            os.close(fd)
        try:
            bridge(listener)
        finally:
            os._exit(0)
    listener.close()

def bridge(listener):
    """Copies bytes both ways between each accepted connection and a connection to the proxy,
    holding at most BRIDGE_BUFFER per direction, passing on each half-close, and dropping both
    sides of a pair on any error. Once the proxy has ended its side and the tool has had every
    byte, the pair is dropped after BRIDGE_LINGER (as socat's -t did): a tool that never closes
    its sockets must not hold the bridge's connections."""
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    peer, pending, ended = {}, {}, set()  # the other side; bytes waiting to be sent to it; sides that sent EOF
    proxied, linger = set(), {}  # the proxy's sides; tool's side -> when its pair is dropped

    def watch(sock):
        events = 0
        if sock not in ended and len(pending[peer[sock]]) < BRIDGE_BUFFER:
            events |= selectors.EVENT_READ
        if pending[sock]:
            events |= selectors.EVENT_WRITE
        key = sel.get_map().get(sock)
        if key is None:
            if events:
                sel.register(sock, events)
        elif not events:
            sel.unregister(sock)
        elif key.events != events:
            sel.modify(sock, events)

    def drop(sock):
        other = peer.pop(sock)
        del peer[other]
        for side in (sock, other):
            if side in sel.get_map():
                sel.unregister(side)
            side.close()
            del pending[side]
            ended.discard(side)
            proxied.discard(side)
            linger.pop(side, None)
        if listener not in sel.get_map():
            sel.register(listener, selectors.EVENT_READ)

    def accept():
        while len(peer) < 2 * BRIDGE_CONNECTIONS:
            try:
                client = listener.accept()[0]
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.settimeout(5)
            try:
                upstream.connect("/run/stockade/egress.sock")
            except OSError:
                client.close()
                upstream.close()
                continue
            for side, other in ((client, upstream), (upstream, client)):
                side.setblocking(False)
                peer[side], pending[side] = other, bytearray()
            proxied.add(upstream)
            watch(client)
            watch(upstream)
        sel.unregister(listener)  # full: the backlog holds the rest until a pair closes

    while True:
        timeout = max(0, min(linger.values()) - time.monotonic()) if linger else None
        for key, events in sel.select(timeout):
            sock = key.fileobj
            if sock is listener:
                accept()
                continue
            if sock not in peer:
                continue  # dropped with its peer earlier in this batch
            other = peer[sock]
            try:
                if events & selectors.EVENT_WRITE:
                    del pending[sock][:sock.send(pending[sock])]
                    if not pending[sock] and other in ended:
                        sock.shutdown(socket.SHUT_WR)
                if events & selectors.EVENT_READ:
                    data = sock.recv(BRIDGE_BUFFER)
                    if data:
                        pending[other] += data
                    else:
                        ended.add(sock)
                        if not pending[other]:
                            other.shutdown(socket.SHUT_WR)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                drop(sock)
                continue
            if sock in ended and other in ended and not pending[sock] and not pending[other]:
                drop(sock)
                continue
            watch(sock)
            watch(other)
            for side in (sock, other):
                if side in proxied and side in ended and not pending[peer[side]]:
                    linger.setdefault(peer[side], time.monotonic() + BRIDGE_LINGER)
        now = time.monotonic()
        for client in [client for client, deadline in linger.items() if deadline <= now]:
            drop(client)

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

def set_dumpable(value):
    if ctypes.CDLL(None, use_errno=True).prctl(4, value, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        os.write(2, b"stockade worker: prctl(PR_SET_DUMPABLE) failed\n")
        os._exit(3)

def python_tool(job, payload):
    """The body of a python tool's process: runs the tool's entrypoint and writes
    ``{"result": ...}`` as JSON on stdout; whatever the tool prints goes to stderr. Never returns."""
    code = 1
    try:
        # The worker is not dumpable; the tool's process must be, so that its own /proc entries
        # (/proc/self/status, fd, environ) read as any program's.
        set_dumpable(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(job.get("env", {}))
        sys.stdout = sys.stderr = Unbuffered(2)
        code = 0
        try:
            spec = json.loads(payload)
            namespace = {"__name__": "stockade_tool"}
            exec(compile(spec["source"], "<tool>", "exec"), namespace)
            fn = namespace.get(spec["entrypoint"])
            if not callable(fn):
                raise SystemExit("stockade: entrypoint %r is not defined by the tool source" % spec["entrypoint"])
            write_all(json.dumps({"result": fn(**spec["args"])}).encode())
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int) and exc.code is not None:
                write_all((str(exc.code) + "\n").encode(), 2)
        except BaseException:
            code = 1
            write_all(traceback.format_exc().encode(), 2)
    finally:
        # As the interpreter itself exits: the status is the low byte of the code.
        os._exit(code & 0xFF)

def exec_tool(job):
    """The body of an exec tool's process: becomes the tool's program."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the worker ignores it; an ignored signal stays so across exec
    os.execvpe(job["argv"][0], job["argv"], job["env"])

def fork_spare():
    """Fork the process that will run the next job's tool, ahead of the job: forking is the
    costly part of a call (most of all under gVisor). It waits, stdin, stdout and stderr already
    on pipes the worker holds, for ``hand_job`` to send it the job on a pipe of its own.
    Returns ``(pid, job_w, w_in, r_out, r_err)``, the worker's ends."""
    r_job, w_job = os.pipe()
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    pid = os.fork()
    if pid == 0:
        job = {"argv": ["?"]}
        try:
            os.dup2(r_in, 0); os.dup2(w_out, 1); os.dup2(w_err, 2)
            for fd in (r_in, w_in, r_out, w_out, r_err, w_err, w_job):
                os.close(fd)
            # The worker's end closed (the worker gone) ends the spare in read_exact.
            job = json.loads(read_exact(struct.unpack(">I", read_exact(4, r_job))[0], r_job))
            payload = read_exact(struct.unpack(">I", read_exact(4, r_job))[0], r_job)
            os.close(r_job)
            os.chdir(job.get("cwd", "/tmp"))
            if job["kind"] == "python":
                python_tool(job, payload)
            exec_tool(job)
        except BaseException as exc:
            os.write(2, ("stockade: cannot run %r: %s\n" % (job.get("argv", ["?"])[0], exc)).encode())
        finally:
            os._exit(127)  # never back into the worker's code
    for fd in (r_job, r_in, w_out, w_err):
        os.close(fd)
    return pid, w_job, w_in, r_out, r_err

spare = None  # the worker's ends of the spare (fork_spare), when one is waiting

def hand_job(job, payload):
    """Give the job and ``payload`` (a python tool's spec; nothing for an exec tool, whose payload is
    its stdin) to the spare. Returns the spare's ends, or those of a process forked now if the spare
    is gone."""
    global spare
    (pid, w_job, *pipes), spare = spare, None
    header = json.dumps(job).encode()
    message = struct.pack(">I", len(header)) + header + struct.pack(">I", len(payload)) + payload
    alive = os.waitpid(pid, os.WNOHANG)[0] == 0
    if alive:
        try:
            write_all(message, w_job)
            os.close(w_job)
            return (pid, w_job, *pipes)
        except OSError:
            pass
    # Gone before its job (it cannot have been killed by a tool: the leftovers were reaped before
    # it was forked). No process is forked from this one in its place: it now holds the job's
    # seal, which a python tool in such a fork could read (and, under gVisor, forge the worker's
    # frames with). The job is not run; the next one gets a spare forked before its header.
    for fd in (w_job, *pipes):
        try:
            os.close(fd)
        except OSError:
            pass
    if alive:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    frame(b"e", b"stockade: the sandbox's prepared process was gone before the job; it did not run: retry\n")
    return None

NOT_RUN = {"code": 127, "signal": 0, "cpu_s": 0.0, "max_rss_kb": 0}

def run_python(job, payload):
    # Forked, not exec'd: the tool's process starts with this interpreter already up. It gets no
    # stdin (a harness's stdin is at its end once it has read its job).
    return run_child(b"", hand_job(job, payload))

def run_exec(job, payload):
    return run_child(payload, hand_job(job, b""))

def run_child(payload, child):
    """Run the job's tool in ``child`` (the spare given the job) with ``payload`` on its stdin and
    its stdout and stderr sent as frames; when the child ends, kill what it left. Returns its exit,
    CPU time and peak memory (`NOT_RUN` if there was no child to run it: `hand_job`)."""
    if child is None:
        return dict(NOT_RUN)
    pid, _, w_in, r_out, r_err = child
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
    for key in list(sel.get_map().values()):
        os.close(key.fd)  # given up on after the drain: a session's worker must not collect them
    sel.close()
    if status is None:
        _, status, usage = os.wait4(pid, 0)
        reap_leftovers()
    code = os.waitstatus_to_exitcode(status)
    return {"code": code if code >= 0 else 128 - code, "signal": -code if code < 0 else 0,
            "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_kb": usage.ru_maxrss}

def send_outputs(limits):
    # An explicit stack, never deeper than max_depth (the host's depth cap): a tool's deep /out must
    # not exhaust the worker's recursion (os.walk recurses) or end it mid-reply. Each directory is
    # opened from the last without following a link, so no path grows past PATH_MAX. Errors become
    # refused entries.
    import stat
    count, total, entries = 0, 0, 0
    max_depth = 16
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def room(rel):
        # One more entry, unless it is the last the host takes: then it says so and the walk ends.
        nonlocal entries
        entries += 1
        if entries < limits["max_entries"]:
            return True
        # The host takes no more entries than this (gVisor's /out is not held to its inode count).
        refused(rel, "over the entry count cap; later entries not listed")
        return False

    def refused(rel, why):
        frame(b"r", json.dumps({"path": rel[:200], "why": why}).encode())

    def open_dir(parts):
        fd = os.open("/out", flags)
        try:
            for part in parts:
                child = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    pending = [()]
    while pending:
        parts = pending.pop()
        where = "/".join(parts) or "."
        try:
            fd = open_dir(parts)
        except OSError:
            if not room(where):
                return
            refused(where, "unreadable")
            continue
        subdirs = []
        try:
            try:
                with os.scandir(fd) as listing:
                    names = sorted(entry.name for entry in listing)
            except OSError:
                names = []
                if not room(where):
                    return
                refused(where, "unreadable")
            for name in names:
                rel = "/".join(parts + (name,))
                try:
                    st = os.lstat(name, dir_fd=fd)
                except OSError:
                    st = None
                if st is not None and stat.S_ISDIR(st.st_mode) and len(parts) + 1 < max_depth:
                    subdirs.append(parts + (name,))
                    continue
                if not room(rel):
                    return
                why, data = None, b""
                if st is None:
                    why = "unreadable"
                elif stat.S_ISDIR(st.st_mode):
                    why = "directory deeper than %d levels: nothing under it taken" % max_depth
                elif not stat.S_ISREG(st.st_mode):
                    why = "not a regular file"
                elif count + 1 > limits["max_files"]:
                    why = "over the file count cap"
                elif total + st.st_size > limits["max_bytes"]:
                    why = "over the total size cap"
                else:
                    try:
                        file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                        with os.fdopen(file_fd, "rb") as handle:
                            data = handle.read(limits["max_bytes"] - total + 1)
                    except OSError:
                        why = "unreadable"
                if why:
                    refused(rel, why)
                    continue
                head = json.dumps({"path": rel, "size": len(data)}).encode()
                frame(b"f", struct.pack(">I", len(head)) + head + data)
                count += 1
                total += len(data)
        finally:
            os.close(fd)
        pending.extend(reversed(subdirs))

def empty_out():
    """Remove what the job left in /out: a session's next job must not find it, nor send it back as
    its own output. The tree is the tool's (as deep, and its directories as locked, as it made
    them), so nothing follows a link and no path is built: what lies below /out's top level is
    moved up to it, a level at a time, until all is gone. What cannot be removed stays."""
    import stat
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open("/out", flags)
    except OSError:
        return
    moved = 0
    try:
        progress = True
        while progress:
            progress = False
            for name in os.listdir(top):
                try:
                    os.unlink(name, dir_fd=top)
                    continue
                except IsADirectoryError:
                    pass
                except OSError:
                    continue
                try:
                    os.rmdir(name, dir_fd=top)
                    progress = True
                    continue
                except OSError:
                    pass
                try:
                    os.chmod(name, 0o700, dir_fd=top)  # a directory (unlink said so), not a link
                    sub = os.open(name, flags, dir_fd=top)
                except OSError:
                    continue
                try:
                    for child in os.listdir(sub):
                        moved += 1
                        try:
                            if stat.S_ISDIR(os.lstat(child, dir_fd=sub).st_mode):
                                os.chmod(child, 0o700, dir_fd=sub)  # moving a directory rewrites its ".."
                            os.rename(child, ".stockade-%d" % moved, src_dir_fd=sub, dst_dir_fd=top)
                            progress = True
                        except OSError:
                            pass
                except OSError:
                    pass
                finally:
                    os.close(sub)
    except OSError:
        pass
    finally:
        os.close(top)

# What a tool (the worker's uid) can change of the worker itself and every later job in a session
# would inherit: its resource limits (prlimit on PID 1), its priority (renice), scheduling policy
# (SCHED_IDLE), CPU affinity and I/O priority. A session's next job finds them as the session's
# first did, or is not run and the container goes.
GUARDED = ("RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA", "RLIMIT_FSIZE",
           "RLIMIT_MEMLOCK", "RLIMIT_MSGQUEUE", "RLIMIT_NICE", "RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_RSS",
           "RLIMIT_RTPRIO", "RLIMIT_RTTIME", "RLIMIT_SIGPENDING", "RLIMIT_STACK")
IOPRIO_GET, IOPRIO_WHO_PROCESS = 252, 1  # x86_64

def conditions():
    import resource
    return [list(resource.getrlimit(getattr(resource, name))) for name in GUARDED] + [
        os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0), sorted(os.sched_getaffinity(0)),
        ctypes.CDLL(None, use_errno=True).syscall(IOPRIO_GET, IOPRIO_WHO_PROCESS, 0)]

def main():
    global spare
    # "pool": one job, then wait for the host to hang up. "session": one job, then this program
    # again in a fresh interpreter ("session-next": no ready frame) for the session's next job.
    # A job's header and stdin (its arguments, environment, placeholders) stay in this process's
    # memory, freed or not, and a python tool runs in a fork of it: the next job's spare must
    # come from a process that never held them.
    mode = sys.argv[1]
    # The session's first start records them; each next start gets them on its command line. (A
    # pool container serves one job, which nothing ran before: it has none to check.)
    baseline = json.loads(sys.argv[2]) if mode == "session-next" else conditions() if mode == "session" else None
    # Not dumpable: /proc/<this pid>/{environ,mem,...} become root's, so a tool (the same uid) cannot
    # read the worker's memory, which holds the job's header (its environment, placeholders).
    # The tool's own processes are dumpable again: after their execve, or (python tools) by
    # python_tool.
    set_dumpable(0)
    # As PID 1 the worker receives only the signals it handles, and Python handles SIGINT: a tool
    # (the same uid) could otherwise interrupt the worker and end its session.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Forked before the job arrives, and (in a session) only once the last job's leftovers were
    # reaped: forked earlier, the spare would be one of them.
    spare = fork_spare()
    if mode != "session-next":
        frame(b"R", b"")  # up and waiting: the host pools this container only after seeing it
    header = json.loads(read_exact(struct.unpack(">I", read_exact(4))[0]))
    # The job's seal, which only this process holds (never handed to the spare or the tool): the
    # host takes the exit frame that carries it as the worker's. Under gVisor a tool (the same uid)
    # can open /proc/1/fd/1 and write frames of its own; without the seal they are refused.
    seal = header.pop("seal", "")
    payload = read_exact(header["stdin_len"])
    if mode == "session-next" and conditions() != baseline:
        # On the worker's own stderr, which the host reads as why the worker ended (not the tool's).
        os.write(2, b"an earlier call in this session changed the sandbox's own resource limits or priority; "
                    b"this call did not run, and the session's sandbox is replaced: retry\n")
        os._exit(3)
    # The container's count is cumulative: this job's kills are those it adds.
    kills_before = oom_kills()
    if header.get("egress"):
        start_bridge(spare[1:])
    result = run_python(header, payload) if header["kind"] == "python" else run_exec(header, payload)
    result["oom_kills"] = oom_kills() - kills_before
    result["seal"] = seal
    frame(b"x", json.dumps(result).encode())
    if header.get("outputs"):
        send_outputs(header["outputs"])
    frame(b"d", b"")
    if mode == "pool":
        # Wait for the host to hang up, so the container stays alive while it reads.
        while os.read(0, 65536):
            pass
        return
    empty_out()
    command = sys.orig_argv[: len(sys.orig_argv) - len(sys.argv) + 1]  # the interpreter and this program
    os.execve(sys.executable, command + ["session-next", json.dumps(baseline)], {})

main()
'''


# Entries of a container's /out the worker reports (files sent and entries refused); past it, the
# worker lists no more. Under runc, /out's inode count is the same.
OUT_ENTRIES = 1024


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
    and separate caps on files, and refusing anything malformed. More ``f`` and ``r`` frames than
    the worker reports (`OUT_ENTRIES`) did not come from an honest worker: the reply is
    malformed, and the list of files and refused entries stops growing.

    Until the exit frame, the tool may be writing to the worker's stdout too (under gVisor it can
    open ``/proc/1/fd/1``): only output frames may come before it, and the exit frame must carry
    the job's ``seal``, which only the worker holds. A frame the tool forged (an exit, a file, the
    end) makes the reply malformed: the call fails and its container goes. Once the worker sends
    the exit frame, the tool and whatever it left have been killed."""

    def __init__(self, output_cap: int, file_cap_bytes: int, *, seal: str) -> None:
        self.reply = WorkerReply()
        self._seal = seal
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
        elif reply.exit is None and kind != b"x":
            reply.malformed = f"a {kind!r} frame before the exit frame: not the worker's"
        elif kind == b"x":
            exit_info = _json_object(body)
            seal = exit_info.pop("seal", None) if exit_info is not None else None
            if not isinstance(seal, str) or not hmac.compare_digest(seal.encode(errors="replace"), self._seal.encode()):
                reply.malformed = "an exit frame without this job's seal: not the worker's"
            elif reply.exit is not None:
                reply.malformed = "a second exit frame"
            else:
                reply.exit = exit_info
        elif kind in (b"f", b"r") and len(reply.files) + len(reply.refused) >= OUT_ENTRIES:
            reply.malformed = f"more than {OUT_ENTRIES} output file entries"
        elif kind == b"f" and len(body) < 4:
            reply.malformed = "file frame without its header length"
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
