"""The textgen example: its tokenizer and detokenizer served by the python backend, the GRU's training, and
the decoupled generating model driven through Triton's Python-backend API (a response sender per request)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.models.textgen import CharGRU, encode, script, train
from pipeline.protocol.errors import InvalidInput
from pipeline.protocol.model_config import read_config
from pipeline.runtime.repository import ModelRepository
from pipeline.stage import triton_python_backend_utils as pb_utils
from pipeline.stage.model_file import import_model_file
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.triton_model import triton_json
from tests.stages import EXAMPLE_REPOSITORY

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _served(name: str):
    """An instance of an example model, loaded by the python backend as the stage service loads it."""
    entry = ModelRepository(EXAMPLE_REPOSITORY).read(name)
    instance = PythonBackend().prepare(entry, entry.served_versions()[-1]).instances[0]
    instance.load()
    return instance


def _prompts(*texts: bytes) -> np.ndarray:
    array = np.empty((len(texts), 1), dtype=np.object_)
    array[:, 0] = list(texts)
    return array


@pytest.fixture(scope="module")
def tokenize():
    instance = _served("textgen_tokenize")
    yield instance
    instance.unload()


@pytest.fixture(scope="module")
def detokenize():
    instance = _served("textgen_detokenize")
    yield instance
    instance.unload()


def test_tokenize_gives_ascii_codes_padded_to_the_longest_prompt(tokenize):
    ids = tokenize.run({"PROMPT": _prompts(b"To be", b"or", b"")})["PROMPT_IDS"]
    assert ids.dtype == np.int64
    assert ids.tolist() == [[84, 111, 32, 98, 101], [111, 114, 0, 0, 0], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("café".encode(), "PROMPT[1]: byte 0xc3 at 3 is not ASCII text"),
        (b"a\0b", "PROMPT[1]: byte 0x00 at 1 is not ASCII text"),
        (b"x" * 4097, "PROMPT[1]: 4097 bytes, the limit is 4096"),
    ],
)
def test_tokenize_refuses_what_is_not_short_ascii_text(tokenize, prompt, message):
    with pytest.raises(InvalidInput, match=message.replace("[", r"\[").replace("]", r"\]")):
        tokenize.run({"PROMPT": _prompts(b"fine", prompt)})


def test_detokenize_gives_one_string_per_row_and_drops_padding(detokenize):
    tokens = np.array([[72], [0], [105], [10]], dtype=np.int64)
    text = detokenize.run({"TOKEN": tokens})["TEXT"]
    assert text.shape == (4, 1)
    assert text[:, 0].tolist() == [b"H", b"", b"i", b"\n"]


def test_detokenize_refuses_ids_that_are_not_ascii(detokenize):
    with pytest.raises(InvalidInput, match=r"TOKEN\[1, 0\]: id 128 is not an ASCII code"):
        detokenize.run({"TOKEN": np.array([[65], [128]], dtype=np.int64)})


def test_tokenize_then_detokenize_gives_the_text_back(tokenize, detokenize):
    text = b"Shall I compare thee to a summer's day?\n"
    ids = tokenize.run({"PROMPT": _prompts(text)})["PROMPT_IDS"]
    chars = detokenize.run({"TOKEN": ids.reshape(-1, 1)})["TEXT"][:, 0]
    assert b"".join(chars) == text


def test_training_is_deterministic_and_learns():
    first, report = train(steps=30, seed=3, progress=False)
    second, _ = train(steps=30, seed=3, progress=False)
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # Uniform guessing over 128 ids costs ln(128) = 4.85 nats per character.
    assert report.last_loss < report.first_loss < 4.9
    assert report.steps == 30 and report.seconds > 0


def test_encode_takes_ascii_only():
    assert encode("Ab\n").tolist() == [65, 98, 10]
    with pytest.raises(ValueError, match="NUL"):
        encode("a\0")
    with pytest.raises(UnicodeEncodeError):
        encode("é")


class Sender:
    """A response sender as Triton's Python backend hands one out: it records what the model sends, and
    says the request is cancelled once `cancel` is set."""

    def __init__(self) -> None:
        self.responses: list[pb_utils.InferenceResponse | None] = []
        self.flags: list[int] = []
        self.done = threading.Event()
        self.cancel = threading.Event()
        self.sent_after_final = 0

    def send(self, response=None, flags: int = 0) -> None:
        if self.done.is_set():
            self.sent_after_final += 1
            return
        self.responses.append(response)
        self.flags.append(flags)
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancel.is_set()

    def tokens(self) -> list[list[int]]:
        return [
            r.output_tensors()[0].as_numpy().reshape(-1).tolist()
            for r in self.responses
            if r is not None and not r.has_error()
        ]


class StreamRequest(pb_utils.InferenceRequest):
    """A request of a decoupled model, with its sender."""

    def __init__(self, sender: Sender, prompt_ids: np.ndarray, max_tokens: list[int]) -> None:
        super().__init__(
            inputs=[
                pb_utils.Tensor("PROMPT_IDS", prompt_ids),
                pb_utils.Tensor("MAX_TOKENS", np.array(max_tokens, dtype=np.int32).reshape(-1, 1)),
            ]
        )
        self.sender = sender

    def get_response_sender(self) -> Sender:
        return self.sender


@pytest.fixture(scope="module")
def generator_repository(tmp_path_factory) -> Path:
    """The example's generating model with a network trained for a few steps (fast; the text is noise)."""
    root = tmp_path_factory.mktemp("textgen")
    shutil.copytree(
        EXAMPLE_REPOSITORY / "textgen_generate",
        root / "textgen_generate",
        ignore=shutil.ignore_patterns("model.pt", "__pycache__"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        script(CharGRU()).save(str(root / "textgen_generate" / "1" / "model.pt"))
    return root


def _generator(repository: Path, **parameters: str):
    folder = repository / "textgen_generate"
    config = read_config(folder / "config.pbtxt")
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    module = import_model_file(folder / "1" / "model.py", "textgen_generate", "1")
    model = module.TritonPythonModel()
    model.initialize(
        {
            "model_config": json.dumps(triton_json(config)),
            "model_instance_kind": "CPU",
            "model_instance_name": "textgen_generate_0_0",
            "model_instance_device_id": "0",
            "model_repository": str(folder),
            "model_version": "1",
            "model_name": "textgen_generate",
        }
    )
    return model


@pytest.fixture
def generator(generator_repository):
    model = _generator(generator_repository)
    yield model
    model.finalize()


def _ids(*texts: str) -> np.ndarray:
    width = max(len(t) for t in texts)
    return np.array([list(t.encode()) + [0] * (width - len(t)) for t in texts], dtype=np.int64)


def test_each_token_is_a_response_and_the_last_is_final(generator):
    sender = Sender()
    assert generator.execute([StreamRequest(sender, _ids("To be"), [12])]) is None
    assert sender.done.wait(30)
    assert sender.flags == [0] * 11 + [FINAL]
    tokens = sender.tokens()
    assert len(tokens) == 12 and all(len(t) == 1 and 0 < t[0] < 128 for t in tokens)


def test_streams_generate_side_by_side(generator):
    senders = [Sender() for _ in range(4)]
    generator.execute([StreamRequest(s, _ids("Four score"), [5 + 3 * i]) for i, s in enumerate(senders)])
    late = Sender()
    generator.execute([StreamRequest(late, _ids(""), [7])])
    for sender in [*senders, late]:
        assert sender.done.wait(30)
    assert [len(s.tokens()) for s in senders] == [5, 8, 11, 14]
    assert len(late.tokens()) == 7
    assert all(s.sent_after_final == 0 for s in [*senders, late])


def test_rows_of_a_request_stop_at_their_own_max_tokens(generator):
    sender = Sender()
    generator.execute([StreamRequest(sender, _ids("a", "long prompt"), [2, 4])])
    assert sender.done.wait(30)
    tokens = sender.tokens()
    assert len(tokens) == 4 and sender.flags[-1] == FINAL
    assert [t[1] != 0 for t in tokens] == [True] * 4
    assert [t[0] != 0 for t in tokens] == [True, True, False, False]  # 0: no character


def test_greedy_decoding_repeats_itself(generator_repository):
    model = _generator(generator_repository, temperature="0")
    try:
        first, second = Sender(), Sender()
        model.execute([StreamRequest(first, _ids("When in"), [20])])
        assert first.done.wait(30)
        model.execute([StreamRequest(second, _ids("When in"), [20])])
        assert second.done.wait(30)
        assert first.tokens() == second.tokens()
    finally:
        model.finalize()


class CancellingSender(Sender):
    """Cancelled by its client once it has received `after` responses."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def send(self, response=None, flags: int = 0) -> None:
        super().send(response, flags)
        if len(self.responses) == self.after:
            self.cancel.set()


def test_a_cancelled_stream_ends_with_the_final_flag_and_nothing_more(generator):
    cancelled, other = CancellingSender(after=3), Sender()
    generator.execute(
        [StreamRequest(cancelled, _ids("The"), [1000]), StreamRequest(other, _ids("The"), [30])]
    )
    assert cancelled.done.wait(30) and other.done.wait(30)
    assert len(cancelled.tokens()) == 3
    assert cancelled.responses[-1] is None and cancelled.flags[-1] == FINAL
    assert len(other.tokens()) == 30


@pytest.mark.parametrize(
    ("max_tokens", "message"), [([0], "MAX_TOKENS must be 1..1024"), ([1025], "MAX_TOKENS must be 1..1024")]
)
def test_a_bad_request_gets_one_final_error_response(generator, max_tokens, message):
    sender = Sender()
    generator.execute([StreamRequest(sender, _ids("x"), max_tokens)])
    assert sender.done.is_set()  # answered within execute
    (response,) = sender.responses
    assert response.has_error() and message in response.error().message()
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG


class GatedSender(Sender):
    """Holds the generation thread inside its second `send` until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def send(self, response=None, flags: int = 0) -> None:
        super().send(response, flags)
        if len(self.responses) == 2:
            self.entered.set()
            assert self.release.wait(30)


def test_unloading_ends_the_streams_still_generating(generator_repository):
    model = _generator(generator_repository)
    sender = GatedSender()
    model.execute([StreamRequest(sender, _ids("x"), [1000])])
    assert sender.entered.wait(30)
    finalizer = threading.Thread(target=model.finalize)
    finalizer.start()
    with model._wake:  # finalize has asked the generation thread to stop
        assert model._wake.wait_for(lambda: model._stopping, timeout=30)
    sender.release.set()
    finalizer.join(30)
    assert not finalizer.is_alive() and not model._thread.is_alive()
    assert len(sender.tokens()) == 2 and sender.flags[-1] == FINAL
    assert sender.responses[-1].error().code() == pb_utils.TritonError.UNAVAILABLE
