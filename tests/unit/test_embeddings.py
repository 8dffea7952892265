"""The embeddings stages in-process: tokenising, the MiniLM encoder and pooling, against sentence-transformers."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from pipeline.protocol.errors import InvalidInput, RepositoryError
from pipeline.protocol.model_config import tensor_specs
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.api import Stage
from services.minilm_files import package_model_dir
from services.model.backend import ModelBackend
from tests.stages import example_stage

#: The example repository's `embeddings_pool`, loaded through the python backend.
POOL = example_stage("embeddings_pool")
mean_pool_normalize = sys.modules[type(POOL).__module__].mean_pool_normalize

CLS, SEP = 101, 102

SENTENCES = [
    "Hello.",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé naïve café in 東京, with an emoji 😀 and Ελληνικά.",
    "",
    " ".join(f"word{i} and some more text" for i in range(120)),  # far beyond 256 tokens
]


def text_batch(texts: list[str | bytes]) -> np.ndarray:
    return np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=np.object_)


@pytest.fixture(scope="module")
def tokenizer() -> Stage:
    return example_stage("embeddings_tokenize")


@pytest.fixture(scope="module")
def encoder_version(tmp_path_factory: pytest.TempPathFactory):
    """The encoder as `make model` writes it (a torch.export program), prepared as the model service does."""
    from examples.models.build import build

    root = tmp_path_factory.mktemp("repository")
    build(root, ["minilm_encoder"], progress=False, report=lambda _: None)
    # The thread count is process-wide: keep the one the other tests run with.
    backend = ModelBackend(Runners(device="cpu", torch_threads=torch.get_num_threads()))
    return backend.prepare(ModelRepository(root).read("minilm_encoder"), "1")


@pytest.fixture(scope="module")
def encoder(encoder_version):
    (instance,) = encoder_version.instances
    instance.load()
    yield instance
    instance.unload()


@pytest.fixture(scope="module")
def encoder_config(encoder_version):
    return encoder_version.config


@pytest.fixture(scope="module")
def oracle():
    """sentence-transformers on the same package's files: a local folder, never the Hub."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(package_model_dir()), device="cpu", local_files_only=True)


def embed(tokenizer: Stage, encoder, texts: list[str]) -> np.ndarray:
    tokens = tokenizer.infer({"TEXT": text_batch(texts)})
    hidden = encoder.run(tokens)["TOKEN_EMBEDDINGS"]
    return POOL.infer({"TOKEN_EMBEDDINGS": hidden, "ATTENTION_MASK": tokens["ATTENTION_MASK"]})["EMBEDDING"]


# ----------------------------------------------------------------------------------------------------------
# embeddings_tokenize


def test_token_ids_are_sentence_transformers_ones(tokenizer, oracle) -> None:
    out = tokenizer.infer({"TEXT": text_batch(SENTENCES)})
    # sentence-transformers 6 renamed `tokenize` to `preprocess`; either is the tokenisation it encodes with.
    expected = (getattr(oracle, "preprocess", None) or oracle.tokenize)(SENTENCES)
    np.testing.assert_array_equal(out["INPUT_IDS"], expected["input_ids"].numpy())
    np.testing.assert_array_equal(out["ATTENTION_MASK"], expected["attention_mask"].numpy())


def test_pads_to_the_longest_sentence_of_the_call_with_zeros(tokenizer) -> None:
    out = tokenizer.infer({"TEXT": text_batch(["a b c d e f", "a"])})
    ids, mask = out["INPUT_IDS"], out["ATTENTION_MASK"]
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.shape == mask.shape == (2, 8)
    assert mask.sum(axis=1).tolist() == [8, 3]
    assert ids[1].tolist()[:3] == [CLS, ids[1, 1], SEP] and ids[1, 3:].tolist() == [0] * 5
    assert mask[1, 3:].tolist() == [0] * 5


def test_truncates_at_the_models_max_seq_length(tokenizer) -> None:
    assert tokenizer.max_tokens == 256  # sentence_bert_config.json, not tokenizer.json's 128
    out = tokenizer.infer({"TEXT": text_batch(["word " * 1000])})
    assert out["INPUT_IDS"].shape == (1, 256)
    assert out["INPUT_IDS"][0, 0] == CLS and out["INPUT_IDS"][0, -1] == SEP
    assert out["ATTENTION_MASK"].all()


def test_empty_string_is_cls_sep(tokenizer) -> None:
    out = tokenizer.infer({"TEXT": text_batch([""])})
    assert out["INPUT_IDS"].tolist() == [[CLS, SEP]]
    assert out["ATTENTION_MASK"].tolist() == [[1, 1]]


def test_invalid_utf8_is_named_by_its_index(tokenizer) -> None:
    with pytest.raises(InvalidInput) as info:
        tokenizer.infer({"TEXT": text_batch(["fine", "also fine", b"caf\xe9 au lait"])})
    assert info.value.message.startswith("TEXT[2]: not valid UTF-8")
    assert "byte 3" in info.value.message


def test_every_bad_sentence_of_a_batch_is_named(tokenizer) -> None:
    with pytest.raises(InvalidInput) as info:
        tokenizer.infer({"TEXT": text_batch([b"\xff", "fine", b"caf\xe9"])})
    assert [(item.field, item.description.split(":")[0]) for item in info.value.items] == [
        ("TEXT[0]", "not valid UTF-8"),
        ("TEXT[2]", "not valid UTF-8"),
    ]


def test_text_over_the_byte_limit_is_refused() -> None:
    stage = example_stage("embeddings_tokenize", max_text_bytes=10)
    assert stage.infer({"TEXT": text_batch(["0123456789"])})["INPUT_IDS"].shape[0] == 1
    with pytest.raises(InvalidInput, match=r"TEXT\[1\]: text too long: 11 bytes, the limit is 10"):
        stage.infer({"TEXT": text_batch(["ok", "01234567890"])})


def test_bad_parameters_refuse_the_model_naming_them() -> None:
    with pytest.raises(
        RepositoryError, match=r"model\.py: .*parameter max_text_bytes must be an integer >= 1"
    ):
        example_stage("embeddings_tokenize", max_text_bytes=0)
    with pytest.raises(RepositoryError, match=r"model\.py: .*parameter max_tokens must be an integer >= 2"):
        example_stage("embeddings_tokenize", max_tokens=1)


def test_max_tokens_truncates(tokenizer) -> None:
    stage = example_stage("embeddings_tokenize", max_tokens=4)
    out = stage.infer({"TEXT": text_batch(["one two three four five six"])})
    assert out["INPUT_IDS"].shape == (1, 4) and out["INPUT_IDS"][0, -1] == SEP


# ----------------------------------------------------------------------------------------------------------
# embeddings_pool


def test_pooling_averages_only_unmasked_tokens() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(3, 6, 384)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=np.int64)
    out = POOL.infer({"TOKEN_EMBEDDINGS": tokens, "ATTENTION_MASK": mask})["EMBEDDING"]
    assert out.shape == (3, 384) and out.dtype == np.float32
    for row, length in enumerate(mask.sum(axis=1)):
        mean = tokens[row, :length].astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(out[row], mean / np.linalg.norm(mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-6)


def test_pooling_ignores_extra_padding_whatever_it_holds() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.normal(size=(2, 4, 384)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.int64)
    base = mean_pool_normalize(tokens, mask)
    padded_tokens = np.concatenate([tokens, np.zeros((2, 5, 384), np.float32)], axis=1)
    padded_tokens[1, 2:] = np.nan  # padded positions may hold anything
    padded_mask = np.concatenate([mask, np.zeros((2, 5), np.int64)], axis=1)
    out = POOL.infer({"TOKEN_EMBEDDINGS": padded_tokens, "ATTENTION_MASK": padded_mask})
    np.testing.assert_allclose(out["EMBEDDING"], base, rtol=1e-6, atol=1e-7)


def test_all_zero_mask_gives_the_zero_vector_not_nan() -> None:
    tokens = np.ones((2, 3, 384), np.float32)
    mask = np.array([[0, 0, 0], [1, 1, 0]], dtype=np.int64)
    out = POOL.infer({"TOKEN_EMBEDDINGS": tokens, "ATTENTION_MASK": mask})["EMBEDDING"]
    assert np.isfinite(out).all()
    assert not out[0].any()
    np.testing.assert_allclose(np.linalg.norm(out[1]), 1.0, rtol=1e-6)


def test_pooling_refuses_disagreeing_shapes_and_non_finite_tokens() -> None:
    stage = POOL
    with pytest.raises(InvalidInput, match="must agree"):
        stage.infer(
            {"TOKEN_EMBEDDINGS": np.zeros((2, 3, 384), np.float32), "ATTENTION_MASK": np.ones((2, 4))}
        )
    tokens = np.zeros((3, 2, 384), np.float32)
    tokens[1, 0, 5] = np.inf
    with pytest.raises(InvalidInput, match=r"TOKEN_EMBEDDINGS\[1\]"):
        stage.infer({"TOKEN_EMBEDDINGS": tokens, "ATTENTION_MASK": np.ones((3, 2), np.int64)})


def test_pooling_declares_padded_inputs() -> None:
    stage = POOL
    assert [(s.name, s.shape, s.pad_value) for s in stage.inputs] == [
        ("TOKEN_EMBEDDINGS", (-1, -1, 384), 0.0),
        ("ATTENTION_MASK", (-1, -1), 0),
    ]
    assert stage.outputs[0].shape == (-1, 384)


# ----------------------------------------------------------------------------------------------------------
# minilm_encoder and the chain


def test_chain_matches_sentence_transformers(tokenizer, encoder, oracle) -> None:
    ours = embed(tokenizer, encoder, SENTENCES)
    theirs = oracle.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)
    cosines = (ours * theirs).sum(axis=1) / np.linalg.norm(theirs, axis=1)
    print(f"cosine similarity to sentence-transformers: {np.round(cosines, 6).tolist()}")
    assert cosines.min() >= 0.999


def test_encoder_output_is_unchanged_by_extra_padding(tokenizer, encoder) -> None:
    tokens = tokenizer.infer(
        {"TEXT": text_batch(["A short sentence.", "Another, slightly longer one here."])}
    )
    ids, mask = tokens["INPUT_IDS"], tokens["ATTENTION_MASK"]
    base = encoder.run(tokens)["TOKEN_EMBEDDINGS"]
    assert base.shape == (*ids.shape, 384) and base.dtype == np.float32
    extra = 37
    padded = {
        "INPUT_IDS": np.pad(ids, ((0, 0), (0, extra))),
        "ATTENTION_MASK": np.pad(mask, ((0, 0), (0, extra))),
    }
    out = encoder.run(padded)["TOKEN_EMBEDDINGS"]
    assert out.shape == (2, ids.shape[1] + extra, 384)
    np.testing.assert_allclose(out[:, : ids.shape[1]], base, atol=1e-4)
    assert not out[:, ids.shape[1] :].any()  # padded positions come out as 0
    assert not base[mask == 0].any()
    pooled = mean_pool_normalize(out, padded["ATTENTION_MASK"])
    np.testing.assert_allclose(pooled, mean_pool_normalize(base, mask), atol=1e-5)


def test_encoder_refuses_what_the_program_cannot_take(encoder) -> None:
    ids = np.array([[CLS, 2000, SEP], [CLS, 2001, SEP]], dtype=np.int64)
    mask = np.ones_like(ids)
    with pytest.raises(InvalidInput, match="ATTENTION_MASK: dimension 1 is 2, INPUT_IDS's is 3"):
        encoder.run({"INPUT_IDS": ids, "ATTENTION_MASK": mask[:, :2]})
    with pytest.raises(InvalidInput, match="the model cannot take these inputs: index out of range"):
        encoder.run({"INPUT_IDS": np.array([[CLS, 30522, SEP]]), "ATTENTION_MASK": np.ones((1, 3), np.int64)})
    with pytest.raises(InvalidInput, match=r"dimension 1 is 513, the model takes 1..512"):
        long = np.zeros((1, 513), np.int64)
        encoder.run({"INPUT_IDS": long, "ATTENTION_MASK": long})


def test_encoder_declares_padded_tensors(encoder_config) -> None:
    inputs, outputs = tensor_specs(encoder_config)
    assert [(s.name, s.shape, s.pad_value) for s in inputs] == [
        ("INPUT_IDS", (-1, -1), 0),
        ("ATTENTION_MASK", (-1, -1), 0),
    ]
    assert [(s.name, s.shape, s.pad_value) for s in outputs] == [("TOKEN_EMBEDDINGS", (-1, -1, 384), 0.0)]
    assert (encoder_config.platform, encoder_config.backend) == ("pytorch_torch_export", "pytorch")
