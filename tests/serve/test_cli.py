"""`flashdraft serve` refuses what cannot work before it loads anything: fast, in one line."""

import socket

import pytest

import flashdraft.models
from flashdraft.cli import main


@pytest.fixture
def no_model_loads(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the port was checked")

    monkeypatch.setattr(flashdraft.models, "load_target", load)
    monkeypatch.setattr(flashdraft.models, "load_draft", load)


def test_a_port_in_use_fails_before_any_model_loads(no_model_loads, capsys):
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        port = other_server.getsockname()[1]
        code = main(["serve", "--no-draft", "--host", "127.0.0.1", "--port", str(port)])
    assert code == 2
    assert capsys.readouterr().err == (
        f"flashdraft serve: error: port {port} on 127.0.0.1 is in use: stop the other server or pass --port N\n"
    )


def test_a_host_that_does_not_resolve_fails_before_any_model_loads(no_model_loads, capsys):
    assert main(["serve", "--no-draft", "--host", "no-such-host.invalid", "--port", "8000"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("flashdraft serve: error: --host 'no-such-host.invalid' does not resolve (")
    assert error.count("\n") == 1


def test_a_body_limit_below_one_byte_fails_before_any_model_loads(no_model_loads, capsys):
    assert main(["serve", "--no-draft", "--port", "8000", "--max-body-bytes", "0"]) == 2
    assert capsys.readouterr().err == "flashdraft serve: error: --max-body-bytes must be at least 1, got 0\n"


@pytest.mark.parametrize("argv, message", [
    (["--no-draft", "--proposals", "hybrid"], "--proposals hybrid needs a draft: drop --no-draft, or use --proposals "
                                              "lookup"),
])
def test_proposals_that_cannot_work_fail_before_any_model_loads(no_model_loads, capsys, argv, message):
    assert main(["serve", "--port", "8000", *argv]) == 2
    assert capsys.readouterr().err == f"flashdraft serve: error: {message}\n"


def test_an_unknown_proposals_mode_is_refused_by_the_parser(no_model_loads, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "8000", "--proposals", "ngram"])
    assert exit_info.value.code == 2
    assert "argument --proposals: invalid choice: 'ngram' (choose from" in capsys.readouterr().err


def test_the_default_body_limits_are_the_apps():
    from flashdraft.commands import serve
    from flashdraft.serve import app

    assert serve.DEFAULT_MAX_BODY_BYTES == app.DEFAULT_MAX_BODY_BYTES == 4 << 20
    assert serve.DEFAULT_BODY_SECONDS == app.DEFAULT_BODY_SECONDS


@pytest.mark.parametrize("seconds", ["0", "-1", "nan"])
def test_a_body_time_limit_that_is_not_positive_fails_before_any_model_loads(no_model_loads, capsys, seconds):
    assert main(["serve", "--no-draft", "--port", "8000", "--body-seconds", seconds]) == 2
    assert capsys.readouterr().err == f"flashdraft serve: error: --body-seconds must be above 0, got {float(seconds)}\n"


def test_the_default_batch_size_and_prefix_cache_are_the_libraries():
    from flashdraft import batching
    from flashdraft.commands import serve
    from flashdraft.serve import worker

    assert serve.DEFAULT_MAX_BATCH_SIZE == worker.DEFAULT_MAX_BATCH_SIZE
    assert serve.DEFAULT_PREFIX_CACHE_TOKENS == batching.DEFAULT_PREFIX_CACHE_TOKENS


def test_a_negative_prefix_cache_fails_before_any_model_loads(no_model_loads, capsys):
    assert main(["serve", "--no-draft", "--port", "8000", "--prefix-cache-tokens", "-1"]) == 2
    assert capsys.readouterr().err == "flashdraft serve: error: --prefix-cache-tokens must be 0 or more, got -1\n"
