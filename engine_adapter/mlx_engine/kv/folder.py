"""The disk tier's folder, opened so that nothing outside it is read, written or deleted.

The root is checked once (``check_root``: it and every folder above it are real folders owned by
this user or root, none writable by group or others unless sticky as /tmp is; the root itself
is this user's and private) and held open as a directory descriptor. Every path below it is
walked from that descriptor one component at a time with ``O_NOFOLLOW`` (openat(2)), so a
symlink put in place of a sub-folder or a file is never followed: a writer replaces it with a
real folder, a reader misses. Files are opened only when they are regular files, and without
blocking (``O_NONBLOCK``): a FIFO named like a KV file cannot hang a scan or a lookup.

A root deleted while the process runs is made again by the next write (``reopen``).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("engine_adapter.mlx_engine")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_A_FOLDER = (errno.ELOOP, errno.ENOTDIR)   # a symlink or a file where a folder should be


class KVFolderError(ValueError):
    """A tier folder this process must not use (the message says why)."""


class NotRegularFileError(OSError):
    """A name in the tier that is not a regular file (a FIFO, a device, a symlink)."""


def _check_owner(path: Path, st: os.stat_result, *, own: bool) -> None:
    uid = os.geteuid()
    owners = {uid} if own else {uid, 0}
    if st.st_uid not in owners:
        raise KVFolderError(f"KV disk folder {path}: owned by uid {st.st_uid}, not by this "
                            f"user ({uid}){'' if own else ' or root'}")
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and (own or not st.st_mode & stat.S_ISVTX):
        raise KVFolderError(f"KV disk folder {path}: group or others can write it "
                            f"(mode {stat.S_IMODE(st.st_mode):o})")


def check_root(root: str | Path) -> Path:
    """The tier's root, made (0700) if missing, as a real path, once it and every folder above
    it pass the checks in the module docstring; ``KVFolderError`` naming the reason otherwise."""
    path = Path(root).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:   # a file in its place: refused below
        pass
    real = path.resolve(strict=True)
    for folder in reversed(real.parents):
        _check_owner(folder, os.lstat(folder), own=False)
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise KVFolderError(f"KV disk folder {real}: not a folder")
    _check_owner(real, st, own=True)
    return real


class TierFolder:
    """The tier's root held open; paths are relative to it ("tier/ns-x/ab/h.safetensors")."""

    def __init__(self, root: str | Path) -> None:
        self._lock = threading.Lock()
        self._fd = -1
        self.path = check_root(root)
        self._fd = os.open(self.path, _DIR_FLAGS)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Let the root's descriptor go (the store is done with the folder)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def reopen(self) -> bool:
        """Make the root again if it was deleted since it was opened; whether it was."""
        with self._lock:
            if os.fstat(self._fd).st_nlink > 0:
                return False
            log.warning("KV disk folder %s was deleted; made again", self.path)
            self.path = check_root(self.path)
            os.close(self._fd)
            self._fd = os.open(self.path, _DIR_FLAGS)
            return True

    # -- folders -------------------------------------------------------------------------------

    def _open_dir(self, parent: int, name: str, create: bool) -> int:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            self._mkdir(parent, name)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if not create or exc.errno not in _NOT_A_FOLDER:
                raise
            log.warning("KV disk folder: %r is not a real folder (a symlink?); replaced", name)
            os.unlink(name, dir_fd=parent)   # the link itself, never what it points to
            self._mkdir(parent, name)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        try:
            _check_owner(self.path / name, os.fstat(fd), own=True)
        except KVFolderError:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _mkdir(parent: int, name: str) -> None:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass

    def _walk(self, folders: tuple[str, ...], create: bool) -> int:
        """A descriptor of the folder ``folders`` below the root (the caller closes it)."""
        with self._lock:   # not while ``reopen`` swaps the root's descriptor
            fd = os.dup(self._fd)
        try:
            for name in folders:
                child = self._open_dir(fd, name, create)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- files ---------------------------------------------------------------------------------

    def write(self, rel: str, fill: Callable[[BinaryIO], None]) -> None:
        """Write ``rel`` crash-safely: folders made (0700) on the way, a private temporary name
        (0600), ``fill`` writes the content, fsync, rename over ``rel``, fsync of the folder.
        Readers see the old file or the whole new one, never a part."""
        *folders, name = rel.split("/")
        dir_fd = self._walk(tuple(folders), create=True)
        try:
            tmp = temp_name(name)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fill(fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                _unlink_quietly(dir_fd, tmp)
                raise
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def open(self, rel: str) -> BinaryIO:
        """``rel`` opened for reading if it is a regular file reached without a link;
        ``FileNotFoundError`` if it is not there, ``NotRegularFileError`` or ``OSError``
        (ELOOP, ENOTDIR) if something else is."""
        *folders, name = rel.split("/")
        dir_fd = self._walk(tuple(folders), create=False)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotRegularFileError(errno.EINVAL, "not a regular file", rel)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def touch(self, rel: str) -> None:
        """Set ``rel``'s times to now (its last use, for the LRU of processes that scan it)."""
        with self.open(rel) as fh:
            os.utime(fh.fileno())

    def unlink(self, rel: str) -> None:
        """Delete ``rel`` (a link is deleted, not followed); nothing if it is gone."""
        *folders, name = rel.split("/")
        try:
            dir_fd = self._walk(tuple(folders), create=False)
        except OSError:   # gone, or a link in the way: nothing of ours to delete there
            return
        try:
            _unlink_quietly(dir_fd, name)
        finally:
            os.close(dir_fd)

    def remove_tree(self, rel: str) -> None:
        """Delete the folder ``rel`` and what is in it, following no link (a link in its place
        is deleted itself)."""
        *folders, name = rel.split("/")
        try:
            dir_fd = self._walk(tuple(folders), create=False)
        except OSError:
            return
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
            else:
                os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dir_fd)

    def folders(self) -> list[str]:
        """The names of the root's real sub-folders."""
        with os.scandir(self._fd) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]

    def files(self, suffix: str) -> Iterator[tuple[str, os.stat_result]]:
        """Every name ending in ``suffix`` below the root, with its ``lstat``: links are
        listed, never followed or descended into."""
        with self._lock:
            top = os.dup(self._fd)
        try:
            for folder, _, names, dir_fd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                for name in names:
                    if name.endswith(suffix):
                        try:
                            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        yield os.path.normpath(os.path.join(folder, name)), st
        finally:
            os.close(top)


def temp_name(name: str) -> str:
    """A writer's temporary name for ``name``: hidden, with the writer's pid (see
    ``temp_writer_pid``)."""
    stem, dot, suffix = name.partition(".")
    return f".{stem}.{os.getpid()}.{os.urandom(4).hex()}.tmp{dot}{suffix}"


def temp_writer_pid(name: str) -> int | None:
    """The pid in a temporary name, or None if ``name`` is not one."""
    parts = name.split(".")
    if not name.startswith(".") or len(parts) < 5 or not parts[2].isdigit():
        return None
    return int(parts[2])


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs on this host (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: alive
        return True
    return True


def _unlink_quietly(dir_fd: int, name: str) -> None:
    """Delete ``name`` (a folder in a file's place with what it holds, following no link);
    a name that cannot be deleted is logged, never raised: it costs a recompute at most."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
    except OSError as exc:
        log.warning("KV disk: could not delete %r (%s)", name, exc)
