"""Prompts to token ids without torch or transformers: T5 / UMT5 tokenization as the Wan
and CogVideoX pipelines do it, through the `tokenizers` library alone.

The pipelines call transformers' `AutoTokenizer` on their `tokenizer/` folder with
`padding="max_length", truncation=True, add_special_tokens=True` (max_length 512 for
Wan's UMT5, 226 for CogVideoX's T5), after diffusers' `prompt_clean`. `TextTokenizer`
reads the same folder's `tokenizer.json` and gives the same ids and attention masks;
`prompt_clean` is diffusers' cleaning. `tokenizers` is optional:
`pip install 'vidax_eqx[text]'`.
"""

import functools
import html
import importlib.metadata
import importlib.util
import json
import os
import re

import numpy as np

from .._checks import is_int


_INSTALL = "pip install 'vidax_eqx[text]'"
# `tokenizer_class` values of `tokenizer_config.json` for which transformers (>= 5)
# rebuilds the backend as its T5 class does (UMT5 folders name `T5Tokenizer` too).
_T5_CLASSES = ("T5Tokenizer", "T5TokenizerFast")
_PADDINGS = ("max_length", "longest")


def _import_tokenizers(owner: str):
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(f"{owner} reads `tokenizer.json` through Hugging Face's `tokenizers` "
                          f"library, which is not installed: {_INSTALL}.") from e
    return tokenizers


# -- prompt cleaning (diffusers' pipeline_wan.py) ----------------------------------------


@functools.cache
def _ftfy_available() -> bool:
    # diffusers' `is_ftfy_available`: the module can be found and its distribution has a version.
    if importlib.util.find_spec("ftfy") is None:
        return False
    try:
        importlib.metadata.version("ftfy")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def prompt_clean(text: str) -> str:
    """diffusers' `prompt_clean` (Wan's and CogVideoX's pipelines): `ftfy.fix_text`
    if `ftfy` is installed, HTML entities unescaped twice (`&amp;amp;` -> `&`), runs of
    whitespace collapsed to one space, the ends stripped.

    **Arguments:**

    - `text`: the prompt.

    **Returns:**

    The cleaned prompt.

    `ftfy` is used exactly when diffusers would use it (the package is importable and
    installed as a distribution); it is not a dependency here, as it is not of diffusers.
    Without it, mojibake (`"cafÃ©"`) and the other text ftfy repairs stay as they are,
    as they do in diffusers without ftfy; HTML entities and whitespace are cleaned
    either way.
    """
    if not isinstance(text, str):
        raise ValueError(f"prompt_clean: `text` must be a str; received {type(text).__name__}.")
    if _ftfy_available():
        import ftfy

        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()  # basic_clean
    return re.sub(r"\s+", " ", text).strip()  # whitespace_clean


# -- the tokenizer -----------------------------------------------------------------------


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token(value) -> str | None:
    """A special token as written in the config files: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _rebuild_as_t5(tokenizers, tok, spec: dict, eos_token: str) -> None:
    """What transformers >= 5 `T5Tokenizer` does with a `tokenizer.json`: keeps the model
    (vocabulary) and the SentencePiece `Precompiled` normalizer, drops any other
    normalizer, splits on whitespace then Metaspace, and appends `</s>`."""
    normalizer = spec.get("normalizer") or None
    parts = []
    if normalizer is not None:
        parts = normalizer["normalizers"] if normalizer.get("type") == "Sequence" else [normalizer]
    charsmap = next((p["precompiled_charsmap"] for p in parts
                     if p.get("type") == "Precompiled" and "precompiled_charsmap" in p), None)
    if charsmap is not None:
        import base64

        tok.normalizer = tokenizers.normalizers.Precompiled(base64.b64decode(charsmap))
    else:
        tok.normalizer = None
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.WhitespaceSplit(),
        tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"TextTokenizer.from_pretrained: the eos token {eos_token!r} is not in "
                         f"the vocabulary of `tokenizer.json`.")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=["$A", eos_token], pair=["$A", eos_token, "$B", eos_token],
        special_tokens=[(eos_token, eos_id)])


class TextTokenizer:
    """A `tokenizer.json` (Hugging Face's `tokenizers` library) with transformers'
    batch call: padded to `max_length`, truncated, `</s>` appended, as NumPy arrays.

    Build it with [`TextTokenizer.from_pretrained`][vidax_eqx.interop.TextTokenizer.from_pretrained]
    on a pipeline's `tokenizer/` folder. For T5 / UMT5 folders (`tokenizer_class`
    `T5Tokenizer` in `tokenizer_config.json`) the ids and masks are those of
    transformers 5's `AutoTokenizer`, which rebuilds the file's tokenizer as its T5 class:
    only a SentencePiece `Precompiled` normalizer is kept, text is split on whitespace
    (so runs of spaces count as one), and `</s>` is appended. transformers 4's
    `T5TokenizerFast` used the file as written; the two agree on prompts after
    [`prompt_clean`][vidax_eqx.interop.prompt_clean] for the files the Hub's T5 and UMT5
    checkpoints ship. Other folders use `tokenizer.json` as written, as `AutoTokenizer`
    does without a `tokenizer_class`.

    A call sets the wrapped tokenizer's padding and truncation: share one instance
    between threads only with a lock.
    """

    def __init__(self, tokenizer, *, pad_token: str = "<pad>", model_max_length: int | None = None):
        """**Arguments:**

        - `tokenizer`: a `tokenizers.Tokenizer`, its post-processor appending the
            special tokens (T5's `</s>`).
        - `pad_token`: the padding token; it must be in the vocabulary.
        - `model_max_length`: the length the model was trained for, from
            `tokenizer_config.json` (`None` if not given); informative only, calls
            take `max_length`.
        """
        pad_id = tokenizer.token_to_id(pad_token) if isinstance(pad_token, str) else None
        if pad_id is None:
            raise ValueError(f"TextTokenizer: `pad_token` must be a token of the vocabulary; "
                             f"received {pad_token!r}.")
        self.tokenizer = tokenizer
        self.pad_token = pad_token
        self.pad_token_id = int(pad_id)
        self.model_max_length = model_max_length

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "TextTokenizer":
        """Reads a tokenizer folder as transformers' `AutoTokenizer.from_pretrained` does.

        **Arguments:**

        - `folder`: a directory with `tokenizer.json`, and optionally
            `tokenizer_config.json` and `special_tokens_map.json` (pad and eos tokens,
            `model_max_length`, `tokenizer_class`). A diffusers pipeline's `tokenizer/`
            folder, after `huggingface_hub.snapshot_download` for a Hub repository.

        **Returns:**

        A `TextTokenizer`.

        A folder with only SentencePiece's `spiece.model` is refused: convert it once
        where transformers is installed, `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`,
        which writes `tokenizer.json`.
        """
        owner = "TextTokenizer.from_pretrained"
        folder = os.fspath(folder)
        if not os.path.isdir(folder):
            raise ValueError(f"{owner}: `folder` must be a directory with `tokenizer.json`; "
                             f"received {folder!r}, which is not a directory.")
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            hint = (" It has SentencePiece's `spiece.model`, which is not read here: write "
                    "`tokenizer.json` once where transformers is installed, with "
                    "`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`."
                    if os.path.isfile(os.path.join(folder, "spiece.model")) else "")
            raise ValueError(f"{owner}: `folder` must hold `tokenizer.json`; received "
                             f"{folder!r}, which does not.{hint}")
        tokenizers = _import_tokenizers(owner)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        special = _read_json(os.path.join(folder, "special_tokens_map.json"))

        def special_token(name: str, default: str) -> str:
            return _token(config.get(name)) or _token(special.get(name)) or default

        pad_token = special_token("pad_token", "<pad>")
        eos_token = special_token("eos_token", "</s>")
        max_len = config.get("model_max_length")
        # transformers writes a huge sentinel (int(1e30)) when the length is unknown.
        max_len = int(max_len) if is_int(max_len) and 0 < max_len < 1 << 40 else None
        tok = tokenizers.Tokenizer.from_file(path)
        if config.get("tokenizer_class") in _T5_CLASSES:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            _rebuild_as_t5(tokenizers, tok, spec, eos_token)
        return cls(tok, pad_token=pad_token, model_max_length=max_len)

    def __call__(self, prompts: str | list[str], *, max_length: int, padding: str = "max_length",
                 truncation: bool = True, add_special_tokens: bool = True
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention masks, as transformers' tokenizer call with the same
        arguments and `return_attention_mask=True`.

        **Arguments:**

        - `prompts`: one prompt or a non-empty list of them (cleaned or not: this does
            not call [`prompt_clean`][vidax_eqx.interop.prompt_clean]).
        - `max_length`: the length of every row (512 for Wan, 226 for CogVideoX).
        - `padding`: `"max_length"` pads every row to `max_length`; `"longest"` to the
            longest row of the batch.
        - `truncation`: cut rows longer than `max_length`, keeping the appended `</s>`
            (the prompt's last tokens are dropped). With `False`, a longer row raises.
        - `add_special_tokens`: append `</s>` (the post-processor's tokens).

        **Returns:**

        `(input_ids, attention_mask)`, NumPy int32 arrays `(B, max_length)` (`B = 1` for
        one prompt), the mask 1 on tokens and 0 on padding.
        """
        owner = "TextTokenizer"
        if isinstance(prompts, str):
            batch = [prompts]
        elif isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError(f"{owner}: `prompts` must be a str or a non-empty list of str; "
                                 f"received an empty {type(prompts).__name__}.")
            bad = next((p for p in prompts if not isinstance(p, str)), None)
            if any(not isinstance(p, str) for p in prompts):
                raise ValueError(f"{owner}: `prompts` must be a str or a list of str; received "
                                 f"a list holding {type(bad).__name__} ({bad!r}).")
            batch = list(prompts)
        else:
            raise ValueError(f"{owner}: `prompts` must be a str or a list of str; received "
                             f"{type(prompts).__name__}.")
        if not is_int(max_length) or max_length < 1:
            raise ValueError(f"{owner}: `max_length` must be an int >= 1; received {max_length!r}.")
        if padding not in _PADDINGS:
            raise ValueError(f"{owner}: `padding` must be one of {_PADDINGS}; received {padding!r}.")
        for name, flag in (("truncation", truncation), ("add_special_tokens", add_special_tokens)):
            if not isinstance(flag, bool):
                raise ValueError(f"{owner}: `{name}` must be a bool; received {flag!r}.")
        max_length = int(max_length)
        tok = self.tokenizer
        if truncation:
            tok.enable_truncation(max_length, stride=0, strategy="longest_first", direction="right")
        else:
            tok.no_truncation()
        tok.enable_padding(direction="right", pad_id=self.pad_token_id, pad_type_id=0,
                           pad_token=self.pad_token,
                           length=max_length if padding == "max_length" else None)
        encodings = tok.encode_batch(batch, add_special_tokens=add_special_tokens)
        longest = max(len(e.ids) for e in encodings)
        if longest > max_length:
            raise ValueError(f"{owner}: with `truncation=False` every prompt must fit in "
                             f"`max_length` = {max_length} tokens; received one of {longest} "
                             f"tokens. Pass `truncation=True` or a larger `max_length`.")
        ids = np.asarray([e.ids for e in encodings], dtype=np.int32)
        mask = np.asarray([e.attention_mask for e in encodings], dtype=np.int32)
        return ids, mask
