"""What gpucoll builds on first use with the machine's C compiler, and where it keeps it.

Nothing is compiled at install. A source is built once into a per-user cache
(``$GPUCOLL_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpucoll``, else ``~/.cache/gpucoll``),
under a name keyed by the source's digest and whatever else the build depends on (a
header, the interpreter), and loaded from there afterwards. Users: the jit handler
(``gpucoll/_jax/native.py``) and the store loop's repeated ADD (``gpucoll/store/_native.py``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

from . import CACHE_DIR_ENV

__all__ = ["cache_dir", "build", "mode"]


def mode(name: str) -> str:
    """The setting of the 0/1/unset variable ``name`` that turns a built part off ("0") or
    makes its failed build an error ("1"); "" when unset.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0, 1 or unset; got {value!r}")
    return value


def cache_dir() -> str:
    """The cache, made if missing.

    Raises:
        OSError: it exists and is not this user's alone (another user could plant a
            library there).
    """
    base = (os.environ.get(CACHE_DIR_ENV) or
            os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                         "gpucoll"))
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.stat(base)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{base} is not this user's alone (uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
    return base


def build(prefix: str, source: str, includes: list[str], key: bytes) -> str:
    """The path of ``source`` built as a shared library (built now if the cache lacks it).

    Args:
        prefix: the start of the library's file name in the cache.
        source: the C file.
        includes: directories for ``-I``.
        key: what else the build depends on (headers' contents, the interpreter's version).

    Raises:
        OSError: no C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH), the
            compiler failed (its message), or the cache is not this user's alone.
    """
    with open(source, "rb") as f:
        src = f.read()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    digest = hashlib.blake2b(src + key + cc.encode() + os.uname().machine.encode(), digest_size=10).hexdigest()
    path = os.path.join(cache_dir(), f"{prefix}-{digest}.so")
    if os.path.exists(path):
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{prefix}-", suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cmd = [cc, "-O2", "-std=gnu11", "-shared", "-fPIC"]
        for inc in includes:
            cmd += ["-I", inc]
        done = subprocess.run([*cmd, source, "-o", tmp], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed on {source}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: processes building at once each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
