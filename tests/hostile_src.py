"""The source of a hostile user's workspace (data for the sandbox tests: the trainer imports it from
the workspace, never from tests/). Its model entry point is a working recipe (the tiny user model)
that first tries every escape the sandbox must stop, and prints what it reached as one line
`HOSTILE-REPORT {json}`; during training it prints a dot per step without a newline and fake
protocol lines, which must change no metric. `hostile_report` reads that line back from the job's
logs."""

import json

import httpx

from tests.trainer.user_model_src import USER_MODEL


def hostile_report(client: httpx.Client, job_id: int) -> dict[str, str]:
    """What the hostile model of job `job_id` reached, as it printed it."""
    logs = client.get(f"/api/jobs/{job_id}/logs", params={"limit": 1000}).json()["items"]
    for line in (e["message"] for e in logs):
        if "HOSTILE-REPORT " in line:
            return json.loads(line.split("HOSTILE-REPORT ", 1)[1])
    raise AssertionError(
        "the hostile model printed no report: " + "\n".join(e["message"] for e in logs)[-3000:]
    )


HOSTILE = (
    USER_MODEL
    + '''

import glob
import json
import os
import signal
import socket
import sys

SECRET_WORDS = ("DATABASE", "BROKER", "ADMIN", "TOKEN", "PASSWORD", "SECRET", "AWS_", "SIGNING")


def _try(report, name, fn):
    """Run one escape: what it returns is what it reached (None or empty: nothing)."""
    try:
        got = fn()
        report[name] = ("reached: " + repr(got)[:200]) if got else "blocked: nothing there"
    except BaseException as e:  # every failure is a block
        report[name] = f"blocked: {type(e).__name__}"


def _read(path):
    with open(path, "rb") as f:
        return f.read(64)


def _write(path):
    with open(path, "wb") as f:
        f.write(b"planted")
    return path


def _connect(port):
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"PING\\r\\n")
        return s.recv(64) or b"connected"


def _environs():
    found = []
    for p in glob.glob("/proc/[0-9]*/environ"):
        try:
            text = open(p, "rb").read().decode(errors="replace")
        except OSError:
            continue
        found += [w for w in SECRET_WORDS if w in text]
    return sorted(set(found))


def _listing(folder):
    """What a folder shows beyond the path down to what the sandbox binds (the Python install, the
    job's own folder): bubblewrap makes those parents, empty but for that path."""
    bound = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.getcwd())]
    return sorted(
        n for n in os.listdir(folder) if not any((b + os.sep).startswith(os.path.join(folder, n) + os.sep) for b in bound)
    )


def _signal_all(pids):
    # a pid, or [pid, name]: a process of the service by the id its own PID namespace gives it,
    # reached only when the process this id names here is that one (inside a sandbox, 1 is
    # bubblewrap's own init, not the container's)
    hit = []
    for entry in pids:
        pid, name = (entry, None) if isinstance(entry, int) else entry
        try:
            os.kill(pid, 0)
        except OSError:
            continue
        if name is not None:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() != name:
                        continue
            except OSError:
                continue
        hit.append(pid)
    return hit


def escape(targets):
    report = {}
    _try(report, "environment", lambda: sorted(k for k in os.environ if any(w in k for w in SECRET_WORDS)))
    _try(report, "other processes' environ", _environs)
    _try(report, "signal the service", lambda: _signal_all(targets["pids"]))
    _try(report, "database file", lambda: _read(targets["database"]))
    _try(report, "data dir", lambda: _listing(targets["data_dir"]))
    _try(report, "other jobs' folders", lambda: _listing(os.path.join(targets["data_dir"], "jobs")))
    _try(report, "another job's folder", lambda: _read(targets["other_job"]))
    _try(report, "workspace archives", lambda: os.listdir(targets["archives"]))
    _try(report, "plant in the env cache", lambda: _write(os.path.join(targets["env_cache"], "planted.pth")))
    _try(report, "write the project's code", lambda: _write(os.path.join(targets["code"], "planted.py")))
    _try(report, "write its own workspace", lambda: _write(os.path.join(os.path.dirname(__file__), "x.py")))
    _try(report, "redis ping", lambda: _connect(targets["redis_port"]))
    _try(report, "the API's port", lambda: _connect(targets["api_port"]))
    # more of the service's ports where it has them (the container tests: Postgres, the store)
    for name, port in sorted(targets.get("ports", {}).items()):
        _try(report, f"{name}'s port", lambda port=port: _connect(port))
    _try(report, "home folder secrets", lambda: _listing("/root") + _listing("/home"))
    _try(report, "/etc/shadow", lambda: _read("/etc/shadow"))
    print("HOSTILE-REPORT " + json.dumps(report), flush=True)


class Chatty(torch.nn.Module):
    """Prints a dot per forward pass without a newline, and every few passes a line shaped exactly
    like a protocol line with a fake loss."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        print(".", end="", flush=True)
        if self.calls % 3 == 0:
            fake = {"seq": self.calls, "kind": "metric", "step": self.calls, "name": "loss", "value": -124.0}
            print(json.dumps(fake), flush=True)
            fake_end = {"seq": self.calls + 1, "kind": "result", "data": {"final_loss": -1.0}}
            sys.stdout.write(json.dumps(fake_end) + "\\n")
        return self.inner(x)


class HostileLM(TinyLM):
    def build_layer(self, index):
        layer = super().build_layer(index)
        return Chatty(layer) if index == 1 else layer

    def init_layer(self, index, layer, *, generator):
        super().init_layer(index, layer.inner if isinstance(layer, Chatty) else layer, generator=generator)


def hostile(*, vocab_size, targets, width=32, depth=2):
    escape(targets)
    return HostileLM(vocab_size=vocab_size, width=width, depth=depth)
'''
)
