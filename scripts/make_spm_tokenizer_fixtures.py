"""Writes tests/fixtures/tokenizer/spm/: a tiny T5-style SentencePiece tokenizer folder
(`spiece.model` and no `tokenizer.json`, as CogVideoX's `tokenizer/`) and transformers'
ids and masks for it, the reference of the `spiece.model` tests in tests/test_tokenizer.py.

Run it where transformers, sentencepiece and protobuf are installed (the test suite never
needs them):

    python scripts/make_spm_tokenizer_fixtures.py

Written with sentencepiece 0.2.3, protobuf 7.36.2, tokenizers 0.23.3, transformers 5.25.0
(`io.json` records the versions).

The model: SentencePiece's own trainer, a Unigram model with T5's settings (`<pad>` = 0,
`</s>` = 1, `<unk>` = 2, no `<s>`, no byte fallback) trained on the small multilingual
corpus below (accents, CJK, Cyrillic, emoji, digits), a few hundred pieces, one thread
(deterministic). Its normalizer is SentencePiece's `nmt_nfkc` (T5's) restricted to the
characters of `_rule_sources()`: the full `nmt_nfkc` table is 240 KB, this one a few KB,
built by the same SentencePiece code from the rules that `nmt_nfkc` itself gives for
those characters (control characters, Latin-1, general punctuation, letter-like and
enclosed forms, CJK punctuation, ligatures, variation selectors, half- and full-width
forms, and base letters followed by combining accents), so the converted `Precompiled`
normalizer is exercised on real NFKC rules. The model's `normalizer_spec` names it
`nmt_nfkc_subset` (the trainer would record the rules file's temporary path).

The folder's config files are those of CogVideoX's `tokenizer/` (transformers 4's
`T5Tokenizer.save_pretrained`): `tokenizer_class` T5Tokenizer, `extra_ids` 100 and the
`<extra_id_*>` sentinels with their flags in `added_tokens_decoder`,
`model_max_length` 226, `special_tokens_map.json` and `added_tokens.json`. `io.json`
also holds two other configurations of the same model, written by the tests beside a copy
of `spiece.model`: the older Hub T5 files (plain strings, no `added_tokens_decoder`, an
`added_tokens.json` with one added token that is not special and one extra special token
that is not a piece), and a bare `tokenizer_config.json` (the class and length only).
For each: transformers' class, vocabulary size, added tokens with their flags, and the
ids and attention masks of `PROMPTS` with `padding="max_length", truncation=True`
(max_length 16 and 226 for CogVideoX's files, 16 for the others), and for CogVideoX's
files the backend's Unigram vocabulary with its scores.
"""

import io
import json
import os
import pathlib
import shutil
import tempfile

import google.protobuf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2
import tokenizers
import transformers
from transformers import AutoTokenizer

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizer" / "spm"

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
    "夜晚的城市街道上下着雨，霓虹灯在水面上闪烁。",
    "東京の夜景、雨が降っている。",
    "猫が窓辺で眠っている。",
    "서울의 밤거리에 비가 내린다.",
    "Un café au lait, s'il vous plaît — merci!",
    "L'été dernier, nous sommes allés à la plage.",
    "Die Straße ist nass; über der Stadt hängen Wolken.",
    "Größere Bäume wachsen im Süden.",
    "El niño juega en el jardín con su pequeño perro.",
    "¿Dónde está la estación? ¡Allí!",
    "Кошка спит на диване.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 2024 3.14 1,000,000",
    "Quotes \"like this\" and 'this' & ampersands <tags>.",
    "The quick brown fox jumps over the lazy dog.",
    "A slow motion shot of water droplets splashing 💧.",
    "Snow covers the mountains; a bird flies above ❄️.",
    "A child laughs and plays with a yellow kite 🪁😀.",
    "Fireworks explode over the river at midnight 🎆🎉.",
    "A robot walks through a futuristic city 🤖.",
    "Leaves fall from the trees in autumn 🍂.",
    "A chef cooks pasta in a busy kitchen 🍝.",
    "Waves crash against the rocks, foam everywhere 🌊.",
    "Low-angle view of a skyscraper, clouds passing.",
    "Bright, colorful, high quality, detailed video.",
    "Worst quality, blurry, static, overexposed.",
]

PROMPTS = [
    "A cat sits on the mat.",
    "",
    "   A   dog\truns\n across  the field.  ",
    "Un café au lait, s'il vous plaît — L'été à la plage, Größere Bäume, niño.",
    "一只猫坐在垫子上。 東京の夜景、서울의 밤 Кошка 龍",
    "Fireworks 🎆🎉 over the river, an unseen 🦩 and ❤️",
    "Numbers 2024, 3.14 and 42%! ① ½ Ⅻ x²",
    "ｆｕｌｌｗｉｄｔｈ ﬁne\u00a0space cafe\u0301 A\u030a e\u0308 zero\u200bwidth bell\x07 ＜scene＞",
    "a <extra_id_3> b<extra_id_0>c <extra_id_99>end",
    "An eos inside </s> the prompt <pad> and <unk>",
    "<video> <scene> ＜scene＞ scene <extra_id_100>",
    "Tab\tnew\nline\r\nCRLF\u3000ideographic\u2028separator",
    " ".join(CORPUS[:12]) * 2,  # over 226 tokens: truncated at both lengths
]
EXTRA_IDS = 100
MAX_LENGTHS = {"cogvideox": [16, 226], "t5_legacy": [16], "bare": [16]}


def _rule_sources() -> list[str]:
    """The strings whose `nmt_nfkc` normalization the fixture's table keeps."""
    cps = list(range(0x01, 0x20)) + list(range(0x7F, 0x100))
    for begin, end in [(0x2000, 0x2070), (0x2070, 0x20A0), (0x2100, 0x2190), (0x2460, 0x2500),
                       (0x3000, 0x3040), (0xFB00, 0xFB07), (0xFE00, 0xFE10), (0xFF00, 0xFFF0)]:
        cps += range(begin, end)
    sources = [chr(c) for c in cps]
    for base in "aeiouycnsAEIOUYCNS":
        for mark in (0x300, 0x301, 0x302, 0x303, 0x308, 0x30A, 0x30C, 0x327):
            sources.append(base + chr(mark))
    return sources


def rules_tsv() -> str:
    """SentencePiece's rule format: source and target code points (hex), tab-separated."""
    nmt = spm.SentencePieceNormalizer(rule_name="nmt_nfkc", add_dummy_prefix=False,
                                      escape_whitespaces=False, remove_extra_whitespaces=False)
    lines = []
    for source in _rule_sources():
        target = nmt.normalize(source)
        if target != source:
            lines.append(" ".join(f"{ord(c):X}" for c in source) + "\t"
                         + " ".join(f"{ord(c):X}" for c in target))
    return "\n".join(lines) + "\n"


def train(rules_path: str) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, model_type="unigram",
        vocab_size=300, hard_vocab_limit=False, character_coverage=1.0,
        normalization_rule_tsv=rules_path, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        byte_fallback=False, num_threads=1, max_sentencepiece_length=8,
        shuffle_input_sentence=False, minloglevel=2)
    # The trainer records the rules' path (a temporary one): record the rules' origin instead.
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    proto.normalizer_spec.name = "nmt_nfkc_subset"
    proto.normalizer_spec.ClearField("normalization_rule_tsv")
    return proto.SerializeToString()


def _flags(content: str, edge: bool = False) -> dict:
    return {"content": content, "lstrip": edge, "normalized": False, "rstrip": edge,
            "single_word": False, "special": True}


def cogvideox_files(n_pieces: int) -> dict:
    """CogVideoX's `tokenizer/` files (transformers 4's T5Tokenizer.save_pretrained)."""
    extras = [f"<extra_id_{i}>" for i in range(EXTRA_IDS)]
    ids = {f"<extra_id_{i}>": n_pieces + EXTRA_IDS - 1 - i for i in range(EXTRA_IDS)}
    decoder = {"0": _flags("<pad>"), "1": _flags("</s>"), "2": _flags("<unk>")}
    decoder.update({str(i): _flags(t, edge=True) for t, i in sorted(ids.items(), key=lambda x: x[1])})
    config = {"add_prefix_space": True, "added_tokens_decoder": decoder,
              "additional_special_tokens": extras, "clean_up_tokenization_spaces": True,
              "eos_token": "</s>", "extra_ids": EXTRA_IDS, "legacy": True,
              "model_max_length": 226, "pad_token": "<pad>", "sp_model_kwargs": {},
              "tokenizer_class": "T5Tokenizer", "unk_token": "<unk>"}
    plain = lambda t: {k: v for k, v in _flags(t).items() if k != "special"}  # noqa: E731
    special = {"additional_special_tokens": extras, "eos_token": plain("</s>"),
               "pad_token": plain("<pad>"), "unk_token": plain("<unk>")}
    return {"tokenizer_config.json": config, "special_tokens_map.json": special,
            "added_tokens.json": ids}


def legacy_files(n_pieces: int) -> dict:
    """The older Hub T5 files: strings only, an `added_tokens.json`."""
    extras = [f"<extra_id_{i}>" for i in range(EXTRA_IDS)] + ["<video>"]
    names = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {**names, "extra_ids": EXTRA_IDS, "additional_special_tokens": extras,
              "model_max_length": 226, "tokenizer_class": "T5Tokenizer"}
    added = {f"<extra_id_{i}>": n_pieces + EXTRA_IDS - 1 - i for i in range(EXTRA_IDS)}
    added["<scene>"] = n_pieces + EXTRA_IDS
    return {"tokenizer_config.json": config,
            "special_tokens_map.json": {**names, "additional_special_tokens": extras},
            "added_tokens.json": added}


def reference(folder: pathlib.Path, max_lengths: list[int], vocab: bool) -> dict:
    hf = AutoTokenizer.from_pretrained(str(folder))
    backend = json.loads(hf.backend_tokenizer.to_str())
    out = {"transformers_class": type(hf).__name__,
           "vocab_size": hf.backend_tokenizer.get_vocab_size(),
           "added_tokens": [[t["id"], t["content"], t["single_word"], t["lstrip"], t["rstrip"],
                             t["normalized"], t["special"]] for t in backend["added_tokens"]]}
    if vocab:
        out["unigram"] = {"unk_id": backend["model"]["unk_id"],
                          "byte_fallback": backend["model"]["byte_fallback"],
                          "vocab": backend["model"]["vocab"]}
    out["cases"] = []
    for max_length in max_lengths:
        enc = hf(PROMPTS, padding="max_length", max_length=max_length, truncation=True,
                 add_special_tokens=True, return_attention_mask=True)
        out["cases"].append({"max_length": max_length, "input_ids": enc["input_ids"],
                             "attention_mask": enc["attention_mask"]})
    return out


def write_files(folder: pathlib.Path, files: dict) -> None:
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        rules = os.path.join(tmp, "rules.tsv")
        pathlib.Path(rules).write_text(rules_tsv())
        model = train(rules)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    (OUT / "spiece.model").write_bytes(model)
    n_pieces = len(spm.SentencePieceProcessor(model_proto=model))
    write_files(OUT, cogvideox_files(n_pieces))
    variants = [{"name": "cogvideox", "files": None,
                 **reference(OUT, MAX_LENGTHS["cogvideox"], vocab=True)}]
    others = {"t5_legacy": legacy_files(n_pieces),
              "bare": {"tokenizer_config.json": {"tokenizer_class": "T5Tokenizer",
                                                 "model_max_length": 226}}}
    for name, files in others.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = pathlib.Path(tmp)
            shutil.copy(OUT / "spiece.model", folder / "spiece.model")
            write_files(folder, files)
            variants.append({"name": name, "files": files,
                             **reference(folder, MAX_LENGTHS[name], vocab=False)})
    data = {
        "versions": {"sentencepiece": spm.__version__, "protobuf": google.protobuf.__version__,
                     "tokenizers": tokenizers.__version__,
                     "transformers": transformers.__version__},
        "pieces": n_pieces,
        "prompts": PROMPTS,
        "variants": variants,
    }
    (OUT / "io.json").write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
    for f in sorted(os.listdir(OUT)):
        print(f, os.path.getsize(OUT / f))


if __name__ == "__main__":
    main()
