"""The command line run in-process, as the CLI tests read it: (exit status, stdout, stderr), and the one error line."""
from __future__ import annotations

from moestream.cli import main


def run(capsys, *argv):
    """argv's items as the shell gives them: strings (a Path is given as its text)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    lines = [l for l in err.splitlines() if "error:" in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
