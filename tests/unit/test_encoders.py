"""Encoder models (worker/model/encoders.py) against sentence-transformers on the same weights:
tiny random BERT, RoBERTa, XLM-RoBERTa and MPNet models written by sentence-transformers itself,
and the real all-MiniLM-L6-v2. Inputs of different lengths are packed into one forward (no
padding), so equality also shows that no input sees another."""
from __future__ import annotations

import pytest
import torch

from shared.pooling_model import UnsupportedEncoder, describe
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_encoders import CROSS_FAMILIES, FAMILIES, build_cross_encoder, build_encoder, minilm
from worker.model.encoders import Packed, load

st = pytest.importorskip("sentence_transformers")
CPU = torch.device("cpu")
TEXTS = ["hello world", "the weather in Paris is mild in the spring, and the rain comes in the autumn", "x",
         "hello world", "A third text, of another length entirely."]
PAIRS = [("what is the capital of France?", "Paris is the capital of France."),
         ("what is the capital of France?", "Bananas are yellow."),
         ("how tall is a giraffe", "A giraffe stands up to six metres tall, the tallest of animals on land.")]


def ours(folder, texts, prompt: str = ""):
    description = describe(folder)
    encoder = load(folder, description, CPU, torch.float32)
    tok = Tokenizer(folder)
    ids = [tok.encode(prompt + t) for t in texts]
    skip = tok.prompt_length(prompt) if prompt and not description.include_prompt else 0
    return torch.stack(encoder.embed(Packed.of([(i, len(i)) for i in ids], CPU), [skip] * len(ids)))


def ours_pairs(folder, pairs):
    description = describe(folder)
    encoder = load(folder, description, CPU, torch.float32)
    tok = Tokenizer(folder)
    inputs = []
    for query, doc in pairs:
        head, after = tok.pair_frame(query, doc)
        inputs.append((head + tok.encode(doc, add_special_tokens=False) + after, len(head)))
    return torch.stack(encoder.classify(Packed.of(inputs, CPU)))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_embeds_as_sentence_transformers_does(tmp_path, family):
    folder = build_encoder(tmp_path, family, pooling="mean", dense=[(16, "Tanh")], normalize=True)
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = ours(folder, TEXTS)
    assert got.shape == (len(TEXTS), 16)
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got[0], got[1], atol=1e-3)  # the texts give different vectors


@pytest.mark.parametrize("pooling", ["cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken",
                                     ["cls", "mean"]])
def test_every_pooling_mode_as_sentence_transformers(tmp_path, pooling):
    folder = build_encoder(tmp_path, "bert", pooling=pooling, normalize=False)
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(ours(folder, TEXTS), reference, atol=2e-5, rtol=1e-4)


def test_a_prompt_left_out_of_pooling_as_sentence_transformers(tmp_path):
    folder = build_encoder(tmp_path, "bert", prompts={"query": "query: ", "document": "passage: "},
                           include_prompt=False)
    model = st.SentenceTransformer(str(folder), device="cpu")
    reference = model.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
    got = ours(folder, TEXTS, prompt="query: ")
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)
    assert describe(folder).prompts == {"query": "query: ", "document": "passage: "}


def test_all_minilm_l6_v2_as_sentence_transformers():
    folder = minilm()
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = ours(folder, TEXTS)
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)
    assert describe(folder).max_seq_length == 256 and Tokenizer(folder).context_length == 256


@pytest.mark.parametrize("family", CROSS_FAMILIES)
def test_each_cross_encoder_scores_as_sentence_transformers(tmp_path, family):
    folder = build_cross_encoder(tmp_path, family)
    reference = torch.as_tensor(st.CrossEncoder(str(folder), device="cpu").predict(PAIRS))
    got = ours_pairs(folder, PAIRS)
    assert describe(folder).activation == "sigmoid"
    torch.testing.assert_close(got.flatten(), reference.float(), atol=2e-5, rtol=1e-4)


def test_the_pair_frame_is_the_tokenizers_own():
    from transformers import AutoTokenizer

    tok, hf = Tokenizer(minilm()), AutoTokenizer.from_pretrained(minilm())
    for query, doc in PAIRS:
        head, after = tok.pair_frame(query, doc)
        assert head + tok.encode(doc, add_special_tokens=False) + after == hf(query, doc)["input_ids"]


def test_a_tokenizer_json_that_pads_gives_an_inputs_own_tokens():
    # all-MiniLM's tokenizer.json pads every encoding to 128 tokens
    tok = Tokenizer(minilm())
    assert tok.encode("hello world") == [101, 7592, 2088, 102]


def test_a_module_the_worker_does_not_run_is_named(tmp_path):
    folder = build_encoder(tmp_path, "bert")
    modules = (folder / "modules.json").read_text().replace("normalize.Normalize", "layer_norm.LayerNorm")
    (folder / "modules.json").write_text(modules)
    with pytest.raises(UnsupportedEncoder, match="LayerNorm"):
        describe(folder)


def test_a_decoder_is_no_encoder(tiny_llama):
    assert describe(tiny_llama) is None and Tokenizer(tiny_llama).pooling is None


def test_bf16_matmuls_the_cpu_default_stay_within_a_cosine_of_fp32():
    """dtype auto on a CPU with fast bf16: fp32 weights, bf16 matmuls (autocast). Run here on any
    CPU (autocast computes bf16 on every x86 CPU, slowly where it lacks the instructions)."""
    folder = minilm()
    reference = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    encoder = load(folder, describe(folder), CPU, torch.float32, torch.bfloat16)
    tok = Tokenizer(folder)
    ids = [tok.encode(t) for t in TEXTS]
    got = torch.stack(encoder.embed(Packed.of([(i, len(i)) for i in ids], CPU), [0] * len(ids)))
    assert got.dtype == torch.float32 and encoder.numerics == "float32, bfloat16 matmuls"
    cosines = torch.nn.functional.cosine_similarity(got, reference)
    assert cosines.min() >= 0.9999 and not torch.equal(got, reference)
