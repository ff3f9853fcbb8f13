"""Checkpoints named by a Hugging Face Hub repository id, resolved to a local directory.

`huggingface_hub` is an optional dependency (`pip install huggingface_hub`, or
`pip install '.[hub]'` in a clone of vidax_eqx), imported only when a repository id is
given. Only the files a checkpoint directory needs are fetched (`config.json`, the `.safetensors`
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
    prefix = f"{sub}/" if sub else ""
    snapshot = _download(
        repo_id, revision, cache_dir,
        # and a pipeline's model_index.json (what a pipeline of several models,
        # e.g. Wan 2.2 A14B's two experts, says about them)
        [prefix + p for p in CHECKPOINT_FILES] + ["model_index.json"],
        [prefix + "*/*"])  # not the folders below it
    folder = os.path.join(snapshot, sub) if sub else snapshot
    if not os.path.isdir(folder):
        raise ValueError(
            f"the Hugging Face Hub repository {repo_id!r} (revision {revision or 'main'!r}) "
            f"has no folder {sub!r} with a checkpoint; its snapshot {snapshot!r} holds "
            f"{sorted(os.listdir(snapshot))[:12]}. Pass the right `subfolder`."
        )
    return folder


def _download(repo_id: str, revision, cache_dir, allow: list, ignore: list) -> str:
    """The local snapshot of the files `allow` (not `ignore`) of a Hub repository."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError as e:
        raise ImportError(
            f"{repo_id!r} is not a directory on disk, so it is read as a Hugging Face Hub "
            "repository id, which needs huggingface_hub, an optional dependency: pip install "
            "huggingface_hub (or pip install '.[hub]' in a clone of vidax_eqx). Or pass a local "
            "directory."
        ) from e
    try:
        return huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            allow_patterns=allow, ignore_patterns=ignore)
    except Exception as e:  # huggingface_hub's errors: not found, offline, no access, ...
        offline = constants.HF_HUB_OFFLINE
        raise ValueError(
            f"{repo_id!r} is not a directory on disk, and the Hugging Face Hub repository "
            f"{repo_id!r} (revision {revision or 'main'!r}) could not be resolved"
            f"{' from the local cache (HF_HUB_OFFLINE is set)' if offline else ''}: "
            f"{type(e).__name__}: {str(e)[:300]}. Check the repository id and revision, the "
            "cache (`cache_dir`, HF_HUB_CACHE) and the network, or pass a local directory."
        ) from e


PIPELINE_FILES = ("model_index.json", "*/config.json", "*/*.safetensors",
                  "*/*.safetensors.index.json", "*/*.json", "*/*.model", "*/*.txt")
"""The files of a diffusers pipeline fetched from the Hub (glob patterns): the index, each
component's configuration, safetensors weights and tokenizer files; never pickle-based
weights (`*.bin`, `*.pth`) nor the folders below the components."""


def resolve_pipeline(path, *, revision: str | None = None, cache_dir=None) -> str:
    """The local directory of a diffusers pipeline: a directory on disk, or a Hub
    repository (`"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"`) fetched from the local cache or
    downloaded: `model_index.json` and, in each component's folder, its JSON files,
    safetensors weights and tokenizer files (`PIPELINE_FILES`).

    **Arguments:**

    - `path`: a local directory, or the id of a Hugging Face Hub repository.
    - `revision`, `cache_dir`: as for [`resolve_checkpoint`][] (Hub only).

    **Returns:**

    The directory, as a string. It holds `model_index.json`, checked here.

    **Raises:**

    `ValueError` for a path that is neither a directory nor a repository id, a
    repository the cache and the Hub do not have, or a directory without
    `model_index.json`; `ImportError` when a repository id needs `huggingface_hub`.
    """
    text = os.fspath(path)
    if os.path.exists(text) or not _REPO_ID.match(text):
        if revision is not None or cache_dir is not None:
            raise ValueError(
                f"`revision` and `cache_dir` are for Hub repositories; `path` {text!r} is a "
                "local path. Drop them, or pass a repository id ('owner/name')."
            )
        root = text
        if not os.path.isdir(root):
            raise ValueError(
                f"`path` must be a diffusers pipeline directory (model_index.json and a "
                f"folder per component) or a Hugging Face Hub repository id ('owner/name'); "
                f"{text!r} is not a directory on disk"
                + ("" if _REPO_ID.match(text) else ", nor a repository id") + "."
            )
    else:
        root = _download(text, revision, cache_dir, list(PIPELINE_FILES), ["*/*/*"])
    if not os.path.isfile(os.path.join(root, "model_index.json")):
        raise ValueError(
            f"`path` must be a diffusers pipeline holding model_index.json (what "
            f"`DiffusionPipeline.save_pretrained` writes); {text!r} holds "
            f"{sorted(os.listdir(root))[:12]}. For a single model's folder use its "
            "class's from_pretrained."
        )
    return root
