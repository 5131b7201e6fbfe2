"""A byte-level text corpus that exists on every machine offline: the Python standard library's sources.

Invariants:

* the corpus is the concatenation, in sorted relative-path order, of the ``.py`` files under
  ``sysconfig.get_paths()["stdlib"]`` (skipping ``site-packages``, ``dist-packages``, ``__pycache__`` and test
  directories), joined by :data:`SEPARATOR` and cut at ``max_bytes`` when given; the same Python installation
  therefore always yields the same bytes;
* the file name carries a hash of everything that determines its content (Python version, relative paths and
  sizes of the source files, separator, cap), so a stale corpus is never reused and two caps never collide;
* a corpus file is only ever visible complete: it is written to a temporary file in the same directory and
  published with ``os.replace`` (atomic on POSIX), so several ranks starting at once on one machine can all
  call :func:`ensure_stdlib_corpus`; the last writer wins with identical bytes.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

#: Bytes placed between two source files.
SEPARATOR = b"\n\n"
#: Environment variable naming the cache directory.
CACHE_ENV = "LIGHTNING_EMIG_CACHE"
#: Directory names never descended into: installed packages, bytecode and the (large, odd) test suites.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
# Bump when the way files are chosen or joined changes, so old cache files are not reused.
_FORMAT_VERSION = 1


class CorpusError(RuntimeError):
    """The corpus cannot be built or read."""


def default_cache_dir() -> Path:
    """``$LIGHTNING_EMIG_CACHE`` if set, else ``~/.cache/lightning_emig``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "lightning_emig"


def stdlib_source_files(stdlib_dir: Path | None = None) -> list[Path]:
    """The ``.py`` files that make up the corpus, in corpus order (sorted by path relative to the stdlib)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(f"standard library directory {root} does not exist")
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting is for readability only,
        # the final order comes from the sort below so it is independent of walk order.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def ensure_stdlib_corpus(
    cache_dir: str | os.PathLike[str] | None = None, max_bytes: int | None = None
) -> Path:
    """Build the stdlib corpus once per content and return its path (a flat file of uint8 bytes).

    Args:
        cache_dir: where to keep the file; default :func:`default_cache_dir`.
        max_bytes: keep only the first ``max_bytes`` bytes (fast builds for tests and smoke runs).
    """
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 2):
        raise CorpusError(f"max_bytes must be an int >= 2 (one input and one target byte), got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(root)
    if not files:
        raise CorpusError(f"no .py files under {root}: cannot build the stdlib corpus")
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    path = directory / f"stdlib-py{version}-{_content_key(root, files, max_bytes)}.bin"
    if path.is_file() and path.stat().st_size > 0:
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, _concatenate(files, max_bytes))
    except OSError as exc:
        raise CorpusError(
            f"cannot write the corpus cache in {directory} ({exc.strerror or exc}): set data.cache_dir (or "
            f"${CACHE_ENV}) to a directory this user can create and write"
        ) from exc
    return path


def load_byte_corpus(path: str | os.PathLike[str]) -> torch.Tensor:
    """Memory-map a corpus file as a 1-D ``uint8`` tensor (copy-on-write: the file is never modified)."""
    path = Path(path)
    n_bytes = path.stat().st_size
    if n_bytes == 0:
        raise CorpusError(f"corpus file {path} is empty")
    return torch.from_file(str(path), shared=False, size=n_bytes, dtype=torch.uint8)


def _content_key(root: Path, files: list[Path], max_bytes: int | None) -> str:
    digest = hashlib.sha256()
    digest.update(f"v{_FORMAT_VERSION}|{sys.version}|{SEPARATOR!r}|{max_bytes}".encode())
    for f in files:
        digest.update(f"|{f.relative_to(root).as_posix()}:{f.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def _concatenate(files: list[Path], max_bytes: int | None) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for i, f in enumerate(files):
        if max_bytes is not None and total >= max_bytes:
            break  # reading the rest of the stdlib is wasted work once the cap is reached
        if i:
            chunks.append(SEPARATOR)
            total += len(SEPARATOR)
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
    blob = b"".join(chunks)
    return blob if max_bytes is None else blob[:max_bytes]


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            # mkstemp makes the file private (0600); a cache is meant to be readable like any other file.
            os.fchmod(out.fileno(), 0o644)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # Never leave a half-written temporary behind (a crash between write and replace still can;
        # such files start with a dot and end in .tmp, and are harmless).
        Path(tmp_name).unlink(missing_ok=True)
        raise
