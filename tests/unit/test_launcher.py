"""`pipeline run`'s own decisions that need no process: the router's stage token."""

from __future__ import annotations

from pipeline.tools.launcher import stage_token_env


def test_a_stage_token_is_made_only_when_tokens_are_configured():
    assert stage_token_env({}) == {}
    made = stage_token_env({"PIPELINE_AUTH_TOKENS": "a"})
    assert set(made) == {"PIPELINE_STAGE_TOKEN"} and len(made["PIPELINE_STAGE_TOKEN"]) >= 32
    assert made != stage_token_env({"PIPELINE_ADMIN_TOKENS_FILE": "admins"})  # a new secret each run
    # One given is used as it is (the services inherit it).
    assert stage_token_env({"PIPELINE_AUTH_TOKENS": "a", "PIPELINE_STAGE_TOKEN": "mine"}) == {}
    assert stage_token_env({"PIPELINE_AUTH_TOKENS": "a", "PIPELINE_STAGE_TOKEN_FILE": "f"}) == {}
