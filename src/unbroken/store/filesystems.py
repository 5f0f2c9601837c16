"""What a filesystem is, for Storage (unbroken.store.storage): which one a URL names, and what
kind it is, decided by what it does, not by its class alone.

A `DirFileSystem` (a prefix over another filesystem) is replaced by the filesystem below it
and the full path, so that one over this machine's disk is local storage; a filesystem that
is neither local nor an object store (sftp, HDFS, a custom one) goes through the
object-store code, with the directories each file goes into created first.
"""

from __future__ import annotations

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from unbroken.errors import StorageError

# fsspec protocol -> the package that provides it, for the "not installed" hint.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
             "abfs": "adlfs", "hdfs": "pyarrow", "sftp": "paramiko"}

# Object stores: no directories (a key's "parents" need not exist) and no rename. Any other
# filesystem that is not this machine's is taken to have real directories, which are created
# before a file is written into them.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "gcsfs", "abfs", "abfss", "az", "adl", "oci",
                           "oss", "r2", "tos", "cos", "obs", "memory"})


def open_url(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path that `url` (a local path or any fsspec URL) names; a
    StorageError naming the package to install where its protocol has none."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        package = _PACKAGES.get(protocol, f"the fsspec implementation for '{protocol}://'")
        raise StorageError(
            f"cannot open storage {url!r}: the filesystem for '{protocol}://' is not installed "
            f"({e}). Hint: pip install {package}"
        ) from None


def below_prefixes(fs: fsspec.AbstractFileSystem, path: str
                   ) -> tuple[list[DirFileSystem], fsspec.AbstractFileSystem, str]:
    """The prefixes (DirFileSystems) that `fs` puts over another filesystem, outermost first;
    that filesystem; and the full path of `path` on it."""
    prefixes: list[DirFileSystem] = []
    while isinstance(fs, DirFileSystem):
        prefixes.append(fs)
        path, fs = fs._join(path), fs.fs
    return prefixes, fs, path


def has_dirs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether directories must be created before files go into them: on a filesystem that is
    neither this machine's (os calls create them) nor an object store."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return not isinstance(fs, LocalFileSystem) and not protocols & OBJECT_STORES
