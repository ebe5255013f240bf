"""Every recipe's Kubernetes manifests (recipes/*/k8s/) against the Kubeflow APIs and the house rules.

Two APIs, checked as an API server with strict field validation (kubectl's default) would check them:

- ``trainjob.yaml``: a Kubeflow Trainer v2 ``TrainJob``, by the published models (PyPI
  ``kubeflow-trainer-api``, pydantic: strict types; their ``from_dict`` drops unknown fields
  silently, so every field of the manifest must also survive the model's round trip) and by the
  CRD's OpenAPI schema (kubeflow/trainer v2.3.0).
- ``pytorchjob.yaml``: a training-operator v1 ``PyTorchJob``, by the CRD's OpenAPI schema
  (kubeflow/training-operator release-1.9). Its PyPI SDK, ``kubeflow-training``, cannot judge a
  manifest: its swagger-codegen models ignore unknown keys, convert types and need the whole
  Kubernetes client.

The schemas are vendored in ``k8s_schemas/`` (``vendor.py`` says how). As the API server does, an
object that lists its properties refuses others unless it says
``x-kubernetes-preserve-unknown-fields``. CEL rules (``x-kubernetes-validations``), admission
webhooks and the runtime's own defaults are not seen here (docs/kubernetes.md).

The helpers at the top (loading a manifest, its training container, the variables each controller
injects) are also used by tests/recipes/test_k8s_launch.py, which runs the manifests' commands.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.harness import REPO

SCHEMAS = Path(__file__).parent / "k8s_schemas"
RECIPES = sorted(p.parent for p in (REPO / "recipes").glob("*/train.py"))
MANIFESTS = sorted(REPO.glob("recipes/*/k8s/*.yaml"))
KINDS = {"trainjob.yaml": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
         "pytorchjob.yaml": ("kubeflow.org/v1", "PyTorchJob")}

# What each controller sets in the training container, by name; the values: controller_env().
# kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch.go, pkg/constants/constants.go:
TRAINJOB_INJECTS = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
# kubeflow/training-operator release-1.9 pkg/controller.v1/pytorch/envvar.go and master.go, with a
# Master replica and nprocPerNode set (without elasticPolicy):
PYTORCHJOB_INJECTS = {"MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "WORLD_SIZE", "RANK",
                      "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_NNODES", "PYTHONUNBUFFERED"}
RETRYABLE_EXIT = 143  # what a stopped, unfinished run exits with (128 + SIGTERM)
MIN_GRACE_S = 300  # the Slurm scripts' warning before the time limit (--signal=USR1@300)


# ---- reading a manifest ----

def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def training_container(doc: dict) -> dict:
    """The training container as the pod will have it: a TrainJob's ``trainer`` (image, command, env,
    resources), a PyTorchJob's Master container."""
    if doc["kind"] == "TrainJob":
        return doc["spec"]["trainer"]
    return doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def pod_spec(doc: dict) -> dict:
    """The pod spec (a TrainJob: its patch of the runtime's ``node`` pods)."""
    if doc["kind"] == "TrainJob":
        (patch,) = doc["spec"]["runtimePatches"]
        (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert job["name"] == "node", "the torch-distributed runtime's replicated job is named node"
        return job["template"]["spec"]["template"]["spec"]
    return doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def volume_mounts(doc: dict) -> list[dict]:
    if doc["kind"] == "TrainJob":
        (container,) = pod_spec(doc)["containers"]
        assert container["name"] == "node", "the torch-distributed runtime's training container is named node"
        return container["volumeMounts"]
    return training_container(doc)["volumeMounts"]


def command(doc: dict) -> list[str]:
    container = training_container(doc)
    return [*container.get("command", []), *container.get("args", [])]


def script(doc: dict) -> str:
    cmd = command(doc)
    assert cmd[:2] == ["bash", "-c"] and len(cmd) == 3, cmd
    return cmd[2]


def manifest_env(doc: dict) -> dict[str, str]:
    """The container's ``env`` entries with a value (``valueFrom`` ones, a Secret's, are left out)."""
    return {e["name"]: e["value"] for e in training_container(doc)["env"] if "value" in e}


def nodes_and_procs(doc: dict) -> tuple[int, int]:
    if doc["kind"] == "TrainJob":
        return doc["spec"]["trainer"]["numNodes"], doc["spec"]["trainer"]["numProcPerNode"]
    return (sum(r["replicas"] for r in doc["spec"]["pytorchReplicaSpecs"].values()),
            int(doc["spec"]["nprocPerNode"]))


def with_procs_per_node(doc: dict, nproc: int) -> dict:
    """The same manifest with ``nproc`` processes per node (a CPU test runs 1 or 2, not 4 or 8)."""
    doc = copy.deepcopy(doc)
    if doc["kind"] == "TrainJob":
        doc["spec"]["trainer"]["numProcPerNode"] = nproc
    else:
        doc["spec"]["nprocPerNode"] = str(nproc)
    return doc


def main_host(doc: dict) -> str:
    """The name the controller gives node 0 (its pod's DNS name, or the Master's Service)."""
    name = doc["metadata"]["name"]
    return f"{name}-node-0-0.{name}" if doc["kind"] == "TrainJob" else f"{name}-master-0"


def controller_env(doc: dict, node_rank: int) -> dict[str, str]:
    """The variables the manifest's controller sets in node ``node_rank``'s training container, as the
    sources cited at TRAINJOB_INJECTS and PYTORCHJOB_INJECTS compute them."""
    nodes, nproc = nodes_and_procs(doc)
    if doc["kind"] == "TrainJob":
        return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(node_rank),
                "PET_MASTER_ADDR": main_host(doc), "PET_MASTER_PORT": str(TRAINER_PORT)}
    (port,) = [p["containerPort"] for p in training_container(doc)["ports"] if p["name"] == "pytorchjob-port"]
    return {"MASTER_ADDR": main_host(doc), "MASTER_PORT": str(port), "PET_MASTER_ADDR": main_host(doc),
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * nproc), "RANK": str(node_rank),
            "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": str(nproc), "PET_NNODES": str(nodes),
            "PYTHONUNBUFFERED": "1"}


# ---- validation ----

def strict(schema):
    """The schema with unknown fields refused wherever the API server refuses them (strict field
    validation): every object that lists its properties and neither preserves unknown fields nor
    describes additional ones."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({name: strict(sub) for name, sub in v.items()} if k == "properties" else strict(v))
           for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


VALIDATORS = {kind: jsonschema.Draft7Validator(strict(json.loads((SCHEMAS / f"{kind.lower()}.json").read_text())))
              for kind in ("TrainJob", "PyTorchJob")}


def crd_errors(doc: dict) -> list[str]:
    """Where ``doc`` breaks its CRD's schema: one line per error, with the field's path."""
    errors = VALIDATORS[doc["kind"]].iter_errors(doc)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


def lost_in_round_trip(sent, back, path: str = "") -> list[str]:
    """Fields of ``sent`` that ``back`` lacks or changed: what the models dropped or converted."""
    if isinstance(sent, dict) and isinstance(back, dict):
        return [p for key, value in sent.items() for p in (
            lost_in_round_trip(value, back[key], f"{path}.{key}") if key in back else [f"{path}.{key}"])]
    if isinstance(sent, list) and isinstance(back, list) and len(sent) == len(back):
        return [p for i, (a, b) in enumerate(zip(sent, back, strict=True))
                for p in lost_in_round_trip(a, b, f"{path}[{i}]")]
    return [] if sent == back and type(sent) is type(back) else [f"{path}: {sent!r} came back as {back!r}"]


def trainer_api_errors(doc: dict) -> list[str]:
    """Where ``doc`` breaks the kubeflow-trainer-api models: their validation error, or the fields
    they do not know."""
    import pydantic
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    try:
        model = TrainerV1alpha1TrainJob.from_dict(doc)
    except pydantic.ValidationError as error:
        return [str(error)]
    return lost_in_round_trip(doc, model.to_dict())


# ---- every manifest is a valid object of its API ----

def test_every_recipe_has_a_trainjob_and_a_pytorchjob():
    assert RECIPES
    for recipe in RECIPES:
        assert sorted(p.name for p in (recipe / "k8s").glob("*.yaml")) == sorted(KINDS), recipe.name


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_manifest_is_valid_by_its_crd_schema(path):
    doc = load(path)
    assert (doc["apiVersion"], doc["kind"]) == KINDS[path.name]
    assert crd_errors(doc) == []


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.name == "trainjob.yaml"],
                         ids=lambda p: p.parent.parent.name)
def test_trainjob_is_valid_by_the_kubeflow_trainer_api_models(path):
    assert trainer_api_errors(load(path)) == []


def edit(doc: dict, path: str, value=None, rename: str | None = None) -> dict:
    """A copy of ``doc`` with the field at dotted ``path`` set to ``value``, or renamed to ``rename``."""
    doc = copy.deepcopy(doc)
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = doc
    for key in parents:
        node = node[key]
    if rename:
        node[rename] = node.pop(last)
    else:
        node[last] = value
    return doc


TRAINJOB_PATCHED_POD = ("spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0"
                        ".template.spec.template.spec")
MISTAKES = {  # manifest, edit, a word of what the validation says
    "trainjob: a misspelled field": ("llama3-70b-qlora/k8s/trainjob.yaml",
                                    dict(path="spec.trainer.numProcPerNode", rename="numProcsPerNode"),
                                    "numProcsPerNode"),
    "trainjob: a number as a string": ("llama3-70b-qlora/k8s/trainjob.yaml",
                                      dict(path="spec.trainer.numNodes", value="2"), "numNodes"),
    "trainjob: a misspelled pod field in the patch": (
        "llama3-8b-zero3/k8s/trainjob.yaml",
        dict(path=f"{TRAINJOB_PATCHED_POD}.terminationGracePeriodSeconds", rename="terminationGracePeriod"),
        "terminationGracePeriod"),
    "pytorchjob: a misspelled field": ("llama3-70b-qlora/k8s/pytorchjob.yaml",
                                      dict(path="spec.pytorchReplicaSpecs.Worker.replicas", rename="replica"),
                                      "replica"),
    "pytorchjob: a number as a string": (
        "llama2-13b-zero2/k8s/pytorchjob.yaml",
        dict(path="spec.pytorchReplicaSpecs.Master.template.spec.terminationGracePeriodSeconds", value="600"),
        "terminationGracePeriodSeconds"),
    "pytorchjob: a misspelled volume source": (
        "llama3-8b-zero3/k8s/pytorchjob.yaml",
        dict(path="spec.pytorchReplicaSpecs.Master.template.spec.volumes.2.emptyDir", rename="emptydir"), "emptydir"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_schema_mistake_fails_the_validation(mistake):
    manifest, change, word = MISTAKES[mistake]
    doc = load(REPO / "recipes" / manifest)
    assert crd_errors(doc) == []  # the manifest itself is valid: the edit is what fails
    broken = edit(doc, **change)
    found = crd_errors(broken)
    assert found and any(word in line for line in found), found
    if doc["kind"] == "TrainJob":
        found = trainer_api_errors(broken)
        assert found and any(word in line for line in found), found


# ---- the house rules ----

@pytest.fixture(params=MANIFESTS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def manifest(request) -> tuple[str, dict]:
    return request.param.parent.parent.name, load(request.param)


def test_image_is_the_recipes_own_and_pinned_by_digest(manifest):
    recipe, doc = manifest
    assert re.fullmatch(rf"[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*/{recipe}@sha256:[0-9a-f]{{64}}",
                        training_container(doc)["image"])


def test_pod_has_shared_memory_gpus_volumes_and_the_token(manifest):
    _, doc = manifest
    pod, container = pod_spec(doc), training_container(doc)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in volume_mounts(doc)}
    assert set(mounts.values()) <= set(volumes), "every mount names a volume of the pod"
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm.get("medium") == "Memory" and shm.get("sizeLimit")

    env = manifest_env(doc)

    def claim_of(folder: str) -> str | None:
        """The PersistentVolumeClaim ``folder`` lies on (the deepest mount that holds it)."""
        holding = [m for m in mounts if folder == m or folder.startswith(m.rstrip("/") + "/")]
        volume = volumes[mounts[max(holding, key=len)]] if holding else {}
        return volume.get("persistentVolumeClaim", {}).get("claimName")

    for folder in (env["OUTPUT"], env["HF_HOME"], *env["DATA"].split()):
        assert claim_of(folder), f"{folder} is on no PersistentVolumeClaim"
    (token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert set(token) == {"name", "valueFrom"} and token["valueFrom"]["secretKeyRef"]["name"]

    nodes, nproc = nodes_and_procs(doc)
    assert container["resources" if doc["kind"] == "PyTorchJob" else "resourcesPerNode"]["limits"] == {
        "nvidia.com/gpu": str(nproc)}


def test_a_stopped_pod_checkpoints_in_time_and_is_restarted(manifest):
    _, doc = manifest
    assert pod_spec(doc)["terminationGracePeriodSeconds"] >= MIN_GRACE_S
    text = script(doc)
    # SIGTERM reaches PID 1 alone: the shell passes it on as SIGUSR1, which the launcher ignores
    assert "trap '' USR1" in text and "trap 'kill -USR1 -1' TERM" in text
    assert re.search(r'! -f "\$OUTPUT/run_record.json" \]; then\n.*exit ' + str(RETRYABLE_EXIT), text)
    if doc["kind"] == "TrainJob":
        assert doc["spec"]["runtimeRef"] == {"name": "torch-distributed"}  # JobSet: restartPolicy OnFailure
    else:
        specs = doc["spec"]["pytorchReplicaSpecs"]
        assert {s["restartPolicy"] for s in specs.values()} == {"OnFailure"}
        assert doc["spec"]["runPolicy"]["backoffLimit"] >= 10
        assert all(s["template"] == specs["Master"]["template"] for s in specs.values())
        assert training_container(doc)["name"] == "pytorch"


def test_command_reads_only_what_the_controller_and_the_manifest_set(manifest):
    _, doc = manifest
    text = script(doc)
    read = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
    local = set(re.findall(r"\b([a-z_]+)=", text))  # the script's own variables (cfg, status)
    injected = TRAINJOB_INJECTS if doc["kind"] == "TrainJob" else PYTORCHJOB_INJECTS
    defined = {e["name"] for e in training_container(doc)["env"]}
    assert read - local - injected - defined == set()
    assert read & injected, "rank, sizes and main address come from the controller"
    assert not defined & injected, "the controller's variables are not overridden"


def slurm_launch(recipe: str) -> tuple[str, str]:
    """The Slurm script's whole text and its launch command (from ``exec`` to the closing quote)."""
    text = (REPO / "recipes" / recipe / "slurm/train.sbatch").read_text()
    return text, re.search(r"exec (.*?)'", text, re.S).group(1)


def test_same_launcher_configs_and_flags_as_the_slurm_script(manifest):
    recipe, doc = manifest
    slurm, launch = slurm_launch(recipe)
    text = script(doc)
    env = manifest_env(doc)
    words = shlex.split(text.replace("\\\n", " "), comments=False, posix=False)
    assert launch.split()[0] in words  # the same launcher: accelerate or torchrun
    flags = set(re.findall(r"(?<![\w-])--[a-z_]+(?:-[a-z]+)*", launch))
    assert flags <= set(words), f"the Slurm script's flags the manifest lacks: {sorted(flags - set(words))}"
    configs = set(re.findall(r"configs/[\w.-]+", slurm))
    shown = set(re.findall(r"configs/[\w.-]+", text + " ".join(env.values())))
    assert configs == shown
    nodes, nproc = nodes_and_procs(doc)
    assert f"#SBATCH --nodes={nodes}\n" in slurm
    assert re.search(rf"(--gpus-per-node=|GPUS(?:_PER_NODE)?:-){nproc}\b", slurm)
