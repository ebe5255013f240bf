"""docker/monitoring: the Grafana dashboard is well formed and queries only series that exist (the
trainer's endpoint, finetune_kit.metering.prometheus, or a field of the DCGM exporter's counters
file); prometheus.yml, its example targets and targets.sh agree; compose.yaml is a valid Compose
file with pinned images, mounts of files in the repository and ports that match the rest.

The Compose Specification schema in schemas/compose-spec.json is compose-spec/compose-spec's
schema/compose-spec.json at commit 170098ba07d9f53c383a41bfd4c5166b0a4529a6 (Apache-2.0)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from finetune_kit.metering import prometheus
from tests.debian import ensure_debian_packages
from tests.harness import REPO

MONITORING = REPO / "docker/monitoring"
DASHBOARD = MONITORING / "grafana/dashboards/finetune.json"
PROMETHEUS_YML = MONITORING / "prometheus/prometheus.yml"
COMPOSE_SCHEMA = Path(__file__).parent / "schemas/compose-spec.json"
DATASOURCE_UID = "finetune-prometheus"
PROMETHEUS_OWN = frozenset({"up"})  # series Prometheus writes for every target itself


# --- PromQL: the metric names an expression reads ------------------------------------------------

KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                      "unless", "offset", "inf", "nan"})
LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
TOKEN = re.compile(r"[A-Za-z_:][\w:]*|\d[\w.]*|\S")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (Grafana's $variables allowed): identifiers that are
    neither functions, aggregations, keywords, label names nor inside strings, matchers or ranges."""
    names = set(re.findall(r"""__name__\s*=~?\s*["']([\w:]+)["']""", expr))
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)  # strings
    text = re.sub(r"\$\{[^}]*\}|\$\w+", "1", text)  # Grafana variables
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = LABEL_LIST.sub(" ", text)
    tokens = [m.group() for m in TOKEN.finditer(text)]
    for i, token in enumerate(tokens):
        if not re.fullmatch(r"[A-Za-z_:][\w:]*", token) or token.lower() in KEYWORDS:
            continue
        if i + 1 < len(tokens) and tokens[i + 1] == "(":  # a function or an aggregation
            continue
        names.add(token)
    return names


def variable_query_names(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus variable query (label_values(metric{...}, label), ...)."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
    if match:
        return metric_names(match.group(1))
    match = re.fullmatch(r"\s*label_values\(\s*\w+\s*\)\s*", query)
    if match:  # label_values(label): no metric
        return set()
    match = re.fullmatch(r"\s*(?:query_result|metrics)\((.*)\)\s*", query)
    return metric_names(match.group(1) if match else query)


def unknown_names(dashboard: dict, allowed: set[str]) -> dict[str, set[str]]:
    """{panel or variable title: names its queries read that are not in allowed}."""
    unknown = {}
    for panel in all_panels(dashboard):
        names = set().union(*(metric_names(t["expr"]) for t in panel.get("targets", [])))
        if names - allowed:
            unknown[panel["title"]] = names - allowed
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        if variable_query_names(query) - allowed:
            unknown[f"${var['name']}"] = variable_query_names(query) - allowed
    return unknown


@pytest.mark.parametrize("expr, names", [
    ('max by (recipe) (finetune_loss{recipe=~"$recipe"})', {"finetune_loss"}),
    ('sum by (rank) (rate(finetune_rank_tokens_total{recipe=~"$recipe", x="sum(up)"}[$__rate_interval]))',
     {"finetune_rank_tokens_total"}),
    ("avg without (gpu) (DCGM_FI_DEV_GPU_UTIL offset 5m) / on (node) group_left max(up) > bool 0.5e3",
     {"DCGM_FI_DEV_GPU_UTIL", "up"}),
    ('histogram_quantile(0.9, sum(rate(a_bucket[5m:30s])) by (le)) + {__name__="b_total", job="x"} - Inf',
     {"a_bucket", "b_total"}),
    ("count(up{job='finetune'}) - sum(up)", {"up"}),
])
def test_metric_names_are_read_out_of_promql(expr, names):
    assert metric_names(expr) == names


def test_a_dashboard_query_of_an_unknown_series_is_caught():
    dashboard = {"panels": [{"title": "t", "targets": [{"expr": 'rate(finetune_rank_token_total{rank="0"}[1m])'}]}],
                 "templating": {"list": [{"name": "v", "type": "query",
                                          "query": "label_values(finetune_nonexistent, rank)"}]}}
    assert unknown_names(dashboard, set(prometheus.exported_names())) == {
        "t": {"finetune_rank_token_total"}, "$v": {"finetune_nonexistent"}}


# --- the dashboard ----------------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dcgm_fields() -> dict[str, str]:
    """{field: Prometheus type} of dcgm-counters.csv, in the exporter's format `FIELD, type, help`."""
    fields = {}
    for n, line in enumerate((MONITORING / "dcgm-counters.csv").read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        assert len(parts) == 3 and all(parts), f"dcgm-counters.csv line {n}: expected 'FIELD, type, help': {line!r}"
        assert re.fullmatch(r"DCGM_FI_[A-Z0-9_]+", parts[0]), f"line {n}: {parts[0]!r} is not a DCGM field name"
        assert parts[1] in {"gauge", "counter", "label"}, f"line {n}: type {parts[1]!r}"
        assert parts[0] not in fields, f"line {n}: {parts[0]} twice"
        fields[parts[0]] = parts[1]
    return fields


def test_the_dashboard_has_what_grafana_requires():
    d = load_dashboard()
    assert d["title"] and re.fullmatch(r"[\w-]{1,40}", d["uid"])
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["time"]["from"] and d["time"]["to"]
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), ids
    for p in panels:
        assert p["type"] and p["title"], p
        grid = p["gridPos"]
        assert set(grid) >= {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p.get("description"), f"panel {p['title']!r}: say what it shows and how to read it"
        assert p["targets"], p["title"]
        for ref in (p["datasource"], *(t["datasource"] for t in p["targets"])):
            assert ref == {"type": "prometheus", "uid": DATASOURCE_UID}, (p["title"], ref)
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_no_two_panels_overlap():
    boxes = [(p["title"], p["gridPos"]) for p in load_dashboard()["panels"]]  # rows' children: when expanded
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1:]:
            apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                     or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
            assert apart, f"panels {a!r} {ga} and {b!r} {gb} overlap"


def test_template_variables_recipe_node_and_rank():
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert set(variables) >= {"recipe", "node", "rank"}
    for v in variables.values():
        assert v["type"] == "query" and v["datasource"]["uid"] == DATASOURCE_UID, v["name"]
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert query.startswith("label_values(") and query.rstrip(")").endswith(v["name"]), query
    exprs = [t["expr"] for p in all_panels(load_dashboard()) for t in p.get("targets", [])]
    for name in variables:
        assert any(f"${name}" in e for e in exprs), f"${name} filters no panel"


def test_every_series_the_dashboard_reads_exists():
    fields = dcgm_fields()
    d = load_dashboard()
    assert unknown_names(d, set(prometheus.exported_names()) | set(fields) | PROMETHEUS_OWN) == {}
    used = set().union(*(metric_names(t["expr"]) for p in all_panels(d) for t in p.get("targets", [])))
    # the counters file is exactly what the dashboard needs: nothing it reads is missing, nothing unused is watched
    assert {n for n in used if n.startswith("DCGM_")} == set(fields)


def test_the_dashboard_covers_the_trainers_series():
    used = set().union(*(metric_names(t["expr"]) for p in all_panels(load_dashboard()) for t in p.get("targets", [])))
    assert set(prometheus.exported_names()) - used == set(), "series the trainer exports that no panel shows"


def test_global_figures_are_not_summed_over_ranks():
    """The step's figures are the same on every rank: a sum over ranks would multiply them."""
    step_series = {s.exposed for s in prometheus.STEP_SERIES}
    for p in all_panels(load_dashboard()):
        for t in p.get("targets", []):
            if metric_names(t["expr"]) & step_series:
                assert not re.search(r"\b(sum|count|avg)\b", t["expr"]) and ("max by (recipe)" in t["expr"]
                                                                            or 'rank="0"' in t["expr"]), t["expr"]


# --- Prometheus ---------------------------------------------------------------------------------------


def load_targets(path: Path) -> list[dict]:
    """A file_sd file: a list of {"targets": ["host:port", ...], "labels": {...}}."""
    groups = json.loads(path.read_text())
    assert isinstance(groups, list) and groups, path
    for g in groups:
        assert set(g) <= {"targets", "labels"} and g["targets"], g
        assert all(re.fullmatch(r"[\w.\-\[\]:]+:\d+", t) for t in g["targets"]), g
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in g.get("labels", {}).items()), g
    return groups


def ports(groups: list[dict]) -> list[list[int]]:
    return [[int(t.rsplit(":", 1)[1]) for t in g["targets"]] for g in groups]


def scrape_jobs() -> dict[str, dict]:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_scrapes_the_ranks_and_dcgm_from_targets_files_next_to_it():
    jobs = scrape_jobs()
    assert set(jobs) >= {"finetune", "dcgm"}
    for name in ("finetune", "dcgm"):
        files = [f for sd in jobs[name]["file_sd_configs"] for f in sd["files"]]
        assert files == [f"targets/{name}.json"], files  # relative: Prometheus resolves it against the config
        load_targets(PROMETHEUS_YML.parent / files[0])
    assert jobs["finetune"].get("honor_labels") is True  # the trainer's own node/rank labels win


def test_the_example_targets_are_a_two_node_job_on_the_documented_ports():
    finetune = load_targets(PROMETHEUS_YML.parent / "targets/finetune.json")
    dcgm = load_targets(PROMETHEUS_YML.parent / "targets/dcgm.json")
    assert [g["labels"]["node"] for g in finetune] == [g["labels"]["node"] for g in dcgm] == ["0", "1"]
    per_node = ports(finetune)
    assert all(p == list(range(prometheus.DEFAULT_PORT, prometheus.DEFAULT_PORT + len(per_node[0]))) for p in per_node)
    assert {p for node in ports(dcgm) for p in node} == {dcgm_port()}


@pytest.fixture(scope="module")
def promtool() -> str:
    """Prometheus's own checker, from Debian's prometheus package: installed when missing where that
    can be done (root on Debian, as on CI; the live-metrics session runs that Prometheus), else skipped."""
    try:
        ensure_debian_packages("prometheus", present="promtool")
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"promtool is not installed and could not be: {exc}")
    return shutil.which("promtool") or "/usr/bin/promtool"


def test_promtool_accepts_the_config(promtool, tmp_path):
    shutil.copytree(PROMETHEUS_YML.parent, tmp_path / "prometheus")
    proc = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus/prometheus.yml")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_parses_every_dashboard_query(promtool, tmp_path):
    """Each expression, with Grafana's variables filled in, as a recording rule: promtool parses it as
    Prometheus does."""
    grafana = {"$__rate_interval": "20s", "$__interval": "5s", "$recipe": ".*", "$node": ".*", "$rank": ".*"}
    rules = []
    for p in all_panels(load_dashboard()):
        for t in p.get("targets", []):
            expr = t["expr"]
            for variable, value in grafana.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"panel {p['title']!r}: a Grafana variable the test does not fill in: {expr}"
            rules.append({"record": f"dashboard:panel_{p['id']}_{t['refId']}", "expr": expr})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def run_targets_sh(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(MONITORING / "targets.sh"), f"TARGETS_DIR={tmp_path}", *args],
                          capture_output=True, text=True, timeout=30)


def test_targets_sh_writes_one_target_per_rank_and_one_exporter_per_node(tmp_path):
    proc = run_targets_sh(tmp_path, "NODES=gpu-a 10.0.0.2", "GPUS_PER_NODE=3", "METRICS_PORT=9600", "DCGM_PORT=9401")
    assert proc.returncode == 0, proc.stderr
    finetune, dcgm = load_targets(tmp_path / "finetune.json"), load_targets(tmp_path / "dcgm.json")
    assert finetune == [{"labels": {"node": "0"}, "targets": ["gpu-a:9600", "gpu-a:9601", "gpu-a:9602"]},
                        {"labels": {"node": "1"}, "targets": ["10.0.0.2:9600", "10.0.0.2:9601", "10.0.0.2:9602"]}]
    assert dcgm == [{"labels": {"node": "0"}, "targets": ["gpu-a:9401"]},
                    {"labels": {"node": "1"}, "targets": ["10.0.0.2:9401"]}]


def test_the_example_targets_are_what_targets_sh_writes(tmp_path):
    proc = run_targets_sh(tmp_path, "NODES=node0 node1", "GPUS_PER_NODE=4")
    assert proc.returncode == 0, proc.stderr
    for name in ("finetune.json", "dcgm.json"):
        assert (tmp_path / name).read_text() == (PROMETHEUS_YML.parent / "targets" / name).read_text(), name


@pytest.mark.parametrize("args, message", [
    (("GPUS_PER_NODE=0",), "GPUS_PER_NODE='0'"),
    (("METRICS_PORT=http",), "METRICS_PORT='http'"),
    (("METRICS_PORT=65530", "GPUS_PER_NODE=8"), "past port 65535"),
    (("NODES= ",), "NODES is empty"),
    (("NODES=a;b",), "node 'a;b'"),
    (("NODE=a",), "unknown argument 'NODE=a'"),
])
def test_targets_sh_refuses_bad_settings(tmp_path, args, message):
    proc = run_targets_sh(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "finetune.json").exists()


# --- compose.yaml ---------------------------------------------------------------------------------------


def compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((MONITORING / name).read_text())


def interpolation_default(value: str) -> str:
    """A Compose value with ${VAR:-default} / ${VAR-default} / ${VAR} replaced by what it is when unset."""
    return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def dcgm_port() -> int:
    command = compose()["services"]["dcgm-exporter"]["command"]
    address = interpolation_default(command[command.index("-a") + 1])
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("name", ["compose.yaml", "compose.podman.yaml"])
def test_compose_files_follow_the_compose_specification(name):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (docker/requirements-dev.txt)")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose(name)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_services_and_the_podman_overlay():
    services = compose()["services"]
    assert set(services) == {"prometheus", "grafana", "dcgm-exporter"}
    assert set(compose("compose.podman.yaml")["services"]) <= set(services)
    assert all(s["network_mode"] == "host" for s in services.values())  # the trainers' ports are host ports
    gpus = services["dcgm-exporter"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_images_are_pinned_to_a_version():
    for name, service in compose()["services"].items():
        image = service["image"]
        match = re.fullmatch(r"[\w.\-/]+:([\w.\-]+)(@sha256:[0-9a-f]{64})?", image)
        assert match, f"{name}: image {image!r} has no tag"
        assert "latest" not in match.group(1) and re.search(r"\d+\.\d+\.\d+", match.group(1)), \
            f"{name}: {image!r} is not pinned to an exact version"


def test_mounts_are_files_of_the_repository_or_declared_volumes():
    spec = compose()
    mounts = {}
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source, target, *_ = interpolation_default(volume).split(":")
            mounts.setdefault(name, {})[target] = source
            if source.startswith((".", "/")):
                assert (MONITORING / source).exists(), f"{name}: mounts {source}, which is not in docker/monitoring"
            else:
                assert source in spec["volumes"], f"{name}: volume {source!r} is not declared"
    # each service reads its configuration at the paths it is mounted to
    prom = spec["services"]["prometheus"]["command"]
    config = next(a.split("=", 1)[1] for a in prom if a.startswith("--config.file="))
    assert mounts["prometheus"]["/etc/prometheus"] == "./prometheus" and config == "/etc/prometheus/prometheus.yml"
    assert mounts["prometheus"]["/etc/prometheus/targets"] == "./prometheus/targets"
    dcgm = spec["services"]["dcgm-exporter"]["command"]
    assert mounts["dcgm-exporter"][dcgm[dcgm.index("-f") + 1]] == "./dcgm-counters.csv"
    grafana = spec["services"]["grafana"]
    assert mounts["grafana"]["/etc/grafana/provisioning"] == "./grafana/provisioning"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/finetune.yaml").read_text())
    dashboards = provider["providers"][0]["options"]["path"]
    assert mounts["grafana"][dashboards] == "./grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards}/{DASHBOARD.name}"


def test_ports_agree_between_compose_prometheus_and_grafana():
    services = compose()["services"]
    listen = next(a for a in services["prometheus"]["command"] if a.startswith("--web.listen-address="))
    datasources = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    # host network: Grafana reaches Prometheus on this host's loopback, where it listens by default
    assert f"http://{interpolation_default(listen.split('=', 1)[1])}" == source["url"] == "http://127.0.0.1:9090"
    interval = yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == interval  # Grafana's $__rate_interval spans 4 scrapes
    assert dcgm_port() == 9400  # the exporter's default, and the example targets' (checked above)


# --- locked by default: no known credential, nothing open that need not be ---------------------------------


def lock_problems(spec: dict) -> list[str]:
    """What in a compose file would start the stack with a credential anyone knows, or listen wider than it must."""
    problems = []
    grafana = {k: str(v) for k, v in spec["services"]["grafana"].get("environment", {}).items()}
    password = grafana.get("GF_SECURITY_ADMIN_PASSWORD", "")
    if not re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password):  # required: no default, no literal
        problems.append(f"Grafana's admin password is {password!r}, not a required ${{GRAFANA_ADMIN_PASSWORD:?...}}")
    if re.search(r"(?i)admin", interpolation_default(re.sub(r"\$\{\w+:\?[^}]*\}", "", password))):
        problems.append("Grafana's admin password is admin, or defaults to it")
    if interpolation_default(grafana.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() not in ("0", "false"):
        problems.append("anonymous viewing is on unless asked for")
    command = spec["services"]["prometheus"]["command"]
    listen = interpolation_default(next(a for a in command if a.startswith("--web.listen-address=")).split("=", 1)[1])
    if not listen.startswith(("127.0.0.1:", "[::1]:")):
        problems.append(f"Prometheus listens on {listen!r} by default, not on loopback")
    return problems


def test_the_stack_starts_with_no_known_password_and_prometheus_on_loopback():
    assert lock_problems(compose()) == []


@pytest.mark.parametrize(("change", "caught"), [
    (lambda g, p: g.update(GF_SECURITY_ADMIN_PASSWORD="${GRAFANA_ADMIN_PASSWORD:-admin}"), "admin password"),
    (lambda g, p: g.update(GF_SECURITY_ADMIN_PASSWORD="admin"), "admin password"),
    (lambda g, p: g.update(GF_AUTH_ANONYMOUS_ENABLED="true"), "anonymous viewing"),
    (lambda g, p: p.__setitem__(p.index(next(a for a in p if a.startswith("--web.listen-address="))),
                                "--web.listen-address=:9090"), "not on loopback"),
])
def test_the_lock_check_catches_a_default_admin_password_and_an_open_prometheus(change, caught):
    """Negative controls: the compose file as it was (admin by default, anonymous viewers, Prometheus on every
    interface), one change at a time."""
    spec = compose()
    change(spec["services"]["grafana"]["environment"], spec["services"]["prometheus"]["command"])
    assert any(caught in problem for problem in lock_problems(spec)), lock_problems(spec)


def test_the_makefile_gives_no_default_password():
    makefile = (REPO / "Makefile").read_text()
    # a make variable with a value, a shell default other than the generated file's, or admin itself
    defaults = re.compile(r"^(export +)?GRAFANA_ADMIN_PASSWORD *[:?+]?=|GRAFANA_ADMIN_PASSWORD:-(?!\$\$\(cat )|"
                          r"PASSWORD=admin\b", re.MULTILINE)
    assert not defaults.search(makefile)
    assert defaults.search(makefile + "GRAFANA_ADMIN_PASSWORD ?= admin\n")  # the control: a default is caught


def make_monitor(tmp_path: Path, *args: str, env: dict | None = None, target: str = "monitor"):
    """``make monitor`` with a stand-in for the container engine that records its arguments and the environment
    compose would read; the monitoring folder under ``tmp_path``."""
    import os

    engine = tmp_path / "bin/docker"
    if not engine.exists():
        engine.parent.mkdir(parents=True)
        engine.write_text('#!/usr/bin/env bash\nprintf "%s|%s|%s\\n" "$*" "$GRAFANA_ADMIN_PASSWORD" '
                          '"$GRAFANA_ANONYMOUS" >> "$ENGINE_LOG"\n')
        engine.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFANA_", "PROMETHEUS_"))} | (env or {})
    proc = subprocess.run(["make", "--no-print-directory", target, f"CONTAINER={engine}",
                           f"MONITOR_OUT={tmp_path / 'monitoring'}", "NODES=localhost", "GPUS_PER_NODE=2", *args],
                          cwd=REPO, env=env | {"ENGINE_LOG": str(tmp_path / "engine.log")}, text=True,
                          capture_output=True, timeout=60)
    calls = (tmp_path / "engine.log").read_text().splitlines() if (tmp_path / "engine.log").exists() else []
    return proc, [dict(zip(("args", "password", "anonymous"), call.split("|"), strict=True)) for call in calls]


def test_make_monitor_generates_a_password_once_keeps_it_to_the_user_and_never_prints_it(tmp_path):
    proc, calls = make_monitor(tmp_path)
    assert proc.returncode == 0, proc.stderr
    kept = tmp_path / "monitoring/grafana-admin-password"
    password = kept.read_text()
    assert re.fullmatch(r"[0-9a-f]{48}", password)  # 192 random bits
    assert kept.stat().st_mode & 0o777 == 0o600
    assert calls == [{"args": "compose -f docker/monitoring/compose.yaml up -d", "password": password,
                      "anonymous": "0"}]
    assert password not in proc.stdout + proc.stderr and str(kept) in proc.stdout
    assert "a login to view" in proc.stdout and "Prometheus: 127.0.0.1:9090" in proc.stdout
    again, calls = make_monitor(tmp_path)  # a later start reuses it
    assert again.returncode == 0 and calls[-1]["password"] == password == kept.read_text()
    assert password not in again.stdout + again.stderr


def test_make_monitor_takes_your_password_and_anonymous_viewing_when_asked(tmp_path):
    proc, calls = make_monitor(tmp_path, "GRAFANA_ANONYMOUS=1", env={"GRAFANA_ADMIN_PASSWORD": "correct-horse"})
    assert proc.returncode == 0, proc.stderr
    assert calls == [{"args": "compose -f docker/monitoring/compose.yaml up -d", "password": "correct-horse",
                      "anonymous": "1"}]
    assert not (tmp_path / "monitoring/grafana-admin-password").exists()  # nothing generated
    assert "correct-horse" not in proc.stdout + proc.stderr and "open to anyone who reaches the port" in proc.stdout
    bad, calls_after = make_monitor(tmp_path, "GRAFANA_ANONYMOUS=yes")
    assert bad.returncode != 0 and calls_after == calls  # refused before anything starts
    assert "GRAFANA_ANONYMOUS=yes: 1 lets anyone who reaches Grafana's port view the dashboards" in bad.stderr
    down, calls = make_monitor(tmp_path, target="monitor-down")
    assert down.returncode == 0 and calls[-1]["args"] == "compose -f docker/monitoring/compose.yaml down"
