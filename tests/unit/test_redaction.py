"""Credentials in URIs are redacted wherever tidal shows them: MLflow params, config.yaml, the
summary, log lines (learner/rank0/tracking.py), and the Redis URL in the broker's logs and errors."""

from dataclasses import replace

import pytest

from tidal.broker.redis_transport import Reconnect, shown_url
from tidal.config import RedisConfig, RunConfig, flatten, redact_uri, redacted_config, to_yaml

SECRETS = ("s3cret", "t0k3n", "k3y", "g1thub", "sigval")


@pytest.mark.parametrize(
    "uri, shown",
    [
        (
            "https://alice:s3cret@mlflow.example:5000/api?token=t0k3n&x=1",
            "https://alice:***@mlflow.example:5000/api?token=***&x=1",
        ),
        ("https://g1thub@mlflow.example/", "https://***@mlflow.example/"),  # a user part alone may be a token
        ("https://h/?API_KEY=k3y&Password=s3cret&flag", "https://h/?API_KEY=***&Password=***&flag"),
        ("https://blob.example/c?sv=2024&sig=sigval", "https://blob.example/c?sv=2024&sig=***"),
        ("redis://:s3cret@10.0.0.1:6379/0", "redis://:***@10.0.0.1:6379/0"),
        ("sqlite:////abs/run/mlflow.db", "sqlite:////abs/run/mlflow.db"),  # nothing to hide: kept as it is
        ("databricks", "databricks"),
        ("", ""),
        ("http://[::1", "***"),  # unparsable: nothing of it is shown
    ],
)
def test_redact_uri_hides_passwords_tokens_and_keys(uri, shown):
    assert redact_uri(uri) == shown


def credentialed_config() -> RunConfig:
    cfg = RunConfig()
    return replace(
        cfg,
        tracking=replace(cfg.tracking, uri="https://u:s3cret@m.example/?token=t0k3n"),
        broker=replace(cfg.broker, redis=RedisConfig(url="redis://u:s3cret@h:6379/0?password=s3cret")),
    )


def test_the_config_shown_in_params_and_config_yaml_holds_no_credentials():
    cfg = redacted_config(credentialed_config())
    shown = to_yaml(cfg) + repr(flatten(cfg))
    assert not [s for s in SECRETS if s in shown]
    assert flatten(cfg)["tracking.uri"] == "https://u:***@m.example/?token=***"


def test_the_redis_url_in_broker_logs_and_errors_holds_no_password():
    for url in (
        "redis://learner:s3cret@h:6379/0",
        "redis://h:6379/0?password=s3cret",
        "rediss://h/0?username=u&password=s3cret",
    ):
        assert "s3cret" not in shown_url(url)
        assert "s3cret" not in Reconnect(RedisConfig(url=url)).url


def test_log_lines_and_tracebacks_of_mlflow_errors_hold_no_credentials(caplog):
    """MLflow's errors quote the URL they failed on: the tracking and diagnostics loggers redact it."""
    import logging

    from tidal.learner.rank0 import diagnostics, tracking

    url = "https://bob:s3cret@mlflow.example/api/2.0/mlflow/runs/log-batch?token=t0k3n"
    with caplog.at_level(logging.INFO):
        diagnostics.log.warning(
            "figure %s at step %d not drawn: %s", "x.png", 3, ConnectionError(f"request to {url} failed")
        )
        try:
            raise ConnectionError(f"API request to {url} failed")
        except ConnectionError:
            tracking.log.exception("metrics of the failed run did not all reach MLflow")
    assert "x.png" in caplog.text and "API request to https://bob:***@mlflow.example" in caplog.text  # the traceback
    assert not [s for s in SECRETS if s in caplog.text]


def test_a_log_call_with_wrong_arguments_does_not_raise_where_it_is_made():
    """The redacting filter formats the message itself; one that cannot be formatted goes on to logging's
    own error handling, as without the filter, instead of raising in the tracker's code."""
    import logging

    from tidal.learner.rank0 import tracking

    raised = []
    logging.raiseExceptions, before = False, logging.raiseExceptions
    try:
        tracking.log.warning("two values %s %s", "only one")  # a bug in a log call must not stop a run
    except TypeError as err:
        raised.append(err)
    finally:
        logging.raiseExceptions = before
    assert raised == []
