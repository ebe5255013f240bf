import pytest

from finetune_kit.errors import DataError
from finetune_kit.launch import failures

GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:2945. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms "
                "for recv operation to complete")


@pytest.fixture()
def rank0(monkeypatch):
    launch = {"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0", "FINETUNE_COLLECTIVE_TIMEOUT_S": "20"}
    for key, value in launch.items():
        monkeypatch.setenv(key, value)


def test_a_peer_that_died_or_went_silent_is_explained(rank0):
    closed = failures.peer_failure(RuntimeError(GLOO_CLOSED))
    assert closed.startswith("rank 0 of 2 (node 0) stops: another rank closed its connection")
    assert "relaunch the same command on every node" in closed and "Connection closed by peer" in closed
    silent = failures.peer_failure(RuntimeError(GLOO_TIMEOUT))
    assert "no answer from another rank within 20 s (FINETUNE_COLLECTIVE_TIMEOUT_S)" in silent
    # gloo's pair alone, naming no backend (a frozen peer met in ZeRO-3's all-gather)
    pair = failures.peer_failure(RuntimeError("Application timeout caused pair closure"))
    assert "no answer from another rank within 20 s" in pair
    assert pair.endswith("(Application timeout caused pair closure)")


def test_other_errors_are_not_dressed_up_as_a_lost_peer(rank0):
    assert failures.peer_failure(RuntimeError("DataLoader timed out after 5 seconds")) is None
    assert failures.peer_failure(ValueError(GLOO_CLOSED)) is None


def test_run_main_exits_with_the_message(rank0, monkeypatch, capsys):
    def bad_input():
        raise DataError("data file 'x' does not exist")

    with pytest.raises(SystemExit) as stop:
        failures.run_main(bad_input)
    assert stop.value.code == 1 and capsys.readouterr().err == "error: data file 'x' does not exist\n"

    def lost_peer():
        raise RuntimeError(GLOO_CLOSED)

    exits = []
    monkeypatch.setattr(failures.os, "_exit", exits.append)
    failures.run_main(lost_peer)
    assert exits == [1] and "another rank closed its connection" in capsys.readouterr().err

    def bug():
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        failures.run_main(bug)


def test_a_bad_input_is_said_by_the_first_rank_of_a_node_alone(rank0, monkeypatch, capsys, tmp_path):
    err = DataError("data file 'x' does not exist")
    slept = []
    monkeypatch.setattr(failures.time, "sleep", slept.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    failures.report_bad_input(err)  # another rank of the node: silent, and leaves after the first
    assert capsys.readouterr().err == "" and slept == [failures.SILENT_RANK_DELAY_S]

    monkeypatch.setenv("LOCAL_RANK", "0")
    failures.report_bad_input(err)
    assert capsys.readouterr().err == "error: data file 'x' does not exist\n"

    # under `python -m finetune_kit.check`: to its file, which the check prints as the launch's last line
    monkeypatch.setenv(failures.ERROR_FILE_VAR, str(tmp_path / "error.txt"))
    failures.report_bad_input(err)
    assert capsys.readouterr().err == "" and (tmp_path / "error.txt").read_text() == f"{err}\n"
    monkeypatch.setenv(failures.ERROR_FILE_VAR, str(tmp_path / "no/such/folder/error.txt"))
    failures.report_bad_input(err)  # no file to write: said on stderr after all
    assert capsys.readouterr().err == "error: data file 'x' does not exist\n"


@pytest.mark.parametrize("raw", ["0", "ten", "-5"])
def test_a_bad_timeout_value_is_named(monkeypatch, raw):
    from finetune_kit.errors import ConfigError
    from finetune_kit.launch import env

    monkeypatch.setenv("FINETUNE_COLLECTIVE_TIMEOUT_S", raw)
    with pytest.raises(ConfigError, match=rf"FINETUNE_COLLECTIVE_TIMEOUT_S='{raw}' is not a whole number"):
        env.collective_timeout_s()


def test_a_finished_rank_of_several_leaves_without_interpreter_finalisation(rank0, monkeypatch):
    exits = []
    monkeypatch.setattr(failures.os, "_exit", exits.append)
    failures.run_main(lambda: None)

    def stopped_by_a_signal():
        raise SystemExit(0)

    failures.run_main(stopped_by_a_signal)
    assert exits == [0, 0]
    monkeypatch.setenv("WORLD_SIZE", "1")
    failures.run_main(lambda: None)  # one process: the ordinary exit
    assert exits == [0, 0]
    with pytest.raises(SystemExit, match="2"):
        failures.run_main(lambda: exec("raise SystemExit(2)"))
