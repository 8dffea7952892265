"""The pagenumber example from the tree's repository: pages of held-out handwritten digits read by the
ensemble with its fan-out step and by the BLS model, over real stage services (the python models and the
trained digits CNN) and the router; both answer what the same segmentation and CNN give in-process, the
CNN's calls of concurrent pages share batches, and `pipeline infer --model pagenumber page.png` prints the
number (as text with `--json`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from examples.pagenumber import draw_page, held_out_pages
from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.cli import main
from pipeline.ensemble.catalog import load_catalog
from pipeline.protocol.codec import response_tensors
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from pipeline.stage.python_backend import PythonBackend
from pipeline.tools.testing import Running, serving_router, serving_stages
from services.model.backend import ModelBackend
from tests.conftest import inference_stub, request_for, wait_serving
from tests.stages import EXAMPLE_REPOSITORY, example_repository

MODELS = ["pagenumber", "pagenumber_segment", "pagenumber_join", "pagenumber_bls"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's models, and the digits CNN trained as `make model` trains it."""
    from examples.models.build import build

    root = example_repository(tmp_path_factory.mktemp("pagenumber"), MODELS)
    build(root, ["digits_cnn"], progress=False, report=lambda _: None)
    return root


@contextlib.asynccontextmanager
async def pipeline(root: Path, tmp_path: Path) -> AsyncIterator[Running]:
    """Every model of `root` on one stage service (as each of the ensemble's three stages), and the router."""
    port_file = tmp_path / "router.port"
    backends = [PythonBackend(), ModelBackend(Runners(device="cpu"))]
    async with serving_stages(
        [], repository=ModelRepository(root), backends=backends, options={"router_port_file": port_file}
    ) as stage:
        await wait_serving(stage.address, timeout=120)
        stages = ("PREPROCESS", "MODEL", "POSTPROCESS")
        environ = {f"{name}_ADDRESS": stage.address for name in stages}
        async with serving_router(load_catalog(repository=root, environ=environ)) as router:
            port_file.write_text(router.address.rsplit(":", 1)[1])
            await wait_serving(router.address, timeout=60)
            yield router


def in_process(root: Path, pages: list[bytes]) -> list[str]:
    """What the example's segmentation and the CNN answer for `pages`, run here."""
    import torch

    spec = importlib.util.spec_from_file_location("segment", root / "pagenumber_segment" / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    segment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(segment)
    cnn = torch.jit.load(str(root / "digits_cnn" / "1" / "model.pt"))
    numbers = []
    for page in pages:
        grey = np.asarray(Image.open(io.BytesIO(page)).convert("L"), np.float32)
        crops = segment.crops(segment.ink_map(grey, 4))
        with torch.no_grad():
            digits = cnn(torch.from_numpy(crops)).argmax(1).tolist() if len(crops) else []
        numbers.append("".join(str(d) for d in digits))
    return numbers


def page_input(page: bytes) -> np.ndarray:
    array = np.empty(1, dtype=object)
    array[0] = page
    return array


async def test_the_ensemble_and_the_bls_model_read_the_same_numbers(repository: Path, tmp_path: Path) -> None:
    pages = [page for page, _ in held_out_pages(16, 6, seed=3)]
    blank = draw_page([], [])
    expected = in_process(repository, pages)
    assert sum(number != "" for number in expected) == 16
    async with pipeline(repository, tmp_path) as router, inference_stub(router.address) as stub:
        for model in ("pagenumber", "pagenumber_bls"):
            before = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits_cnn"))).model_stats[0]
            replies = await asyncio.gather(
                *(stub.ModelInfer(request_for(model, PAGE=page_input(page)), timeout=60) for page in pages)
            )
            numbers = [response_tensors(r)["NUMBER"].to_array()[0].decode() for r in replies]
            assert numbers == expected, model
            digits = [response_tensors(r)["DIGITS"].to_array().tolist() for r in replies]
            assert digits == [[int(d) for d in number] for number in expected]
            after = (await stub.ModelStatistics(pb.ModelStatisticsRequest(name="digits_cnn"))).model_stats[0]
            # One call per crop, and the crops of concurrent pages shared the CNN's batches.
            calls = after.inference_count - before.inference_count
            assert calls == 6 * len(pages)
            assert after.execution_count - before.execution_count < calls / 2, model

            reply = await stub.ModelInfer(request_for(model, PAGE=page_input(blank)), timeout=60)
            outputs = response_tensors(reply)
            assert outputs["NUMBER"].to_array()[0] == b"" and outputs["DIGITS"].to_array().shape == (0,)


async def test_pipeline_infer_prints_a_pages_number(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    [(page, _)] = held_out_pages(1, 6, seed=11)
    [number] = in_process(repository, [page])
    path = tmp_path / "page.png"
    path.write_bytes(page)
    async with pipeline(repository, tmp_path) as router:
        argv = ["infer", "--model", "pagenumber", "--url", router.address, "--timeout", "60", str(path)]
        assert await asyncio.to_thread(main, argv) == 0
        assert f"NUMBER={number}" in capsys.readouterr().out
        # --json: the BYTES output as text
        argv = ["infer", "--model", "pagenumber", "--url", router.address, "--json", str(path)]
        assert await asyncio.to_thread(main, argv) == 0
    assert json.loads(capsys.readouterr().out)["NUMBER"] == [number]


def test_the_example_is_in_the_tree() -> None:
    for name in MODELS:
        assert (EXAMPLE_REPOSITORY / name).is_dir(), name
