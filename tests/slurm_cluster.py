"""A real Slurm cluster on this machine: Debian's slurmctld and two slurmd nodes, each node in its own
network namespace (10.205.0.1 and 10.205.0.2, both on an interface named eth0, as two hosts of a
site would be), one munged, everything under one folder.

    with slurm_cluster(tmp_path) as cluster:
        job = cluster.sbatch(["slurm/train.sbatch"], cwd=recipe, env={...})
        cluster.wait(job, "COMPLETED")

GPUs: Slurm drops a GPU GRES without device files ("Removing file-less GPU"), so each node declares
8 GPUs whose ``File=`` entries are character devices with /dev/null's numbers, made in the cluster's
folder; the scripts' ``--gpus-per-node`` is then accepted unchanged and Slurm sets
``CUDA_VISIBLE_DEVICES``, which torch's CPU build ignores. Nodes declare 64 CPUs on a 2-core machine
(``SlurmdParameters=config_overrides``), so ``--cpus-per-task`` and ``--exclusive`` are accepted too.
Processes are tracked without cgroups (``proctrack/linuxproc``). ``cred_expire=10`` lets a requeued
job start 10 s after its requeue instead of Slurm's default 120 s (the only timing changed).
Accounting (``sacct``): slurmdbd on a private MariaDB (its own data folder, on the controller
namespace's loopback, no grant tables), as a site's slurmdbd keeps its MySQL database.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.debian import ensure_debian_packages
from tests.harness import netns_unavailable, two_hosts

PACKAGES = {"slurmctld": ("slurmctld", "slurmd", "slurm-client", "munge"), "slurmdbd": ("slurmdbd",),
            "mariadbd": ("mariadb-server",)}  # a command each installs: its packages
ADDRESSES = ("10.205.0.1", "10.205.0.2")
NODES = ("node0", "node1")
QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # the daemons write their own log files


def unavailable() -> str | None:
    """Why a Slurm cluster cannot run here (None: it can); installs the packages if missing."""
    reason = netns_unavailable()
    if reason:
        return reason
    for command, packages in PACKAGES.items():
        ensure_debian_packages(*packages, present=command)
    return None


@dataclass
class Cluster:
    root: Path
    namespaces: tuple[str, str]

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def command(self, *args: str, check: bool = True, env: dict | None = None, cwd: Path | None = None,
                node: int = 0) -> subprocess.CompletedProcess:
        """A Slurm command run on ``node`` (the controller's is node 0)."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[node], *args], capture_output=True, text=True,
                              check=check, env={**self.env, **(env or {})}, cwd=cwd, timeout=60)

    def sbatch(self, args: list[str], cwd: Path, env: dict | None = None) -> int:
        """Submit from ``cwd`` with the submitting shell's environment plus ``env``; the job id."""
        out = self.command("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, StdOut, ...)."""
        text = self.command("scontrol", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, *states: str, timeout: float = 600) -> dict:
        """Poll until the job is in one of ``states``; fail early if it ends in another."""
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED"}
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            if info["JobState"] in ended or time.monotonic() > deadline:
                log = Path(info.get("StdOut", "")).read_text()[-4000:] if Path(info.get("StdOut", "")).is_file() \
                    else ""
                raise AssertionError(f"job {job_id} is {info['JobState']}, not {states}:\n{info}\n{log}")
            time.sleep(1)

    def sacct(self, job_id: int, fields: str = "JobID,JobName%20,State,ExitCode,NodeList,Start,Elapsed") -> str:
        """``sacct``'s table of the job and its steps, each requeued run included (``--duplicates``)."""
        return self.command("sacct", "--duplicates", "-j", str(job_id), "--format", fields).stdout

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*.log")))


def _config(root: Path, host: str) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={host} CPUs=64 RealMemory=8000 Gres=gpu:8"
                      for n, a in zip(NODES, ADDRESSES, strict=True))
    return f"""ClusterName=ftci
SlurmctldHost={host}({ADDRESSES[0]})
AuthType=auth/munge
AuthInfo=socket={root}/munge/sock,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={ADDRESSES[0]}
AccountingStoragePass={root}/munge/sock
ReturnToService=2
KillWait=5
MinJobAge=600
{nodes}
PartitionName=gpu Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _dbd_config(root: Path, host: str) -> str:
    return f"""DbdHost={host}
DbdAddr={ADDRESSES[0]}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/sock
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={root}/slurmdbd.pid
LogFile={root}/log/slurmdbd.log
"""


def _wait_for(check, what: str, timeout: float, logs) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s\n{logs()}")
        time.sleep(0.2)


def _cgroup_config() -> str:
    """cgroup.conf: which cgroup version this machine mounts (slurmd loads the plugin even when
    processes are tracked without it)."""
    if subprocess.run(["stat", "-fc", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip() \
            == "cgroup2fs":
        return "CgroupPlugin=cgroup/v2\nCgroupAutomount=no\n"
    return "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n"


@contextlib.contextmanager
def slurm_cluster(root: Path, start_timeout: float = 60):
    """Start munged, slurmctld and both slurmd; yield a :class:`Cluster` once both nodes are idle;
    stop every daemon and delete the namespaces whatever happens."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "log", "munge", "dev", *(f"spool-{n}" for n in NODES)):
        (root / sub).mkdir(exist_ok=True)
    daemons: list[subprocess.Popen] = []
    stack = contextlib.ExitStack()
    namespaces = ()
    try:
        namespaces, _, _ = stack.enter_context(two_hosts(ADDRESSES, interface="eth0"))
        for i in range(8):  # placeholder GPU device files: /dev/null's device numbers
            os.mknod(root / f"dev/gpu{i}", 0o666 | 0o020000, os.makedev(1, 3))
        key = root / "munge/key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        host = socket.gethostname().split(".")[0]
        (root / "slurm.conf").write_text(_config(root, host))
        (root / "gres.conf").write_text(f"AutoDetect=off\nNodeName={NODES[0]},{NODES[1]} Name=gpu "
                                        f"File={root}/dev/gpu[0-7]\n")
        (root / "cgroup.conf").write_text(_cgroup_config())
        conf = str(root / "slurm.conf")
        daemons.append(subprocess.Popen(
            ["munged", "--foreground", "--force", "-S", str(root / "munge/sock"), "--key-file", str(key),
             "--pid-file", str(root / "munge/pid"), "--log-file", str(root / "log/munge.log"),
             "--seed-file", str(root / "munge/seed")], **QUIET))
        cluster = Cluster(root, namespaces)
        _wait_for((root / "munge/sock").exists, "munged", 10, cluster.logs)
        env = {**os.environ, "SLURM_CONF": conf}
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={root}/db", "--user=root",
                        "--skip-test-db"], check=True, capture_output=True)
        daemons.append(subprocess.Popen(
            ["ip", "netns", "exec", namespaces[0], "mariadbd", "--no-defaults", f"--datadir={root}/db",
             f"--socket={root}/db.sock", "--bind-address=127.0.0.1", "--port=3306", "--user=root",
             "--skip-grant-tables", f"--log-error={root}/log/mariadb.log"], **QUIET))
        _wait_for((root / "db.sock").exists, "MariaDB", 30, cluster.logs)
        dbd = root / "slurmdbd.conf"
        dbd.write_text(_dbd_config(root, host))
        dbd.chmod(0o600)
        daemons.append(subprocess.Popen(["ip", "netns", "exec", namespaces[0], "slurmdbd", "-D"],
                                        env={**env, "SLURM_CONF": conf}, **QUIET))
        _wait_for(lambda: cluster.command("sacctmgr", "-i", "add", "cluster", "ftci", check=False).returncode == 0
                  or "ftci" in cluster.command("sacctmgr", "-n", "list", "cluster", check=False).stdout,
                  "slurmdbd", 30, cluster.logs)
        daemons.append(subprocess.Popen(["ip", "netns", "exec", namespaces[0], "slurmctld", "-D", "-f", conf],
                                        env=env, **QUIET))
        for name, node in zip(namespaces, NODES, strict=True):
            daemons.append(subprocess.Popen(["ip", "netns", "exec", name, "slurmd", "-D", "-f", conf, "-N", node],
                                            env=env, **QUIET))
        deadline = time.monotonic() + start_timeout
        while True:
            states = cluster.command("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            if states == [NODES[0], "idle", NODES[1], "idle"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm nodes did not come up idle: {states}\n{cluster.logs()}")
            time.sleep(0.5)
        yield cluster
    finally:
        if len(daemons) > 1:  # jobs still running would outlive their slurmd
            subprocess.run(["ip", "netns", "exec", namespaces[0], "scancel", "--user", "root"], capture_output=True,
                           env={**os.environ, "SLURM_CONF": str(root / "slurm.conf")}, timeout=30)
        for proc in reversed(daemons):
            proc.terminate()
        for proc in reversed(daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        stack.close()
        shutil.rmtree(root / "dev", ignore_errors=True)
