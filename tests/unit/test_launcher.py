"""`pipeline run`'s own decisions that need no process: the router's stage token, and when a process that
died is started again."""

from __future__ import annotations

import pytest

from pipeline.tools.launcher import stage_admin_env, stage_token_env
from pipeline.tools.supervisor import RestartPolicy, RestartRecord, Service, describe_exit


def test_a_stage_token_is_made_only_when_tokens_are_configured():
    assert stage_token_env({}) == {}
    made = stage_token_env({"PIPELINE_AUTH_TOKENS": "a"})
    assert set(made) == {"PIPELINE_STAGE_TOKEN"} and len(made["PIPELINE_STAGE_TOKEN"]) >= 32
    assert made != stage_token_env({"PIPELINE_ADMIN_TOKENS_FILE": "admins"})  # a new secret each run
    # One given is used as it is (the services inherit it).
    assert stage_token_env({"PIPELINE_AUTH_TOKENS": "a", "PIPELINE_STAGE_TOKEN": "mine"}) == {}
    assert stage_token_env({"PIPELINE_AUTH_TOKENS": "a", "PIPELINE_STAGE_TOKEN_FILE": "f"}) == {}


def test_with_admin_tokens_the_stages_take_the_routers_token_as_an_admin_token():
    made = {"PIPELINE_STAGE_TOKEN": "router-secret"}
    assert stage_admin_env({"PIPELINE_AUTH_TOKENS": "a"}, made) == {}  # no admin scope anywhere
    assert stage_admin_env({"PIPELINE_ADMIN_TOKENS": "op"}, made) == {
        "PIPELINE_ADMIN_TOKENS": "op,router-secret"
    }
    assert stage_admin_env({"PIPELINE_ADMIN_TOKENS_FILE": "admins"}, made) == {
        "PIPELINE_ADMIN_TOKENS": "router-secret"  # beside the file's tokens
    }
    given = {"PIPELINE_ADMIN_TOKENS": "op", "PIPELINE_STAGE_TOKEN": "mine"}
    assert stage_admin_env(given, {}) == {"PIPELINE_ADMIN_TOKENS": "op,mine"}
    assert (
        stage_admin_env({"PIPELINE_ADMIN_TOKENS_FILE": "admins", "PIPELINE_STAGE_TOKEN_FILE": "f"}, {}) == {}
    )


def test_the_wait_before_a_restart_doubles_with_each_death_in_a_row_up_to_its_cap():
    record = RestartRecord(RestartPolicy(limit=10, window=1000, first_delay=0.5, max_delay=3))
    waits = [record.died(now, served=1.0) for now in (0, 10, 20, 30, 40)]
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert record.restart_at == 43.0


def test_a_process_that_served_a_while_restarts_after_the_shortest_wait_again():
    record = RestartRecord(RestartPolicy(limit=10, window=1000, first_delay=0.5, reset_after=60))
    assert [record.died(now, served=1.0) for now in (0, 5, 10)] == [0.5, 1.0, 2.0]
    assert record.died(100, served=60.0) == 0.5  # it had served a minute: healthy again
    assert record.died(101, served=1.0) == 1.0


def test_the_limit_th_death_within_the_window_gives_up():
    record = RestartRecord(RestartPolicy(limit=3, window=60))
    assert record.died(0, served=1) is not None
    assert record.died(50, served=1) is not None
    assert record.died(70, served=1) is not None  # the first death has left the window
    assert record.died(100, served=1) is None  # three within 60 s: 50, 70, 100
    assert record.restart_at == 70 + record.policy.first_delay * 4  # what was planned before, unchanged


def test_a_limit_of_one_gives_up_at_the_first_death():
    assert RestartRecord(RestartPolicy(limit=1)).died(0, served=1000) is None


def test_a_restart_keeps_the_ports_the_first_start_bound():
    service = Service("router", ["-m", "pipeline", "router"], 0, ["--http-port", "0", "--workers", "1"])
    service.pin("--http-port", "8123")
    service.pin("--metrics-port", "8124")
    assert service.args == ["--http-port", "8123", "--workers", "1", "--metrics-port", "8124"]


@pytest.mark.parametrize(("code", "words"), [(3, "code 3"), (-9, "code -9 (SIGKILL)"), (-200, "code -200")])
def test_an_exit_is_described_with_its_signal(code, words):
    assert describe_exit(code) == words
