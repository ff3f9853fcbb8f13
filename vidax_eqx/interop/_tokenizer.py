"""Prompts to token ids without torch or transformers: T5 / UMT5 tokenization as the Wan
and CogVideoX pipelines do it, through the `tokenizers` library alone.

The pipelines call transformers' `AutoTokenizer` on their `tokenizer/` folder with
`padding="max_length", truncation=True, add_special_tokens=True` (max_length 512 for
Wan's UMT5, 226 for CogVideoX's T5), after diffusers' `prompt_clean`. `TextTokenizer`
reads the same folder's `tokenizer.json`, or for a T5 folder without one (CogVideoX's)
its SentencePiece `spiece.model` (read by the `sentencepiece` package, converted as
transformers converts it), and gives the same ids and attention masks; `prompt_clean` is
diffusers' cleaning. `tokenizers` (and, for `spiece.model`, `sentencepiece` and `protobuf`)
are optional: `pip install '.[text]'` in a clone of vidax_eqx.
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
from ._spiece import SPIECE_FILE
from ._t5_tokenizer import read_json, rebuild_as_t5, T5_CLASSES, t5_from_spiece, token_content


_INSTALL = "pip install tokenizers (or pip install '.[text]' in a clone of vidax_eqx)"
_PADDINGS = ("max_length", "longest")


def _import_tokenizers(owner: str):
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(f"{owner} builds the tokenizer with Hugging Face's `tokenizers` "
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


class TextTokenizer:
    """A `tokenizers.Tokenizer` (Hugging Face's `tokenizers` library) with transformers'
    batch call: padded to `max_length`, truncated, `</s>` appended, as NumPy arrays.

    Build it with [`TextTokenizer.from_pretrained`][vidax_eqx.interop.TextTokenizer.from_pretrained]
    on a pipeline's `tokenizer/` folder: its `tokenizer.json`, or a T5 folder's
    SentencePiece `spiece.model` (CogVideoX's), converted as transformers 5 converts it.
    For T5 / UMT5 folders (`tokenizer_class` `T5Tokenizer` in `tokenizer_config.json`)
    the ids and masks are those of transformers 5's `AutoTokenizer`, which rebuilds the
    file's tokenizer as its T5 class:
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

        - `folder`: a directory with `tokenizer.json` or SentencePiece's `spiece.model`,
            and optionally `tokenizer_config.json`, `special_tokens_map.json` and
            `added_tokens.json` (pad and eos tokens, `model_max_length`,
            `tokenizer_class`, `extra_ids`, the added tokens). A diffusers pipeline's
            `tokenizer/` folder, after `huggingface_hub.snapshot_download` for a Hub
            repository.

        **Returns:**

        A `TextTokenizer`.

        `tokenizer.json` is read when the folder has it, as transformers does. A folder
        with only `spiece.model` (CogVideoX's and T5's on the Hub) must name
        `T5Tokenizer` as its `tokenizer_class`: the model is converted as transformers 5
        converts it (a Unigram model of the pieces and their scores, the
        `<extra_id_*>` sentinels appended, the model's normalizer table, the special and
        added tokens of the config files), so the ids are transformers'. The file is
        read by the `sentencepiece` package (its normalizer table with `protobuf`; `pip
        install sentencepiece protobuf`). SentencePiece models of other tokenizer classes raise
        `NotImplementedError`; write `tokenizer.json` for them once where transformers is
        installed, `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`.
        """
        owner = "TextTokenizer.from_pretrained"
        folder = os.fspath(folder)
        if not os.path.isdir(folder):
            raise ValueError(f"{owner}: `folder` must be a directory with `tokenizer.json` or "
                             f"`{SPIECE_FILE}`; received {folder!r}, which is not a directory.")
        path = os.path.join(folder, "tokenizer.json")
        from_json = os.path.isfile(path)
        if not from_json and not os.path.isfile(os.path.join(folder, SPIECE_FILE)):
            raise ValueError(f"{owner}: `folder` must hold `tokenizer.json` or SentencePiece's "
                             f"`{SPIECE_FILE}`; received {folder!r}, which holds neither.")
        config = read_json(os.path.join(folder, "tokenizer_config.json"))
        t5 = config.get("tokenizer_class") in T5_CLASSES
        if not from_json and not t5:
            fix = ("write `tokenizer.json` once where transformers is installed, with "
                   "`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`")
            if "tokenizer_class" not in config:
                raise ValueError(
                    f"{owner}: {folder!r} has no `tokenizer.json`, and its `{SPIECE_FILE}` "
                    f"needs a `tokenizer_class` in `tokenizer_config.json` (the folder has "
                    f"none) to be read as transformers reads it: add the file of the "
                    f"model's tokenizer folder (`\"tokenizer_class\": \"T5Tokenizer\"` for T5), "
                    f"or {fix}.")
            raise NotImplementedError(
                f"{owner} reads `{SPIECE_FILE}` as transformers' T5Tokenizer converts it, for "
                f"folders whose `tokenizer_config.json` names `tokenizer_class` T5Tokenizer; "
                f"{folder!r} names {config['tokenizer_class']!r} and has no `tokenizer.json`: "
                f"{fix}.")
        tokenizers = _import_tokenizers(owner)
        special = read_json(os.path.join(folder, "special_tokens_map.json"))

        def special_token(name: str, default: str) -> str:
            return token_content(config.get(name)) or token_content(special.get(name)) or default

        pad_token = special_token("pad_token", "<pad>")
        eos_token = special_token("eos_token", "</s>")
        max_len = config.get("model_max_length")
        # transformers writes a huge sentinel (int(1e30)) when the length is unknown.
        max_len = int(max_len) if is_int(max_len) and 0 < max_len < 1 << 40 else None
        if not from_json:
            tok = t5_from_spiece(tokenizers, folder, config, special, eos_token)
            return cls(tok, pad_token=pad_token, model_max_length=max_len)
        tok = tokenizers.Tokenizer.from_file(path)
        if t5:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            rebuild_as_t5(tokenizers, tok, spec, eos_token)
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
