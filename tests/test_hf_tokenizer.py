"""``--tokenizer-type HuggingFaceTokenizer``: a local byte-level BPE ``tokenizer.json`` in
preprocessing and in the training checks (exact: token ids are integers)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")

from data_helpers import tiny_corpus, tiny_tokenizer, write_jsonl  # noqa: E402
from hf_helpers import BOS, EOS, HARD_TEXTS, byte_bpe_tokenizer  # noqa: E402
from tokenizers import Tokenizer as RustTokenizer  # noqa: E402

from data.hf_tokenizer import HFTokenizer  # noqa: E402
from data.indexed_dataset import IndexedDataset  # noqa: E402
from data.preprocess import main as preprocess_main  # noqa: E402
from data.preprocess import preprocess  # noqa: E402
from data.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import ConfigError, validate  # noqa: E402


def _texts(tmp_path):
    corpus = tiny_corpus(tmp_path, max_bytes=60_000)
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hftok")
    texts = _texts(d)
    return (byte_bpe_tokenizer(d / "llama3", texts + HARD_TEXTS, bos=True),
            byte_bpe_tokenizer(d / "qwen", texts + HARD_TEXTS, bos=False), texts)


def test_the_hard_corpus_is_what_the_issue_names():
    assert "" in HARD_TEXTS and max(map(len, HARD_TEXTS)) >= 50_000
    joined = "".join(HARD_TEXTS)
    assert "😀" in joined and "汉" in joined and "\u0301" in joined


@pytest.mark.parametrize("bos", [True, False])
def test_preprocess_ids_are_tokenizers_own_encode_at_any_worker_count(tmp_path, hf_dirs, bos):
    llama, qwen, texts = hf_dirs
    tok_dir = llama if bos else qwen
    docs = HARD_TEXTS + texts[:20]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    rust = RustTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = rust.token_to_id(EOS)
    want = [rust.encode(t).ids + [eos] for t in docs if t.strip()]
    blobs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        preprocess(str(src), out, tok_dir, workers=workers, append_eod=True, chunk_documents=7,
                   cache_dir=str(tmp_path / "cache"), progress=False,
                   tokenizer_type="HuggingFaceTokenizer")
        ds = IndexedDataset(f"{out}_text_document")
        assert [ds[i].tolist() for i in range(len(ds))] == want
        blobs.append([(tmp_path / f"w{workers}_text_document{e}").read_bytes()
                      for e in (".bin", ".idx")])
    assert blobs[0] == blobs[1]
    # BOS comes from the tokenizer's own post-processor; --append-eod adds the EOS and no BOS
    assert all((ids[0] == rust.token_to_id(BOS)) == bos and ids.count(eos) == 1 + (
        EOS in t) for ids, t in zip(want, [t for t in docs if t.strip()], strict=True))


def test_encode_decode_and_special_ids(hf_dirs):
    llama, qwen, _ = hf_dirs
    tok = load_tokenizer(llama)  # a directory: HuggingFaceTokenizer
    assert isinstance(tok, HFTokenizer) and tok.adds_bos and tok.kind == "HuggingFaceTokenizer"
    assert tok.eod == tok.piece_to_id(EOS) and tok.bos == tok.piece_to_id(BOS)
    for text in HARD_TEXTS:  # byte-level BPE gives every string back; BOS/EOS are dropped
        if EOS not in text:
            assert tok.decode(tok.encode([text])[0] + [tok.eod]) == text
    # as in tokenizers (and Megatron-LM's HuggingFaceTokenizer), a spelled-out special token is
    # that token, and decoding drops it
    assert tok.encode([EOS + " x"])[0][:2] == [tok.bos, tok.eod]
    plain = load_tokenizer(qwen / "tokenizer.json", "HuggingFaceTokenizer")
    assert not plain.adds_bos and plain.bos == -1
    assert tok.vocab_size == plain.vocab_size == 400


def test_tokenizer_type_errors_name_the_value(tmp_path, hf_dirs):
    llama, _, _ = hf_dirs
    with pytest.raises(ValueError, match="is a directory.*HuggingFaceTokenizer"):
        load_tokenizer(llama, "SentencePieceTokenizer")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path, "HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type TikTokenizer: valid"):
        load_tokenizer(llama, "TikTokenizer")
    sp = tiny_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(sp), Tokenizer) and not load_tokenizer(sp).adds_bos
    src = write_jsonl(tmp_path / "c.jsonl", ["a b"])
    with pytest.raises(SystemExit):
        preprocess_main(["--input", str(src), "--tokenizer-model", str(llama), "--output-prefix",
                         str(tmp_path / "o"), "--tokenizer-type", "Tiktoken", "--no-progress"])


def test_training_checks_take_the_hf_vocabulary(tmp_path, hf_dirs):
    llama, _, _ = hf_dirs
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(llama)]
    assert validate(parse_config(base), world_size=1).gpt.vocab_size == 400
    # a Hugging Face model may have more rows than tokens (Qwen), never fewer
    assert validate(parse_config(base + ["--vocab-size", "512"]), 1).gpt.vocab_size == 512
    with pytest.raises(ConfigError, match="--vocab-size 300 does not match .* 400"):
        validate(parse_config(base + ["--vocab-size", "300"]), world_size=1)
    with pytest.raises(ConfigError, match="needs a .model file"):
        validate(parse_config(base[:-3] + ["SentencePieceTokenizer", "--tokenizer-model",
                                           str(llama)]), world_size=1)
