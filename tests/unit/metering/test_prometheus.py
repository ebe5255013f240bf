"""The opt-in Prometheus endpoint: off without FINETUNE_METRICS_PORT, one port per local rank,
a clear refusal of a bad port, a busy port reported without stopping training, closed at the end."""

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from finetune_kit.errors import ConfigError
from finetune_kit.metering import keys, prometheus


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launch(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "CROSS_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(prometheus.ENV_ADDR, "127.0.0.1")
    return monkeypatch


def test_no_variable_no_endpoint(launch):
    launch.delenv(prometheus.ENV_PORT, raising=False)
    assert prometheus.requested_port() is None
    assert prometheus.open_endpoint("llama3-8b-zero3") is None


@pytest.mark.parametrize("value", ["abc", "80", "70000", "9450.5"])
def test_a_bad_port_is_refused_before_training(launch, value):
    launch.setenv(prometheus.ENV_PORT, value)
    with pytest.raises(ConfigError, match=rf"{prometheus.ENV_PORT}='{value}'.*1024 to 65535.*unset it"):
        prometheus.requested_port()


def test_the_rank_serves_base_plus_local_rank_with_its_labels(launch):
    base = free_port() - 1  # local rank 1 listens on base + 1
    launch.setenv(prometheus.ENV_PORT, str(base))
    endpoint = prometheus.open_endpoint("llama3-8b-zero3")
    try:
        assert endpoint.port == base + 1
        endpoint.update({"step": 4, "epoch": 0, "loss": 2.25, "lr": 1e-4, "tokens_per_s": 812.5, "mfu_percent": None,
                         "gpu_reserved_GiB": 3.0})
        endpoint.rank_tokens(100)
        endpoint.rank_tokens(20)
        families = scrape(base + 1)
    finally:
        endpoint.close()
    (loss,) = families["finetune_loss"]
    assert loss.value == 2.25
    assert loss.labels == {"recipe": "llama3-8b-zero3", "rank": "3", "local_rank": "1", "node": "0",
                           "host": loss.labels["host"]}
    assert families["finetune_tokens_per_second"][0].value == 812.5
    assert families["finetune_learning_rate"][0].value == 1e-4
    tokens = [s for s in families["finetune_rank_tokens"] if s.name == "finetune_rank_tokens_total"]
    assert tokens[0].value == 120
    assert families["finetune_host_rss_bytes"][0].value > 10 * 2**20  # read at the scrape: this process
    assert "finetune_mfu_percent" not in families or not families["finetune_mfu_percent"]  # no value, no series
    with pytest.raises(OSError):  # closed: nothing listens any more
        scrape(base + 1)


def test_a_busy_port_is_reported_and_training_goes_on(launch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch.setenv(prometheus.ENV_PORT, str(port - 1))
        assert prometheus.open_endpoint("llama3-8b-zero3") is None
    out = capsys.readouterr().out
    assert f"rank 3 could not listen on port {port}" in out and "Training goes on" in out


def test_every_step_series_mirrors_a_metrics_key():
    mirrored = {s.key for s in prometheus.STEP_SERIES}
    assert mirrored <= {m.key for m in keys.STEP_METRICS}
    assert {keys.LOSS.key, keys.TOKENS_PER_S.key, keys.MFU.key, keys.STEP_TIME.key} <= mirrored
    names = prometheus.exported_names()
    assert "finetune_rank_tokens_total" in names and "finetune_gpu_temperature_celsius" in names
    assert all(n.startswith("finetune_") for n in names)


# ---- the address the endpoint listens on ----

def foreign_address() -> str:
    """An IPv4 address none of this host's interfaces has (from TEST-NET-3, documentation-only)."""
    own = prometheus._host_addresses()
    return next(a for a in (f"203.0.113.{i}" for i in range(1, 255)) if a not in own)


@pytest.mark.parametrize(("value", "address"), [("", "0.0.0.0"), ("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"),
                                                ("::", "::"), ("[::1]", "::1")])
def test_the_endpoint_listens_where_the_address_says(launch, value, address):
    launch.setenv(prometheus.ENV_ADDR, value)
    assert prometheus.requested_addr() == address


def test_an_interface_address_of_this_host_is_taken_and_the_endpoint_binds_it_alone(launch):
    ours = sorted(a for a in prometheus._host_addresses() if ":" not in a and not a.startswith("127."))
    if not ours:
        pytest.skip("this host has no IPv4 address besides loopback")
    launch.setenv(prometheus.ENV_ADDR, ours[0])
    assert prometheus.requested_addr() == ours[0]
    launch.setenv(prometheus.ENV_ADDR, "127.0.0.1")
    base = free_port() - 1
    launch.setenv(prometheus.ENV_PORT, str(base))
    endpoint = prometheus.open_endpoint("llama3-8b-zero3")
    try:
        assert endpoint.server.server_address[:2] == ("127.0.0.1", base + 1)
        assert scrape(base + 1)  # loopback answers
        with pytest.raises(OSError):  # the host's other address does not: nothing listens there
            urllib.request.urlopen(f"http://{ours[0]}:{base + 1}/metrics", timeout=2)
    finally:
        endpoint.close()


@pytest.mark.parametrize("kind", ["foreign", "name"])
def test_an_address_that_is_not_this_hosts_is_refused_in_one_line(launch, kind):
    value = foreign_address() if kind == "foreign" else "metrics.example"
    launch.setenv(prometheus.ENV_ADDR, value)
    with pytest.raises(ConfigError) as err:
        prometheus.requested_addr()
    what = "not an address of this host" if kind == "foreign" else "not an IP address"
    assert str(err.value).startswith(f"{prometheus.ENV_ADDR}='{value}': {what}, so no metrics endpoint can listen")
    assert "127.0.0.1" in str(err.value) and "unset it to listen on every interface" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_series_carry_numbers_and_fixed_labels_only(launch):
    """No text of the training data reaches Prometheus: every label of every series is one of LABELS (and the
    memory series' kind), whose values are the recipe's name, rank numbers and the host name."""
    base = free_port() - 1
    launch.setenv(prometheus.ENV_PORT, str(base))
    endpoint = prometheus.open_endpoint("llama3-8b-zero3")
    try:
        endpoint.update({"step": 4, "epoch": 0, "loss": 2.25, "lr": 1e-4, "tokens_per_s": 812.5,
                         "padding_fraction": 0.1, "step_time_s": 1.5, "gpu_reserved_GiB": 3.0})
        endpoint.rank_tokens(100)
        families = scrape(base + 1)
    finally:
        endpoint.close()
    samples = [s for family in families.values() for s in family]
    assert len(samples) >= 8
    for sample in samples:
        assert set(sample.labels) <= {*prometheus.LABELS, "kind"}, sample
        assert sample.labels["recipe"] == "llama3-8b-zero3" and sample.labels["rank"] == "3"
        assert sample.labels.get("kind", "allocated") in ("allocated", "reserved")
        assert isinstance(sample.value, float)
