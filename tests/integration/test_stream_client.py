"""`pipeline infer --stream` and `InferenceClient.stream` against a server that streams as Triton does for a
decoupled model (`tests.streaming.Writer`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.protocol.codec import request_tensors
from pipeline.tools.client import InferenceClient, StreamError, bytes_batch
from tests.streaming import Writer, serving_writer


@pytest.fixture
def writer() -> Iterator[tuple[Writer, str]]:
    with serving_writer() as running:
        yield running


def _inputs(prompt: bytes, count: int) -> dict[str, np.ndarray]:
    return {"PROMPT": bytes_batch([prompt], (-1, 1)), "COUNT": np.array([[count]], dtype=np.int32)}


def test_stream_yields_each_response_up_to_the_final_flag(writer) -> None:
    servicer, address = writer
    with InferenceClient(address) as client:
        responses = list(client.stream("writer", _inputs(b"Hello", 5), timeout=30))
    assert [r.final for r in responses] == [False] * 5 + [True]
    assert [bytes(r.outputs["TEXT"][0, 0]) for r in responses[:5]] == [b"H", b"e", b"l", b"l", b"o"]
    assert responses[-1].outputs == {}
    # The client asked for the empty final response, so that it always learns where the request ends.
    (request,) = servicer.requests
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    assert servicer.cancelled.wait(30)  # and it closed the stream the server held open


def test_stream_of_a_model_that_is_not_decoupled_ends_with_its_one_response(writer) -> None:
    _, address = writer
    with InferenceClient(address) as client:
        (response,) = client.stream("writer", _inputs(b"plain", 1), timeout=30)
    assert not response.final and bytes(response.outputs["TEXT"][0, 0]) == b"plain"


def test_stream_raises_the_error_a_response_carries(writer) -> None:
    _, address = writer
    with InferenceClient(address) as client:
        received = []
        with pytest.raises(StreamError, match="the pen broke"):
            for response in client.stream("writer", _inputs(b"fail", 5), timeout=30):
                received.append(response)
    assert len(received) == 2


def test_pipeline_infer_stream_prints_the_text_as_it_comes(writer, capsys) -> None:
    servicer, address = writer
    stream = ["infer", "--url", address, "-m", "writer", "--stream"]
    code = main([*stream, "--value", "PROMPT=To be", "--value", "COUNT=5"])
    assert code == 0
    assert capsys.readouterr().out == "To be\n"
    tensors = {t.name: t.to_array() for t in request_tensors(servicer.requests[0])}
    assert tensors["COUNT"].dtype == np.int32 and tensors["COUNT"].shape == (1, 1)


def test_pipeline_infer_stream_reports_an_error_after_the_text_so_far(writer, capsys) -> None:
    _, address = writer
    code = main(
        [
            "infer",
            "--url",
            address,
            "-m",
            "writer",
            "--stream",
            "--value",
            "PROMPT=fail",
            "--value",
            "COUNT=5",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and out == "fa" and "the pen broke" in err


def test_pipeline_infer_stream_json_prints_a_line_per_response(writer, capsys) -> None:
    _, address = writer
    main(
        [
            "infer",
            "--url",
            address,
            "-m",
            "writer",
            "--stream",
            "--json",
            "--value",
            "PROMPT=ab",
            "--value",
            "COUNT=2",
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        '{"final": false, "TEXT": [["a"]]}',
        '{"final": false, "TEXT": [["b"]]}',
        '{"final": true}',
    ]


def test_pipeline_infer_refuses_a_value_the_input_cannot_hold(writer, capsys) -> None:
    _, address = writer
    code = main(["infer", "--url", address, "-m", "writer", "--stream", "--value", "COUNT=many"])
    assert code == 2 and "--value COUNT: 'many' is not a value of datatype INT32" in capsys.readouterr().err
    code = main(["infer", "--url", address, "-m", "writer", "--value", "NOPE=1"])
    assert code == 2 and "NAME an input of 'writer' (PROMPT, COUNT)" in capsys.readouterr().err
