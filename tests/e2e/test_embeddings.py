"""The embeddings ensemble end to end: four processes, sentences of very different lengths, and
sentence-transformers computing the same sentences in-process as the oracle."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.tools.client import InferenceClient, bytes_batch
from services.minilm_files import package_model_dir

pytestmark = pytest.mark.e2e

# Belt and braces: the oracle and the services read only the installed package's files; nothing may reach
# the Hub. The services inherit this when the pipeline fixture starts them after collection.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_TEXT = (
    "the model serves every request through three stages and a router that batches them while the "
    "tokenizer pads short sentences and truncates long ones so the encoder sees one rectangle of ids"
)


def _words(count: int, seed: int) -> str:
    rng, words = random.Random(seed), _TEXT.split()
    return " ".join(rng.choice(words) for _ in range(count))


SENTENCES = [
    "Hello",
    "Embeddings!",
    "The quick brown fox jumps over the lazy dog.",
    "Der Straßenverkehr in München ist heute ungewöhnlich dicht.",
    "東京は日本の首都です。",
    "Привет, как у тебя дела сегодня?",
    "Crème brûlée, naïve café 😀 — ¿qué tal?",
    _words(12, 1),
    _words(40, 2),
    _words(90, 3),
    _words(150, 4),
    _words(200, 5),  # beyond the model's 256 tokens once [CLS] and [SEP] are added: truncated
]


@pytest.fixture(scope="module")
def oracle_embeddings() -> np.ndarray:
    """sentence-transformers on the same package's files, computed once for the module."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(package_model_dir()), device="cpu", local_files_only=True)
    return model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)


def embed(client: InferenceClient, texts: list[str]) -> np.ndarray:
    out = client.infer("embeddings", {"TEXT": bytes_batch([t.encode() for t in texts], (-1, 1))}, timeout=120)
    embedding = out["EMBEDDING"]
    assert embedding.shape == (len(texts), 384) and embedding.dtype == np.float32
    return embedding


def encoder_statistics(address: str) -> pb.ModelStatistics:
    """The router's counters for the encoder's batcher (Triton's `ModelStatistics`)."""
    with InferenceClient(address) as client:
        reply = client.stub.ModelStatistics(pb.ModelStatisticsRequest(name="minilm_encoder"), timeout=10)
    return reply.model_stats[0]


def cosines(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    return (ours * theirs).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))


def test_one_request_of_mixed_lengths_matches_sentence_transformers(pipeline, oracle_embeddings) -> None:
    with InferenceClient(pipeline.router.address) as client:
        ours = embed(client, SENTENCES)
    similarity = cosines(ours, oracle_embeddings)
    print(f"embeddings, one request: cosine to sentence-transformers {np.round(similarity, 6).tolist()}")
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    assert similarity.min() >= 0.999


def test_concurrent_requests_of_different_lengths_match_sentence_transformers(
    pipeline, oracle_embeddings
) -> None:
    # Each request mixes a different few sentences, so batches formed across requests need padding.
    rng = random.Random(0)
    requests = [rng.sample(range(len(SENTENCES)), rng.randint(1, 3)) for _ in range(24)]

    def run(indices: list[int]) -> tuple[list[int], np.ndarray]:
        with InferenceClient(pipeline.router.address) as client:
            return indices, embed(client, [SENTENCES[i] for i in indices])

    before = encoder_statistics(pipeline.router.address)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run, requests))
    after = encoder_statistics(pipeline.router.address)
    served = after.inference_stats.success.count - before.inference_stats.success.count
    executions = after.execution_count - before.execution_count
    print(f"embeddings: the router ran {served} encoder requests in {executions} batches")
    # Fewer batches than requests: requests of different lengths were padded into shared batches.
    assert served == len(requests) and executions < served
    worst = 1.0
    for indices, ours in results:
        similarity = cosines(ours, oracle_embeddings[indices])
        worst = min(worst, float(similarity.min()))
        assert similarity.min() >= 0.999, (indices, similarity)
    print(
        f"embeddings, {len(requests)} concurrent requests: lowest cosine to sentence-transformers {worst:.6f}"
    )


def test_invalid_utf8_is_named_by_its_index(pipeline) -> None:
    batch = [b"fine", b"caf\xe9", b"also fine"]
    with InferenceClient(pipeline.router.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.infer("embeddings", {"TEXT": bytes_batch(batch, (-1, 1))}, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "TEXT[1]" in info.value.details() and "UTF-8" in info.value.details()
        assert "embeddings_tokenize" in info.value.details()
        assert embed(client, ["still serving"]).shape == (1, 384)


def test_metadata_describes_the_ensemble(pipeline) -> None:
    with InferenceClient(pipeline.router.address) as client:
        meta = client.model_metadata("embeddings", timeout=10)
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("TEXT", "BYTES", [-1, 1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("EMBEDDING", "FP32", [-1, 384])]
