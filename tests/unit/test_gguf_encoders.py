"""Encoder models from llama.cpp's GGUF files (shared/gguf_encoder.py): tiny random BERT and
NomicBERT models, and the real all-MiniLM-L6-v2, written in llama.cpp's layout
(streamq/testing/tiny_encoders.write_gguf), built into a folder as the worker builds it, and
checked against sentence-transformers on the original folder: the tokens, and the embeddings."""
from __future__ import annotations

import pytest
import torch

from shared import gguf_encoder, tokenizer_files
from shared.gguf_convert import convert_gguf
from shared.pooling_model import UnsupportedEncoder, describe
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_encoders import build_encoder, minilm, write_gguf
from worker.model.encoders import Packed, load

st = pytest.importorskip("sentence_transformers")
CPU = torch.device("cpu")
TEXTS = ["hello world", "The Weather in PARIS is mild in the spring, and the rain comes in the autumn.", "x",
         "naïve café, résumé: Ünïcödé àccents", "tokenization of unbelievably long-winded words 12345",
         "中文 and ☃ and emoji 🙂 and tab\tnewline\n", "hello world"]


def from_gguf(gguf, root):
    """The tokenizer folder and the weights' folder of `gguf`, as the worker makes them."""
    tokenizer = root / "tokenizer"
    tokenizer_files.write_from_gguf(gguf, tokenizer)
    weights = root / "weights"
    convert_gguf(gguf, weights, tokenizer)
    return tokenizer, weights


def embed(tokenizer, weights, texts):
    tok = Tokenizer(tokenizer)
    encoder = load(weights, tok.pooling, CPU, torch.float32)
    ids = [tok.encode(t) for t in texts]
    return torch.stack(encoder.embed(Packed.of([(i, len(i)) for i in ids], CPU), [0] * len(ids)))


@pytest.mark.parametrize("family,pooling", [("bert", "mean"), ("bert", "cls"), ("nomic_bert", "mean"),
                                            ("nomic_bert", "lasttoken")])
def test_a_gguf_encoder_embeds_as_sentence_transformers_on_its_source(tmp_path, family, pooling):
    folder = build_encoder(tmp_path / "model", family, pooling=pooling)
    tokenizer, weights = from_gguf(write_gguf(folder, tmp_path / "m.gguf"), tmp_path)
    description = describe(tokenizer)
    assert (description.kind, description.modes, description.normalize) == ("embed", (pooling,), True)
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(embed(tokenizer, weights, TEXTS), reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "nomic_bert"])
def test_a_quantized_gguf_encoder_stays_within_a_cosine(tmp_path, family):
    folder = build_encoder(tmp_path / "model", family)
    tokenizer, weights = from_gguf(write_gguf(folder, tmp_path / "m.gguf", qtype="Q8_0"), tmp_path)
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = embed(tokenizer, weights, TEXTS)
    cosines = torch.nn.functional.cosine_similarity(got, reference)
    assert cosines.min() >= 0.999 and not torch.allclose(got, reference, atol=1e-6)


def test_all_minilm_l6_v2_from_a_gguf(tmp_path):
    tokenizer, weights = from_gguf(write_gguf(minilm(), tmp_path / "minilm.gguf"), tmp_path)
    reference = st.SentenceTransformer(str(minilm()), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(embed(tokenizer, weights, TEXTS), reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("keys", [True, False], ids=["normalizer keys", "an older file without them"])
def test_the_gguf_vocabulary_tokenizes_as_the_source_tokenizer(tmp_path, keys):
    tokenizer, _ = from_gguf(write_gguf(minilm(), tmp_path / "minilm.gguf", normalizer_keys=keys), tmp_path)
    ours, source = Tokenizer(tokenizer), Tokenizer(minilm())
    for text in TEXTS:
        assert ours.encode(text) == source.encode(text), text
        assert ours.decode(ours.encode(text)) == source.decode(source.encode(text))
    assert ours.pair_frame("a", "b") == source.pair_frame("a", "b")


def test_a_reranker_gguf_is_refused_at_start_naming_why(tmp_path):
    import gguf

    path = write_gguf(build_encoder(tmp_path / "model", "bert"), tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path, "r+")  # the pooling type rewritten in place: rank
    field = reader.fields["bert.pooling_type"]
    field.parts[field.data[0]][0] = int(gguf.PoolingType.RANK)
    del reader
    with pytest.raises(UnsupportedEncoder, match="rank"):
        tokenizer_files.write_from_gguf(path, tmp_path / "tokenizer")


def test_another_encoder_architecture_is_refused_naming_it(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "nomic-bert-moe")
    writer.add_causal_attention(False)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_encoder.is_encoder(tokenizer_files.gguf_metadata(tmp_path / "moe.gguf"))
    with pytest.raises(UnsupportedEncoder, match="'nomic-bert-moe' is no encoder served here"):
        tokenizer_files.write_from_gguf(tmp_path / "moe.gguf", tmp_path / "tokenizer")


def test_a_decoder_gguf_is_no_encoder(tiny_llama, tmp_path):
    from streamq.testing.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tiny_llama, tmp_path / "llama.gguf")
    assert not gguf_encoder.is_encoder(tokenizer_files.gguf_metadata(path))
