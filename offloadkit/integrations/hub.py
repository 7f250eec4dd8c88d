"""Hugging Face Hub ids (``org/name``) as local directories: the snapshot in the local cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), or a download
into it when the network is allowed (not ``HF_HUB_OFFLINE``), said in one line. When neither
works, one line names the id, the cache looked in and the variable to set.
"""

from __future__ import annotations

import os
import re
import sys

from offloadkit.config import ConfigError

__all__ = ["looks_like_hub_id", "hub_cache", "cached_snapshot", "offline", "resolve"]

_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` that is not a path on this machine."""
    return bool(_ID.fullmatch(name)) and not name.startswith(".") and not os.path.exists(name)


def hub_cache() -> str:
    """The cache the hub library reads (it follows HF_HUB_CACHE and HF_HOME)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
        return os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub"))
    return constants.HF_HUB_CACHE


def offline() -> bool:
    """Whether downloads are switched off (HF_HUB_OFFLINE)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    return bool(constants.HF_HUB_OFFLINE)


def cached_snapshot(repo_id: str, revision: str | None = None) -> str | None:
    """The snapshot directory of ``repo_id`` in the local cache (None: not there). Without a
    ref for the revision, a cache holding exactly one snapshot of the repository gives it."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(repo_id, revision=revision, local_files_only=True)
        if os.path.isdir(found):
            return found
    except Exception:  # not cached (or an id the hub library rejects)
        pass
    folder = os.path.join(hub_cache(), "models--" + repo_id.replace("/", "--"), "snapshots")
    if revision is None and os.path.isdir(folder):
        snapshots = [os.path.join(folder, s) for s in os.listdir(folder) if os.path.isdir(os.path.join(folder, s))]
        if len(snapshots) == 1:
            return snapshots[0]
    return None


def resolve(repo_id: str, key: str, revision: str | None = None, log=None) -> str:
    """The local directory of hub id ``repo_id``: cached, or downloaded when allowed.

    Args:
        key: the config key naming it, for messages.
        log: where the one download line goes (default: stderr).

    Raises:
        ConfigError: neither in the cache nor downloadable; one line naming the id and the
            environment variable to set.
    """
    found = cached_snapshot(repo_id, revision)
    if found is not None:
        return found
    cache = hub_cache()
    where = f"{key}={repo_id!r} is not in the local Hugging Face cache ({cache})"
    if offline():
        raise ConfigError(
            f"{where} and HF_HUB_OFFLINE is set; set HF_HOME (or HF_HUB_CACHE) to a cache that has it, or unset "
            "HF_HUB_OFFLINE to download it"
        )
    from huggingface_hub import snapshot_download

    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    say(f"offloadkit: downloading {repo_id} from the Hugging Face Hub into {cache}")
    try:
        return snapshot_download(repo_id, revision=revision)
    except Exception as exc:  # no network, no such repository, no access
        why = " ".join(str(exc).split())[:120] or type(exc).__name__
        raise ConfigError(
            f"{where} and could not be downloaded ({type(exc).__name__}: {why}); set HF_HOME (or HF_HUB_CACHE) to a "
            "cache that has it, or download it where the network allows"
        ) from None
