"""Output files written safely: an output path is checked before any work, readers never see a partial file, a
refused or failed write leaves nothing behind, and an existing file (a symlink too, even a dangling one) is never
replaced unless the caller asks for it. A published file gets the mode of any new file the user writes
(`0o666 & ~umask`), not the 0600 of a temporary file, so a server running as another user can read it."""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import TypeVar

from .errors import KvxError, Status, require

T = TypeVar("T")


def _exists(path: str) -> str:
    return f"{path} exists; KVX never overwrites a file without an explicit overwrite"


def check_output(path: str, *, overwrite: bool = False) -> None:
    """Refuse (KvxError INVALID_ARGUMENT) an output path that cannot take a new file: its directory missing or not
    writable, a directory, (unless `overwrite`) an existing name, a dangling symlink included, and (with it) anything
    but a regular file. Call it before the work whose result goes there."""
    folder = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(folder), Status.INVALID_ARGUMENT, f"{folder}: no such directory")
    require(os.access(folder, os.W_OK | os.X_OK), Status.INVALID_ARGUMENT, f"{folder}: not writable")
    require(not os.path.isdir(path), Status.INVALID_ARGUMENT, f"{path} is a directory, not a regular file")
    require(overwrite or not os.path.lexists(path), Status.INVALID_ARGUMENT, _exists(path))
    require(not os.path.lexists(path) or os.path.isfile(path), Status.INVALID_ARGUMENT,
            f"{path} exists and is not a regular file (a device, FIFO or dangling link): KVX replaces only files")


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it (`/proc/self/status`); elsewhere set
    and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permission bits `open()` gives a new file: 0o666 less the umask."""
    return 0o666 & ~umask()


def publish(path: str, write: Callable[[str], T], *, overwrite: bool = False) -> T:
    """`write(tmp)` fills a new temporary file in `path`'s directory (by its name), which is then linked into place
    (atomic, and refused if the name appeared meanwhile) or, with `overwrite`, renamed over it; returns what `write`
    returns. The file gets `new_file_mode()` (writers such as safetensors create their file 0600). The temporary
    file is removed whatever happens: a refused input (KvxError from `write`) or a failed
    write leaves nothing. OSError -> KvxError INVALID_ARGUMENT naming the path."""
    check_output(path, overwrite=overwrite)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.kvx-tmp")
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, as to open()
        result = write(tmp)
        os.chmod(tmp, new_file_mode())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if the name exists
            except FileExistsError:
                raise KvxError(Status.INVALID_ARGUMENT, _exists(path)) from None
            except OSError:  # a file system without hard links: check, then rename (a concurrent writer could race)
                require(not os.path.lexists(path), Status.INVALID_ARGUMENT, _exists(path))
                os.replace(tmp, path)
        return result
    except OSError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
