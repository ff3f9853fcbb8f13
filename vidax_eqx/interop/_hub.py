"""Checkpoints named by a Hugging Face Hub repository id, resolved to a local directory.

`huggingface_hub` is an optional dependency (`pip install huggingface_hub`, or
`pip install 'vidax_eqx[hub]'`), imported only when a repository id is given. Only the
files a checkpoint directory needs are fetched (`config.json`, the `.safetensors`
files and their index, of the one folder asked for): never a pipeline's other
components nor pickle-based weights. With `HF_HUB_OFFLINE=1` the local cache answers
alone.
"""

import os
import re


CHECKPOINT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
"""The files of a checkpoint directory fetched from the Hub (glob patterns)."""

# `owner/name` (or a bare `name`): letters, digits, `-`, `_`, `.`; not a path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def resolve_checkpoint(path, *, subfolder: str | None = None, revision: str | None = None,
                       cache_dir=None) -> str:
    """The local directory of a checkpoint: a directory on disk, or a Hub repository.

    **Arguments:**

    - `path`: a local directory, or the id of a Hugging Face Hub repository
        (`"owner/name"`), resolved by `huggingface_hub.snapshot_download` from its
        local cache (`HF_HUB_CACHE`, or `cache_dir`) or by downloading: only
        `config.json` and the safetensors weights (and index) of `subfolder`, and the
        repository's `model_index.json` when it has one.
    - `subfolder`: the folder inside `path` that holds the checkpoint, e.g.
        `"transformer"` in a diffusers pipeline repository; default `path` itself.
    - `revision`: the Hub revision (branch, tag or commit); default `"main"`. Hub only.
    - `cache_dir`: the Hub cache directory; default `huggingface_hub`'s (`HF_HUB_CACHE`).

    **Returns:**

    The directory, as a string.

    **Raises:**

    `ValueError` for a `path` that is neither an existing directory nor a repository
    id, a repository (or revision) that neither the cache nor the Hub has, or a
    missing `subfolder`; `ImportError` when a repository id needs `huggingface_hub`
    and it is not installed.
    """
    if subfolder is not None and (
        not isinstance(subfolder, str) or not subfolder.strip("/")
        or ".." in subfolder.split("/") or os.path.isabs(subfolder)
    ):
        raise ValueError(
            f"`subfolder` must be a relative folder name inside the checkpoint, e.g. "
            f"'transformer'; received {subfolder!r}."
        )
    sub = subfolder.strip("/") if subfolder else None
    text = os.fspath(path)
    if os.path.exists(text) or not _REPO_ID.match(text):
        if revision is not None or cache_dir is not None:
            raise ValueError(
                f"`revision` and `cache_dir` are for Hub repositories; `path` {text!r} is a "
                "local path. Drop them, or pass a repository id ('owner/name')."
            )
        folder = os.path.join(text, sub) if sub else text
        if not os.path.isdir(folder):
            where = f"{text!r} with subfolder {sub!r}" if sub else repr(text)
            raise ValueError(
                f"`path` must be a checkpoint directory holding config.json and the "
                f"safetensors weights, or a Hugging Face Hub repository id ('owner/name'); "
                f"{where} is not a directory on disk"
                + ("" if _REPO_ID.match(text) else ", nor a repository id") + "."
            )
        return folder
    return _from_hub(text, sub, revision, cache_dir)


def _from_hub(repo_id: str, sub: str | None, revision, cache_dir) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError as e:
        raise ImportError(
            f"{repo_id!r} is not a directory on disk, so it is read as a Hugging Face Hub "
            "repository id, which needs huggingface_hub, an optional dependency: pip install "
            "huggingface_hub (or pip install 'vidax_eqx[hub]'). Or pass a local directory."
        ) from e
    prefix = f"{sub}/" if sub else ""
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            # and a pipeline's model_index.json (what a pipeline of several models,
            # e.g. Wan 2.2 A14B's two experts, says about them)
            allow_patterns=[prefix + p for p in CHECKPOINT_FILES] + ["model_index.json"],
            ignore_patterns=[prefix + "*/*"],  # not the folders below it
        )
    except Exception as e:  # huggingface_hub's errors: not found, offline, no access, ...
        offline = constants.HF_HUB_OFFLINE
        raise ValueError(
            f"{repo_id!r} is not a directory on disk, and the Hugging Face Hub repository "
            f"{repo_id!r} (revision {revision or 'main'!r}) could not be resolved"
            f"{' from the local cache (HF_HUB_OFFLINE is set)' if offline else ''}: "
            f"{type(e).__name__}: {str(e)[:300]}. Check the repository id and revision, the "
            "cache (`cache_dir`, HF_HUB_CACHE) and the network, or pass a local directory."
        ) from e
    folder = os.path.join(snapshot, sub) if sub else snapshot
    if not os.path.isdir(folder):
        raise ValueError(
            f"the Hugging Face Hub repository {repo_id!r} (revision {revision or 'main'!r}) "
            f"has no folder {sub!r} with a checkpoint; its snapshot {snapshot!r} holds "
            f"{sorted(os.listdir(snapshot))[:12]}. Pass the right `subfolder`."
        )
    return folder
