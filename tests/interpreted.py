"""What the Triton interpreter tests share (tests/test_triton_kernels.py, tests/test_quant_kernels.py): each check
runs its test file as a script in a subprocess with TRITON_INTERPRET=1 (the flag is read when the kernels are
defined), and compares against its oracle with `close`."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the checkout, installed or not


def run_check(test_file: str, check: str, timeout: int) -> None:
    """Run `python test_file check` under Triton's interpreter; fail with its output if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, test_file, check], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def close(a, b, tol=1e-5):
    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert err < tol, err
