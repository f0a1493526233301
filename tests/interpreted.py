"""What the Triton interpreter tests share (tests/test_triton_kernels.py, tests/test_quant_kernels.py, ...): each check
runs in a subprocess with TRITON_INTERPRET=1 (the flag is read when the kernels are defined), and compares against
its oracle with `close`.

The subprocess is started once per pytest process and kept for every check after (importing torch and Triton cost
far more than most checks); a check that crashes it (a guard page read) or runs past its timeout fails, and the next
check starts a fresh one. `python tests/test_x.py CHECK` still runs one check alone."""
from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the checkout, installed or not
TESTS = os.path.dirname(os.path.abspath(__file__))

_worker: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1", "INTERPRETED_PARENT": str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, TESTS, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)


def _stop() -> None:
    global _worker
    if _worker is not None and _worker.poll() is None:
        _worker.stdin.close()                   # the worker ends at the end of its input
        try:
            _worker.wait(10)
        except subprocess.TimeoutExpired:
            _worker.kill()
    _worker = None


atexit.register(_stop)


def _answer(proc: subprocess.Popen, timeout: float) -> dict | str:
    """The worker's one-line JSON answer, or why there is none (it died, or ran past `timeout`: then it is killed)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end, data = time.monotonic() + timeout, b""
    while not data.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not sel.select(left):
            proc.kill()
            proc.wait()
            return f"ran past {timeout} s"
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        if not chunk:
            code = proc.wait()
            return f"died ({signal.Signals(-code).name})" if code < 0 else f"exited with {code}"
        data += chunk
    return json.loads(data)


def run_check(test_file: str, check: str, timeout: int) -> None:
    """Run `check(check)` of test_file under Triton's interpreter; fail with its output if it fails."""
    global _worker
    if _worker is None or _worker.poll() is not None:
        _worker = _start()
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        _worker.stdin.write((json.dumps([os.path.abspath(test_file), check, log.name]) + "\n").encode())
        _worker.stdin.flush()
        answer = _answer(_worker, timeout)
        if isinstance(answer, str):
            _worker = None
            answer = {"ok": False, "why": f"the interpreter process {answer} in check {check!r}"}
        output = open(log.name, errors="replace").read()
    assert answer["ok"], output[-3000:] + answer.get("why", "")


def close(a, b, tol=1e-5):
    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert err < tol, err


def _orphaned(parent: int) -> None:
    """End the worker once pytest is gone (killed, so no end of input came): a check may run for minutes."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _serve() -> None:
    """The worker: one request a line, [test file, check, log path], run as `python test_file check` runs it (the
    file as __main__; what it imports stays imported); its output goes to the log (fds 1 and 2, the kernels' own
    prints included) and the answer to the original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    threading.Thread(target=_orphaned, args=(int(os.environ["INTERPRETED_PARENT"]),), daemon=True).start()
    for line in sys.stdin:
        path, check, log = json.loads(line)
        sys.argv = [path, check]
        saved = os.dup(1), os.dup(2)
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                runpy.run_path(path, run_name="__main__")
                answer = {"ok": True}
            except SystemExit as e:
                answer = {"ok": e.code in (None, 0)}
            except BaseException:
                traceback.print_exc()
                answer = {"ok": False}
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
