"""Files the commands write: checked before the work starts, written whole or not at all.

    check_writable(a.trace, "--trace")            # UserError now, not after an hour of generation
    with atomic_path(a.trace) as tmp:             # write tmp; it replaces a.trace only if the block succeeds
        recorder.save(tmp)
    check_writable(out, "OUT", new=True)          # a model, a base file: never over something that is there
    with atomic_path(out, new=True) as tmp: ...
    with atomic_dir(out) as tmp: ...              # a directory (an HF model), onto nothing or an empty one

A failed or interrupted write (any exception, KeyboardInterrupt too) leaves no partial file behind, and an older
file at the path stays as it was. Every command that writes a file goes through here.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from .errors import UserError

_UMASK = os.umask(0)                        # (read once: the only way to read it is to set it)
os.umask(_UMASK)


def check_writable(path: str | os.PathLike, flag: str, *, new: bool = False, directory: bool = False,
                   parents: bool = False) -> None:
    """Refuse `path` (given with `flag`) before the work if the write would fail or destroy something.

    new: nothing may be at `path` (a model, a base file: the user's input given by mistake must not be replaced).
    directory: `path` will be a directory, which may replace an empty one. parents: the missing folders above
    `path` will be made. Writability is probed by creating (and removing) a file in the nearest existing folder,
    so permissions are the real ones."""
    path = os.fspath(path)
    _check_target(path, f"{flag} {path!r}", new, directory)
    folder = os.path.dirname(os.path.abspath(path))
    while parents and not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise UserError(f"{flag} {path!r}: {folder!r} is not a directory")
        raise UserError(f"{flag} {path!r}: the directory {folder!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".moestream-probe-"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path!r}: cannot write in {folder!r} ({e.strerror})") from None


def as_created(path, directory: bool = False) -> None:
    """Give `path` the permissions open() or mkdir() would have (0666 / 0777 less the umask): mkstemp's and
    mkdtemp's, and safetensors' files, are the owner's alone, so another user could not read a model written."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "", *, new: bool = False):
    """A temporary path next to `path` (ending in `suffix`, for writers that add one) that replaces `path` when the
    block succeeds; on any error it is removed (an OSError becomes a UserError naming the path). new: refuse to
    replace anything at `path` (checked again at the end: it may have appeared during the work)."""
    path, tmp = os.fspath(path), None
    with _removed_on_failure(path, lambda: tmp and os.unlink(tmp)):      # (tmp as it is then: None until made)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix="." + os.path.basename(path) + ".", suffix=".part" + suffix)
        os.close(fd)
        yield tmp
        as_created(tmp)
        _check_target(path, repr(path), new, False)
        os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike):
    """As atomic_path, for a directory: a temporary directory next to `path` (made with the folders above it)
    that becomes `path` when the block succeeds, onto nothing or an empty directory; removed on any error."""
    path, tmp = os.fspath(path), None
    with _removed_on_failure(path, lambda: tmp and shutil.rmtree(tmp)):
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder, prefix="." + os.path.basename(path) + ".part")
        yield tmp
        as_created(tmp, directory=True)
        for f in os.listdir(tmp):
            as_created(os.path.join(tmp, f))
        _check_target(path, repr(path), True, True)
        os.replace(tmp, path)


def _check_target(path: str, shown: str, new: bool, directory: bool) -> None:
    """check_writable's judgement of what is at `path` (`shown` as the message names it), before the work and
    again before the rename (something may have appeared there meanwhile)."""
    if directory:
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            raise UserError(f"{shown} already exists; remove it or choose another output path")
    elif os.path.isdir(path):
        raise UserError(f"{shown} is a directory; give a file name")
    elif new and os.path.lexists(path):
        raise UserError(f"{shown} already exists; remove it or choose another output path")


@contextlib.contextmanager
def _removed_on_failure(path: str, remove):
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(OSError):
            remove()
        if isinstance(e, OSError):          # a full disk, a file system gone read-only: the user's to fix
            raise UserError(f"cannot write {path!r}: {e.strerror or e}") from None
        raise
