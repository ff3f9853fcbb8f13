"""`interop.TextTokenizer` and `interop.prompt_clean` against transformers' and diffusers'
outputs, stored by scripts/make_tokenizer_fixtures.py in tests/fixtures/tokenizer/t5/
(transformers 5's `AutoTokenizer` on a tiny T5-style Unigram tokenizer)."""

import importlib.util
import json
import pathlib
import shutil
import sys

import numpy as np
import pytest

from vidax_eqx.interop import prompt_clean, TextTokenizer

pytest.importorskip("tokenizers")

FOLDER = pathlib.Path(__file__).resolve().parent / "fixtures" / "tokenizer" / "t5"
IO = json.loads((FOLDER / "io.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.from_pretrained(FOLDER)


def test_config_read(tok):
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.model_max_length == 512


@pytest.mark.parametrize("case", IO["cases"], ids=lambda c: f"L{c['max_length']}-clean{c['cleaned']}")
def test_batch_matches_transformers(tok, case):
    prompts = IO["prompt_clean"] if case["cleaned"] else IO["prompts"]
    ids, mask = tok(prompts, max_length=case["max_length"])
    assert ids.dtype == np.int32 and mask.dtype == np.int32
    assert ids.shape == mask.shape == (len(prompts), case["max_length"])
    np.testing.assert_array_equal(ids, case["input_ids"])
    np.testing.assert_array_equal(mask, case["attention_mask"])


def test_one_prompt_and_truncation(tok):
    case = next(c for c in IO["cases"] if c["max_length"] == 16 and not c["cleaned"])
    i = max(range(len(IO["prompts"])), key=lambda j: len(IO["prompts"][j]))
    ids, mask = tok(IO["prompts"][i], max_length=16)
    assert ids.shape == (1, 16)
    np.testing.assert_array_equal(ids[0], case["input_ids"][i])
    assert ids[0, -1] == 1 and mask[0].all()  # truncated, `</s>` kept last
    # The untruncated row is longer: truncation did cut it.
    long_ids, _ = tok(IO["prompts"][i], max_length=512)
    assert int(long_ids[0].astype(bool).sum()) > 16
    with pytest.raises(ValueError, match="truncation=False"):
        tok(IO["prompts"][i], max_length=16, truncation=False)


def test_padding_longest_and_no_special_tokens(tok):
    ids, mask = tok(["A cat.", ""], max_length=64, padding="longest")
    assert ids.shape[1] == int(mask.sum(1).max()) < 64
    assert list(ids[1]) == [1] + [0] * (ids.shape[1] - 1)
    plain, _ = tok("A cat.", max_length=64, padding="longest", add_special_tokens=False)
    np.testing.assert_array_equal(plain[0], ids[0, :-1])


def test_prompt_clean_matches_diffusers():
    if IO["ftfy_installed"]:
        pytest.skip("the fixture's prompt_clean ran with ftfy")
    import vidax_eqx.interop._tokenizer as impl

    if impl._ftfy_available():
        pytest.skip("ftfy is installed here, the fixture was written without it")
    assert [prompt_clean(p) for p in IO["prompts"]] == IO["prompt_clean"]
    assert prompt_clean("Tom &amp;amp; Jerry") == "Tom & Jerry"
    assert prompt_clean("  a \t b\n\nc  ") == "a b c"


@pytest.mark.parametrize("prompts, match", [
    (3, "`prompts`.*received int"),
    ([], "`prompts`.*empty list"),
    (["ok", None], "`prompts`.*NoneType"),
])
def test_bad_prompts(tok, prompts, match):
    with pytest.raises(ValueError, match=match):
        tok(prompts, max_length=8)


@pytest.mark.parametrize("max_length", [0, -1, 2.0, True, None])
def test_bad_max_length(tok, max_length):
    with pytest.raises(ValueError, match="`max_length` must be an int >= 1; received"):
        tok("a", max_length=max_length)


def test_bad_padding_and_text(tok):
    with pytest.raises(ValueError, match="`padding`"):
        tok("a", max_length=8, padding="do_not_pad")
    with pytest.raises(ValueError, match="`text` must be a str"):
        prompt_clean(b"bytes")


def test_folder_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not a directory"):
        TextTokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "spiece.model").write_bytes(b"")
    with pytest.raises(ValueError, match="tokenizer.json.*spiece.model.*save_pretrained"):
        TextTokenizer.from_pretrained(tmp_path)
    shutil.copy(FOLDER / "tokenizer.json", tmp_path / "tokenizer.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install tokenizers \(or pip install "
                                          r"'\.\[text\]' in a clone of vidax_eqx\)"):
        TextTokenizer.from_pretrained(tmp_path)


# -- SentencePiece folders (`spiece.model`, no `tokenizer.json`) ---------------------------
# tests/fixtures/tokenizer/spm/ (scripts/make_spm_tokenizer_fixtures.py): a tiny T5
# SentencePiece model with CogVideoX's config files, and transformers 5's ids and masks
# for it and for two other configurations of the same model (the older Hub T5 files, a
# bare tokenizer_config.json), written here beside a copy of the model.

SPM = pathlib.Path(__file__).resolve().parent / "fixtures" / "tokenizer" / "spm"
# The `text` extra installs sentencepiece (the reader of spiece.model) and protobuf.
needs_sentencepiece = pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is None,
                                         reason="sentencepiece is not installed")
SPM_IO = json.loads((SPM / "io.json").read_text(encoding="utf-8"))
SPM_VARIANTS = {v["name"]: v for v in SPM_IO["variants"]}


def _spm_folder(root: pathlib.Path, files: dict, model: bytes | None = None) -> pathlib.Path:
    """A tokenizer folder: `model` (the fixture's spiece.model by default) and `files`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "spiece.model").write_bytes((SPM / "spiece.model").read_bytes() if model is None
                                        else model)
    for name, content in files.items():
        (root / name).write_text(json.dumps(content), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def spm_toks(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    out = {}
    for name, variant in SPM_VARIANTS.items():
        folder = SPM if variant["files"] is None else _spm_folder(
            tmp_path_factory.mktemp(name), variant["files"])
        assert not (folder / "tokenizer.json").exists()
        out[name] = TextTokenizer.from_pretrained(folder)
    return out


@pytest.mark.parametrize("name, case", [(v["name"], c) for v in SPM_IO["variants"]
                                        for c in v["cases"]],
                         ids=lambda x: x if isinstance(x, str) else f"L{x['max_length']}")
def test_spiece_matches_transformers(spm_toks, name, case):
    ids, mask = spm_toks[name](SPM_IO["prompts"], max_length=case["max_length"])
    assert ids.shape == mask.shape == (len(SPM_IO["prompts"]), case["max_length"])
    np.testing.assert_array_equal(ids, case["input_ids"])
    np.testing.assert_array_equal(mask, case["attention_mask"])


@pytest.mark.parametrize("name", list(SPM_VARIANTS))
def test_spiece_vocabulary_and_added_tokens(spm_toks, name):
    variant, tok = SPM_VARIANTS[name], spm_toks[name].tokenizer
    assert tok.get_vocab_size() == variant["vocab_size"]
    added = [[i, t.content, t.single_word, t.lstrip, t.rstrip, t.normalized, t.special]
             for i, t in sorted(tok.get_added_tokens_decoder().items())]
    assert added == variant["added_tokens"]
    if "unigram" in variant:  # the pieces, their scores and the sentinels, as transformers'
        model = json.loads(tok.to_str())["model"]
        assert model["type"] == "Unigram"
        assert model["unk_id"] == variant["unigram"]["unk_id"]
        assert model["byte_fallback"] == variant["unigram"]["byte_fallback"]
        assert model["vocab"] == variant["unigram"]["vocab"]


def test_spiece_config_read(spm_toks):
    tok = spm_toks["cogvideox"]
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0 and tok.model_max_length == 226


@needs_sentencepiece
def test_tokenizer_json_preferred_over_spiece(tmp_path):
    folder = tmp_path / "both"
    shutil.copytree(FOLDER, folder)
    shutil.copy(SPM / "spiece.model", folder / "spiece.model")
    case = IO["cases"][0]
    ids, mask = TextTokenizer.from_pretrained(folder)(IO["prompts"], max_length=case["max_length"])
    np.testing.assert_array_equal(ids, case["input_ids"])
    np.testing.assert_array_equal(mask, case["attention_mask"])


def _message(field: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (payload under 128 bytes)."""
    return bytes([field << 3 | 2, len(payload)]) + payload


def _piece(text: str, kind: int | None = None) -> bytes:
    """A `pieces` entry; `kind` 2 is SentencePiece's UNKNOWN type (its loader needs one)."""
    return _message(1, _message(1, text.encode()) + (bytes([3 << 3, kind]) if kind else b""))


def _patched(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + bytes([value]) + data[at + 1:]


_PIECES = b"".join(_piece(p, 2 if p == "<unk>" else None) for p in ("<pad>", "</s>", "<unk>", "▁a"))
_T5 = {"tokenizer_config.json": {"tokenizer_class": "T5Tokenizer", "extra_ids": 2}}
_SPM_MODEL = (SPM / "spiece.model").read_bytes()
_LOAD = r"sentencepiece cannot load it \(.+\)"  # its reason, worded as its version words it


@needs_sentencepiece
@pytest.mark.parametrize("model, why", [
    (b"", "the file is empty"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 791656\n", "Git LFS pointer"),
    (b"version 1\n", _LOAD),
    (b"<!DOCTYPE html><html>", _LOAD),
    (_SPM_MODEL[:5000], _LOAD),
    (bytes(8), _LOAD),
    (_message(3, _message(1, b"nmt_nfkc")), _LOAD),  # no pieces
    (_PIECES + _message(1, _message(1, b"")), _LOAD),  # an empty piece
    (_PIECES + _message(1, _message(1, b"\xff\xfe")), "piece 4 is not UTF-8"),
    # Damaged normalizer tables: sentencepiece refuses the first two (from 0.2.3; before,
    # the check of this package does); it loads the third, on which tokenizers panics at
    # the first prompt, and this package's check refuses it.
    (_PIECES + _message(3, _message(2, b"\x05\x00\x00\x00abcdefgh")), f"{_LOAD}|trie size 5"),
    (_PIECES + _message(3, _message(2, b"\x04\x00\x00\x00\x00\x00\x00\xff")),
     f"{_LOAD}|reads past"),
    (_patched(_SPM_MODEL, 3652, 0xFF), "normalizer table .* damaged: a replacement starts "
                                        "outside its strings"),
])
def test_spiece_corrupt(tmp_path, model, why):
    folder = _spm_folder(tmp_path, _T5, model)
    with pytest.raises(ValueError, match=rf"spiece.model` is not a SentencePiece model: .*{why}"
                                         rf".*Download it again"):
        TextTokenizer.from_pretrained(folder)


@needs_sentencepiece
def test_spiece_minimal_model(tmp_path):
    # Four pieces (`<unk>` of the UNKNOWN type, which sentencepiece needs to load a model)
    # and no normalizer table (SentencePiece's identity normalization); the ids are
    # transformers 5.25's for this folder: `<extra_id_1>`, `<extra_id_0>` = 4, 5 after the
    # pieces, text without a piece -> `<unk>` = 2.
    tok = TextTokenizer.from_pretrained(_spm_folder(tmp_path, _T5, _PIECES))
    assert tok.tokenizer.normalizer is None and tok.tokenizer.get_vocab_size() == 6
    ids, mask = tok("a  aa\tb <extra_id_0>", max_length=8)
    assert ids.tolist() == [[3, 3, 2, 2, 5, 1, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]


def test_spiece_folder_errors(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="`tokenizer.json` or SentencePiece's `spiece.model`; "
                                         "received .*, which holds neither"):
        TextTokenizer.from_pretrained(tmp_path / "empty")
    with pytest.raises(ValueError, match="needs a `tokenizer_class`"):
        TextTokenizer.from_pretrained(_spm_folder(tmp_path / "no_class", {}))
    llama = {"tokenizer_config.json": {"tokenizer_class": "LlamaTokenizer"}}
    with pytest.raises(NotImplementedError, match="T5Tokenizer.*names 'LlamaTokenizer'"):
        TextTokenizer.from_pretrained(_spm_folder(tmp_path / "llama", llama))
    bad = {"tokenizer_config.json": {"tokenizer_class": "T5Tokenizer", "extra_ids": -1}}
    with pytest.raises(ValueError, match="`extra_ids`.*int >= 0; received -1"):
        TextTokenizer.from_pretrained(_spm_folder(tmp_path / "extra_ids", bad))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match=r"needs the `sentencepiece` package and `protobuf` .*"
                                          r"pip install -U sentencepiece protobuf"):
        TextTokenizer.from_pretrained(_spm_folder(tmp_path / "no_sentencepiece", _T5))
