"""transformers 5's `T5Tokenizer` rebuilt over Hugging Face's `tokenizers` library, for
`TextTokenizer`: from a `tokenizer.json` (`rebuild_as_t5`) and from a SentencePiece
`spiece.model` (`t5_from_spiece`, the model read by `sentencepiece`). Both give the
tokenizer that transformers 5.25's `AutoTokenizer.from_pretrained` builds for a folder
whose `tokenizer_config.json` names `tokenizer_class` T5Tokenizer (T5's, UMT5's,
CogVideoX's): a Unigram model, only SentencePiece's `Precompiled` normalizer, a split on
whitespace then Metaspace, the special and added tokens of the config files, `</s>`
appended. The `tokenizers` module is passed in: it is imported lazily by the caller.
"""

import json
import os

from .._checks import is_int
from ._spiece import read_spiece, SPIECE_FILE, SpieceError


T5_CLASSES = ("T5Tokenizer", "T5TokenizerFast")
"""`tokenizer_class` values of `tokenizer_config.json` for which transformers (>= 5)
rebuilds the backend as its T5 class does (UMT5 folders name `T5Tokenizer` too)."""

# transformers' named special tokens, in the order it adds them (`SPECIAL_TOKENS_ATTRIBUTES`),
# and the defaults of its T5Tokenizer.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_T5_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def read_json(path: str) -> dict:
    """The JSON object in the file at `path`; `{}` if there is no file or no object."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def token_content(value) -> str | None:
    """A special token as written in the config files: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _t5_pipeline(tokenizers, tok, charsmap: bytes | None, eos_token: str, source: str,
                 added=()) -> None:
    """The parts that transformers >= 5 `T5Tokenizer` builds around its Unigram model, in
    its order: the SentencePiece `Precompiled` normalizer if there is a table (no other
    normalizer), a split on whitespace then Metaspace, the `added` tokens, and a
    post-processor appending `</s>`."""
    tok.normalizer = tokenizers.normalizers.Precompiled(charsmap) if charsmap else None
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.WhitespaceSplit(),
        tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    if added:
        tok.add_tokens(list(added))
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"TextTokenizer.from_pretrained: the eos token {eos_token!r} is not in "
                         f"the vocabulary of `{source}`.")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=["$A", eos_token], pair=["$A", eos_token, "$B", eos_token],
        special_tokens=[(eos_token, eos_id)])


def rebuild_as_t5(tokenizers, tok, spec: dict, eos_token: str) -> None:
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

        charsmap = base64.b64decode(charsmap)
    _t5_pipeline(tokenizers, tok, charsmap, eos_token, "tokenizer.json")


def _added_token(tokenizers, value, special: bool | None = None):
    """A token of the config files, a str or `{"content": ..., flags}`, as a
    `tokenizers.AddedToken` (a str is special, as transformers makes it); `special`
    overrides the flag. `None` for anything else."""
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=True if special is None else special)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value[k]) for k in _FLAGS if k in value}
        if special is not None:
            flags["special"] = special
        return tokenizers.AddedToken(value["content"], **flags)
    return None


def _t5_added_tokens(tokenizers, folder: str, config: dict, special: dict, pieces,
                     extra_ids: int) -> list:
    """The tokens that transformers 5.25's `AutoTokenizer` adds to a T5 tokenizer built
    from `spiece.model`, with their flags and in its order (the order sets the ids of
    tokens that are not pieces): `added_tokens_decoder` of `tokenizer_config.json` by id
    (without it: `added_tokens.json`, special iff named in the config files), then the
    named special tokens (`special_tokens_map.json`'s override the config's when there
    is no `added_tokens_decoder`; T5's `</s>`, `<unk>`, `<pad>` by default), then the
    additional special tokens of `tokenizer_config.json` (without any: the model's control
    pieces and `<extra_id_0>` ... `<extra_id_{extra_ids - 1}>`). A content already added
    keeps its first flags."""
    owner = "TextTokenizer.from_pretrained"
    named = {key: config[key] for key in _NAMED_TOKENS if key in config}
    extras = None
    if config.get("extra_special_tokens"):
        extras = config["extra_special_tokens"]
    elif "additional_special_tokens" in config or "extra_special_tokens" in config:
        extras = config.get("additional_special_tokens") or []
    decoder = {}
    if "added_tokens_decoder" in config:
        table = config["added_tokens_decoder"]
        entries = table.items() if isinstance(table, dict) else ()
        for index, value in entries:
            token = _added_token(tokenizers, value) if isinstance(value, dict) else None
            if token is None or not str(index).isdigit():
                raise ValueError(f"{owner}: `added_tokens_decoder` of `tokenizer_config.json` in "
                                 f"{folder!r} must map ids to {{\"content\": ...}}; received "
                                 f"{index!r}: {value!r}.")
            decoder[int(index)] = token
    else:
        for key, value in special.items():
            if key in _NAMED_TOKENS:
                named[key] = _added_token(tokenizers, value, special=True) or value
            elif key == "extra_special_tokens" and isinstance(value, list):
                extras = list(extras or []) + [v for v in value if v not in (extras or [])]
        added = read_json(os.path.join(folder, "added_tokens.json"))
        if added:
            specials = {token_content(v) or str(v) for v in named.values() if v}
            specials |= {token_content(v) or str(v) for v in (extras or [])}
            for content, index in added.items():
                if not is_int(index):
                    raise ValueError(f"{owner}: `added_tokens.json` in {folder!r} must map tokens "
                                     f"to ids; received {content!r}: {index!r}.")
                is_special = content in specials
                decoder[int(index)] = tokenizers.AddedToken(
                    content, lstrip=False, rstrip=False, normalized=not is_special,
                    special=is_special)
    if extras is None:
        extras = ([tokenizers.AddedToken(p, normalized=False, special=True)
                   for p, _, control in pieces if control]
                  + [f"<extra_id_{i}>" for i in range(extra_ids)])
    elif isinstance(extras, dict):
        extras = list(extras.values())
    tokens = [decoder[i] for i in sorted(decoder)]
    for key in _NAMED_TOKENS:
        value = named.get(key, _T5_DEFAULTS.get(key))
        tokens.append(value if isinstance(value, tokenizers.AddedToken)
                      else _added_token(tokenizers, value, special=True))
    for value in extras if isinstance(extras, (list, tuple)) else ():
        tokens.append(value if isinstance(value, tokenizers.AddedToken)
                      else _added_token(tokenizers, value))
    unique, seen = [], set()
    for token in tokens:
        if token is not None and token.content not in seen:
            seen.add(token.content)
            unique.append(token)
    return unique


def t5_from_spiece(tokenizers, folder: str, config: dict, special: dict, eos_token: str):
    """transformers 5's `T5Tokenizer` from a folder's `spiece.model`
    (`TokenizersBackend._convert_from_sentencepiece`, `T5Converter.convert_from_spm`): a
    Unigram model of the pieces and their scores followed by `<extra_id_{extra_ids - 1}>`
    ... `<extra_id_0>` (score 0), unknown id 2 and no byte fallback whatever the model
    says (as transformers builds it), the model's normalizer table, then `_t5_pipeline`."""
    owner = "TextTokenizer.from_pretrained"
    path = os.path.join(folder, SPIECE_FILE)
    extra_ids = config.get("extra_ids", 100)
    if not is_int(extra_ids) or extra_ids < 0:
        raise ValueError(f"{owner}: `extra_ids` of `tokenizer_config.json` in {folder!r} must be "
                         f"an int >= 0; received {extra_ids!r}.")

    def corrupt(why: str) -> ValueError:
        return ValueError(
            f"{owner}: {folder!r} has no `tokenizer.json`, and its `{SPIECE_FILE}` is not a "
            f"SentencePiece model: {why}. Download it again, or write `tokenizer.json` from a "
            f"sound copy where transformers is installed, with "
            f"`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`.")

    try:
        model = read_spiece(path)
    except SpieceError as e:
        raise corrupt(str(e)) from None
    vocab = [(piece, score) for piece, score, _ in model.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(extra_ids))]
    added = _t5_added_tokens(tokenizers, folder, config, special, model.pieces, extra_ids)
    try:
        tok = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=2, byte_fallback=False))
        _t5_pipeline(tokenizers, tok, model.precompiled_charsmap, eos_token, SPIECE_FILE, added)
    except ValueError:
        raise
    except Exception as e:  # tokenizers' errors: a damaged normalizer table, too few pieces
        raise corrupt(f"`tokenizers` cannot build it ({e})") from None
    return tok
