"""The stateful example (`textgen_state`, sequence batching) as processes: two model-service replicas behind a
router with two workers. Every sequence's answers equal the network run in-process, both replicas take
sequences and none is split; a replica SIGKILLed mid-run takes only its own sequences with it, each answered
UNAVAILABLE naming it, while the others run to their end."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from bench.sequences import MODEL, chunks, matches, reference, replica_statistics, run_sequences, wait_model
from pipeline.protocol.sequences import SequenceId, sequence_key
from pipeline.router.stages.replicas import rendezvous
from tests.e2e.conftest import start_service, wait_serving

pytestmark = pytest.mark.e2e


def test_sequences_stay_with_their_state_across_router_workers_and_lose_only_a_killed_replicas(
    tmp_path, model_dir
) -> None:
    network = model_dir / MODEL / "1" / "model.pt"
    command = ["-m", "services.model", "--model-dir", str(model_dir), "--load-model", MODEL]
    first = start_service("model-0", command, tmp_path)
    second = start_service("model-1", command, tmp_path)
    processes = [first, second]
    try:
        for replica in (first, second):
            wait_model(replica.address)
        target = f"ipv4:{first.address},{second.address}"
        router = start_service(
            "router",
            ["-m", "pipeline", "router", "--workers", "2", "--stage", f"model={target}"],
            tmp_path,
        )
        processes.append(router)
        wait_serving(router)
        wait_model(router.address)

        def home(sequence: int) -> str:
            ranked = rendezvous(
                [f"ipv4:{first.address}", f"ipv4:{second.address}"],
                sequence_key(SequenceId(sequence, False, False)),
            )
            return ranked[0].removeprefix("ipv4:")

        ids = list(range(1, 13))
        texts = {sequence: chunks(sequence, 10) for sequence in ids}
        outcomes = asyncio.run(run_sequences(router.address, ids, texts, [0]))
        for sequence, outcome in outcomes.items():
            assert outcome.error is None, outcome.error
            assert len(outcome.answers) == 10 and matches(outcome, reference(network, texts[sequence]))
        for replica in (first, second):
            inferences = replica_statistics(replica.address)[0]
            assert inferences == 10 * sum(1 for s in ids if home(s) == replica.address) > 0

        # One replica killed while every sequence is half way: only the sequences it held fail.
        ids = list(range(101, 113))
        texts = {sequence: chunks(sequence, 30) for sequence in ids}
        answered = [0]

        async def run_and_kill():
            async def kill() -> None:
                while answered[0] < 12 * 10:
                    await asyncio.sleep(0.005)
                first.popen.send_signal(signal.SIGKILL)

            killer = asyncio.create_task(kill())
            outcomes = await run_sequences(router.address, ids, texts, answered)
            killer.cancel()
            return outcomes

        outcomes = asyncio.run(run_and_kill())
        held = {s for s in ids if home(s) == first.address}
        assert held and held != set(ids)
        for sequence, outcome in outcomes.items():
            expected = reference(network, texts[sequence])
            assert matches(outcome, expected)
            if sequence in held:
                assert outcome.error is not None, f"sequence {sequence} of the killed replica carried on"
                code, message = outcome.error
                assert code == grpc.StatusCode.UNAVAILABLE.name
                assert (
                    f"sequence {sequence} of model '{MODEL}' is lost" in message and first.address in message
                )
            else:
                assert outcome.error is None and len(outcome.answers) == 30, outcome.error
    finally:
        for process in processes:
            if process.popen.poll() is None:
                process.stop()
