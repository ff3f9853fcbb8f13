"""`interop.TextTokenizer` and `interop.prompt_clean` against transformers' and diffusers'
outputs, stored by scripts/make_tokenizer_fixtures.py in tests/fixtures/tokenizer/t5/
(transformers 5's `AutoTokenizer` on a tiny T5-style Unigram tokenizer)."""

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
    with pytest.raises(ImportError, match=r"vidax_eqx\[text\]"):
        TextTokenizer.from_pretrained(tmp_path)
