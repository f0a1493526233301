"""Files the commands write: checked before the work starts, written whole or not at all.

    check_writable(a.trace, "--trace")            # UserError now, not after an hour of generation
    with atomic_path(a.trace) as tmp:             # write tmp; it replaces a.trace only if the block succeeds
        recorder.save(tmp)

A failed or interrupted write leaves no partial file behind (and an older file at the path stays as it was).
"""
from __future__ import annotations

import contextlib
import os
import tempfile

from .errors import UserError

_UMASK = os.umask(0)                        # (read once: the only way to read it is to set it)
os.umask(_UMASK)


def check_writable(path: str, flag: str, shown: str | None = None) -> None:
    """Refuse `path` (given with `flag`) if a file cannot be created there: a missing or read-only directory, a
    directory in its place. Probed by creating (and removing) a file next to it, so permissions are the real ones.
    shown: the path the user gave, where `path` is a probe inside the directory that will hold it."""
    shown = shown or path
    if os.path.isdir(path):
        raise UserError(f"{flag} {shown!r} is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {shown!r}: the directory {folder!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".moestream-probe-"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {shown!r}: cannot write in {folder!r} ({e.strerror})") from None


def as_created(path, directory: bool = False) -> None:
    """Give `path` the permissions open() or mkdir() would have (0666 / 0777 less the umask): mkstemp's and
    mkdtemp's, and safetensors' files, are the owner's alone, so another user could not read a model written."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ""):
    """A temporary path next to `path` (ending in `suffix`, for writers that add one) that replaces `path` when the
    block succeeds; on any error it is removed (an OSError becomes a UserError naming the path)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".part" + suffix)
    os.close(fd)
    try:
        yield tmp
        as_created(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):          # a full disk, a file system gone read-only: the user's to fix
            raise UserError(f"cannot write {path!r}: {e.strerror or e}") from None
        raise
