"""Writes tests/fixtures/tokenizer/t5/: a tiny T5-style tokenizer and transformers' ids
and masks for it, the reference of tests/test_tokenizer.py.

Run it where torch-free transformers and diffusers are installed (the test suite never
needs them):

    python scripts/make_tokenizer_fixtures.py

Written with tokenizers 0.23.3, transformers 5.25.0, diffusers 0.42.1 (`io.json`
records the versions and whether ftfy was installed: it was not, so `prompt_clean` ran
without `ftfy.fix_text`, as vidax_eqx's does when ftfy is absent).

The tokenizer: a SentencePiece-style Unigram model trained by the `tokenizers` library
on the small corpus below (ASCII, punctuation, digits, "café", CJK), special tokens
`<pad>` = 0, `</s>` = 1, `<unk>` = 2 as T5's, a Metaspace pre-tokenizer and a
TemplateProcessing post-processor appending `</s>`. The Hub's T5 / UMT5 files
normalize with SentencePiece's `Precompiled` charsmap, which only SentencePiece's
trainer writes; this file has a simple NFKC + collapse-spaces normalizer instead, and
`tokenizer_config.json` names `T5Tokenizer` as those folders do, so transformers 5
drops that normalizer (it keeps only a `Precompiled` one) and the fixture pins that
rebuild. Training is deterministic for a given tokenizers version.
"""

import importlib.util
import json
import os
import pathlib

import diffusers
import tokenizers
import transformers
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from tokenizers import decoders, normalizers, pre_tokenizers, processors, Regex, Tokenizer
from tokenizers.models import Unigram
from tokenizers.trainers import UnigramTrainer
from transformers import AutoTokenizer

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizer" / "t5"

CORPUS = [
    "A cat sits on the mat.",
    "The café on the corner serves 12 croissants and 3 coffees!",
    "A dog runs across the green field, chasing a red ball.",
    "Two people walk along the beach at sunset.",
    "Hello, world? Yes: 42% of 100 is 42.",
    "A close-up of a flower; petals move in the wind.",
    "Camera pans left; then zooms in slowly...",
    "An astronaut rides a horse on the moon (in 4K).",
    "Rain falls on a city street at night, neon lights reflect.",
    "一只猫坐在垫子上。",
    "一个人在海边散步。",
    "镜头缓慢推进，画面明亮。",
    "Un café au lait, s'il vous plaît — merci!",
    "Die Straße ist nass; über der Stadt hängen Wolken.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 2024 3.14",
    "Quotes \"like this\" and 'this' & ampersands <tags>.",
    "The quick brown fox jumps over the lazy dog.",
    "A slow motion shot of water droplets splashing.",
    "Snow covers the mountains; a bird flies above.",
    "A child laughs and plays with a yellow kite.",
    "Fireworks explode over the river at midnight.",
    "A robot walks through a futuristic city.",
    "Leaves fall from the trees in autumn.",
    "A chef cooks pasta in a busy kitchen.",
    "Waves crash against the rocks, foam everywhere.",
    "Low-angle view of a skyscraper, clouds passing.",
    "Bright, colorful, high quality, detailed video.",
    "Worst quality, blurry, static, overexposed.",
]

PROMPTS = [
    "A cat sits on the mat.",
    "",
    "   A   dog\truns\n across  the field.  ",
    "Tom &amp;amp; Jerry &lt;3 the café",
    "一只猫坐在垫子上。 A cat.",
    "Numbers 2024, 3.14 and 42%!",
    "A very long prompt: the quick brown fox jumps over the lazy dog while a robot walks "
    "through a futuristic city and fireworks explode over the river at midnight.",
    "Unseen word: xylophonequartz ÆØÅ ｆｕｌｌｗｉｄｔｈ",
    "An eos inside </s> the prompt",
    "Bright, colorful, high quality, detailed video.",
]
MAX_LENGTHS = [16, 48]


def build() -> Tokenizer:
    tok = Tokenizer(Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = UnigramTrainer(vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"],
                             unk_token="<unk>", max_piece_length=8, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert [tok.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    return tok


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    build().save(str(OUT / "tokenizer.json"))
    config = {"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "extra_ids": 0,
              "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    special = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    (OUT / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")

    hf = AutoTokenizer.from_pretrained(str(OUT))
    cleaned = [prompt_clean(p) for p in PROMPTS]
    cases = []
    for max_length in MAX_LENGTHS:
        for clean in (False, True):
            batch = cleaned if clean else PROMPTS
            out = hf(batch, padding="max_length", max_length=max_length, truncation=True,
                     add_special_tokens=True, return_attention_mask=True)
            cases.append({"max_length": max_length, "cleaned": clean,
                          "input_ids": out["input_ids"], "attention_mask": out["attention_mask"]})
    io = {
        "versions": {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
                     "diffusers": diffusers.__version__},
        "transformers_class": type(hf).__name__,
        "ftfy_installed": importlib.util.find_spec("ftfy") is not None,
        "prompts": PROMPTS,
        "prompt_clean": cleaned,
        "cases": cases,
    }
    (OUT / "io.json").write_text(json.dumps(io, ensure_ascii=False) + "\n")
    for f in sorted(os.listdir(OUT)):
        print(f, os.path.getsize(OUT / f))


if __name__ == "__main__":
    main()
