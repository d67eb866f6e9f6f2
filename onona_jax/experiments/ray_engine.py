"""`sweep --engine=ray`: a grid's arm × seed runs on a Ray cluster (`--address=auto|HOST:PORT`),
placed, gang-started and relaunched by Ray, accounted by `fleet`; the workdir stays the source of
truth, so the driver can die and be rerun.

* One host a run (a CPU or GPU host, a single-host TPU slice): one Ray task running the run's
  train.py then eval.py commands (`grids.commands`, as the local sweep runs them) with the
  resources it asks (`Placement`).
* Several hosts a run (`--hosts=N`, or a multi-host `--tpu` slice): a gang, one actor per host in
  one placement group (`STRICT_SPREAD`; for a TPU, Ray's slice placement,
  `ray.util.tpu.slice_placement_group`), each member's train.py given the JAX coordinator (member
  0's node, a free port there), the process count and its process id (`JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; on a TPU slice `ONONA_DISTRIBUTED=1`, JAX finds its
  peers). If one member ends otherwise than done, or its actor dies, every member is killed and
  the gang restarted whole. eval.py runs on member 0 alone.

Ray's own retries (`max_retries`) are off: each attempt comes back to the driver, which counts it
(`fleet.account`: a lost node or SIGTERM is a pre-emption, an `error:` exit a failure) and submits
the next one within the budgets. A driver thread a run; Ray queues what does not fit.

Ray's dashboard and job API have no authentication: this module starts no cluster (it connects
to one) and the docs say how to reach a real cluster safely (docs/pods.md, "A grid on a fleet").
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import sys
import tempfile
import threading

from onona_jax import cli, paths
from onona_jax.experiments import fleet, grids

PROGRESS_S = 30.0  # a progress line per running run this often
BUSY_WAIT_S = 10.0  # before trying again a run whose workdir another live run holds
GANG_GRACE_S = 30.0  # how long a gang's other members are awaited once one has failed
CONNECT_TIMEOUT_S = 10.0
JAX_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "ONONA_DISTRIBUTED")
# Mounted file systems every host of a cluster can share (a local path on one of them is refused
# when the cluster spans machines).
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "fuse.gcsfuse",
             "fuse.sshfs", "fuse.juicefs", "fuse.s3fs", "fuse.mountpoint-s3", "virtiofs")
TPU_NAMES = {"v5e": "v5litepod"}  # --tpu's names -> Ray's accelerator versions
ADDRESS = re.compile(r"(auto|(ray://)?[A-Za-z0-9.\-]+:\d{1,5})")


@dataclasses.dataclass(frozen=True)
class Placement:
    """What one run asks of the cluster: `hosts` (a gang if more than one), per host `cpus` and
    `gpus`; `tpu` = "<version>:<topology>" (e.g. "v5e:4x4", "v6e:2x4") places the run on a
    whole TPU slice by Ray's TPU slice placement instead."""

    hosts: int = 1
    cpus: float = 1
    gpus: float = 0
    tpu: str = ""


def import_ray():
    try:
        import ray
    except ImportError:
        raise cli.UsageError("--engine=ray needs Ray: pip install 'onona-jax[ray]' (ray==2.60.0)") from None
    return ray


def check_flags(address: str, placement: Placement, budgets: fleet.Budgets):
    """Every --engine=ray flag, before anything starts (one `error:` line: `cli.UsageError`)."""
    if not ADDRESS.fullmatch(address or ""):
        raise cli.UsageError(f"--address={address}: expected auto or HOST:PORT of the Ray cluster's head "
                             "(e.g. 127.0.0.1:6379)")
    if placement.tpu and placement.hosts != 1:
        raise cli.UsageError(f"--hosts with --tpu: a TPU slice's hosts follow from its topology ({placement.tpu})")
    if placement.hosts < 1 or placement.cpus < 0 or placement.gpus < 0:
        raise cli.UsageError("--hosts must be at least 1 and --cpus, --gpus at least 0")
    ray = import_ray()
    if placement.tpu:
        from ray.util import tpu as ray_tpu

        version, topology = tpu_slice(placement.tpu)
        if version not in ray_tpu.VALID_TPU_TYPES or not re.fullmatch(r"\d+(x\d+)+", topology):
            raise cli.UsageError(f"--tpu={placement.tpu}: expected <version>:<topology>, e.g. v5e:4x4, v6e:2x4 "
                                 f"(versions: v5e, {', '.join(ray_tpu.VALID_TPU_TYPES)})")
    if budgets.max_failures < 0 or (budgets.max_preemptions is not None and budgets.max_preemptions < 0):
        raise cli.UsageError("--max_failures and --max_preemptions must be at least 0")
    return ray


def _reachable(address: str) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def _local_ip_towards(address: str) -> str:
    """This host's address on the route to the cluster's head (a UDP socket's connect sends
    nothing), so that Ray need not probe a public address to learn it."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return s.getsockname()[0]


def connect(address: str):
    """ray.init on the running cluster at `address`, quietly; a cluster that is not there is one
    `error:` line. Nothing is started: no local cluster, no dashboard."""
    ray = import_ray()
    own = {}
    if address != "auto":
        if not _reachable(address):
            raise cli.UsageError(f"--address={address}: nothing answers there; start the cluster's head "
                                 "(ray start --head) or give its HOST:PORT")
        if not address.startswith("ray://"):
            own = {"_node_ip_address": _local_ip_towards(address)}
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, **own)
    except ConnectionError as err:
        raise cli.UsageError(f"--address={address}: no Ray cluster ({str(err).splitlines()[0]}); start one "
                             "(ray start --head) or give its HOST:PORT") from None
    return ray


def mount_type(p: str) -> str:
    """The file system type of the mount holding local path p (/proc/mounts)."""
    p = os.path.realpath(p)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def check_storage(ray, workdir: str):
    """A workdir every node can reach: a bucket, a shared file system, or any path when all the
    cluster's nodes are on this one machine."""
    machines = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
    if len(machines) > 1 and not paths.is_cloud(workdir) and mount_type(workdir) not in SHARED_FS:
        raise cli.UsageError(
            f"--workdir={workdir} is a local path ({mount_type(workdir) or 'unknown'} file system) but the Ray "
            f"cluster's nodes are on {len(machines)} machines ({', '.join(machines[:3])}"
            f"{', ...' if len(machines) > 3 else ''}); give a bucket (gs://...) or a shared file system every "
            "node mounts at the same path")


# ---------------------------------------------------------------------------------- on the workers


def _logs(run_workdir: str) -> tuple[str, str | None]:
    """(local log dir, bucket log dir to copy it to or None)."""
    logs = paths.Workdir(run_workdir).logs
    if paths.is_cloud(logs):
        return tempfile.mkdtemp(prefix="onona-fleet-log-"), logs
    return logs, None


def _run_stages(argvs, attempt_no: int, workdir: str, env: dict | None, suffix: str = "",
                gang: bool = False) -> list[dict]:
    log_dir, upload_to = _logs(workdir)
    env = {k: v for k, v in os.environ.items() if k not in JAX_ENV} | (env or {})
    results = fleet.attempt(argvs, grids.repo_root(), log_dir, attempt_no, env, suffix,
                            signal.SIGKILL if gang else signal.SIGTERM)
    import ray

    for r in results:
        r["node"] = f"{r.pop('host')} ({ray.get_runtime_context().get_node_id()[:12]})"
    if upload_to:
        for name in os.listdir(log_dir):
            paths.upload(os.path.join(log_dir, name), paths.join(upload_to, name))
    return results


def _commands(arm, seed, sweepdir, extra, python):
    return grids.commands(arm, seed, sweepdir, extra, python or sys.executable)  # (the worker's interpreter)


def run_task(arm: dict, seed: int, sweepdir: str, extra, python, attempt_no: int) -> list[dict]:
    """One attempt of a one-host run, on a worker: train then eval."""
    run = fleet.Run(arm, seed, sweepdir)
    return _run_stages(_commands(arm, seed, sweepdir, extra, python), attempt_no, run.workdir, None)


class Member:
    """One host of a gang (a Ray actor)."""

    def coordinator(self) -> str:
        """HOST:PORT for the JAX coordinator on this node (a free port)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(self, argvs, attempt_no: int, workdir: str, env: dict, suffix: str) -> list[dict]:
        return _run_stages(argvs, attempt_no, workdir, env, suffix, gang=True)


# ---------------------------------------------------------------------------------- the driver


class Engine:
    """Runs `runs` on the connected cluster until each is done, failed past its budget, or
    pre-empted past its; one driver thread per run, Ray queues what does not fit yet."""

    def __init__(self, ray, runs, budgets: fleet.Budgets, placement: Placement, extra=(), python=None, log=print):
        self.ray, self.runs, self.budgets, self.placement = ray, runs, budgets, placement
        self.extra, self.python, self.log = list(extra), python, log
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.task = ray.remote(run_task).options(
            num_cpus=placement.cpus, num_gpus=placement.gpus, max_retries=0, retry_exceptions=False,
            **({"resources": {"TPU": _tpu_chips(placement.tpu)}} if placement.tpu else {}))

    def say(self, line: str):
        with self.lock:
            self.log(line)

    # (a thread per run)
    def drive(self, run: fleet.Run):
        rec = fleet.load(run)
        before = rec["preemptions"], rec["failures"]
        while not self.stop.is_set():
            if fleet.is_done(run):
                rec["state"] = "done"
                fleet.save(run, rec)
                self.say(f"{run.key}: done")
                return
            n = len(rec["attempts"]) + 1
            rec = fleet.started(run, rec)
            self.say(f"{run.key}: attempt {n} from step {rec['step']}/{run.steps}")
            how, error, stage, rc, node = self.attempt(run, n)
            if self.stop.is_set():
                return
            again = fleet.account(run, rec, how, self.budgets, error, stage, rc, node, before)
            if how == "done" or not again:
                self.say(f"{run.key}: done" if how == "done" else
                         f"{run.key}: {how} ({error}) at step {rec['step']}/{run.steps}; giving up")
                return
            why = f" ({error})" if error else ""
            self.say(f"{run.key}: {how}{why} at step {rec['step']}/{run.steps}; trying again")
            if how == "busy":
                self.stop.wait(BUSY_WAIT_S)

    def attempt(self, run: fleet.Run, n: int):
        """(outcome, error line, stage, returncode, node) of one attempt."""
        if self.placement.hosts > 1 or (self.placement.tpu and _tpu_hosts(self.placement.tpu) > 1):
            return self.gang(run, n)
        ref = self.task.remote(run.arm, run.seed, run.sweepdir, self.extra, self.python, n)
        return self.result(ref)

    def result(self, ref):
        """(outcome, error line, stage, returncode, node) of an attempt's task or member."""
        ray = self.ray
        try:
            results = ray.get(ref)
        except ray.exceptions.RayTaskError as err:  # the task's own code raised: a failure
            return "failed", fleet.error_line(str(err)), "", None, ""
        except ray.exceptions.RayError as err:  # the worker, its node or its actor died: a pre-emption
            return _lost(err)
        last = results[-1]
        return (last["outcome"], fleet.error_line(last["stderr_tail"]) if last["outcome"] != "done" else "",
                last["stage"], last["returncode"], last["node"])

    def gang(self, run: fleet.Run, n: int):
        """One attempt of a multi-host run: every member started together, all killed if one ends
        otherwise than done."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = self.placement
        spg = None
        if p.tpu:
            from ray.util import tpu

            version, topology = tpu_slice(p.tpu)
            spg = tpu.slice_placement_group(topology, version)
            pg, hosts, per_host = spg.placement_group, spg.num_hosts, {"TPU": spg.chips_per_host}
        else:
            hosts, per_host = p.hosts, {"CPU": p.cpus, **({"GPU": p.gpus} if p.gpus else {})}
            pg = ray.util.placement_group([dict(per_host) for _ in range(hosts)], strategy="STRICT_SPREAD")
        actor = ray.remote(Member)
        members = []
        try:
            ray.get(pg.ready())
            members = [actor.options(
                num_cpus=per_host.get("CPU", 0), num_gpus=per_host.get("GPU", 0), max_restarts=0,
                resources={"TPU": per_host["TPU"]} if "TPU" in per_host else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote() for i in range(hosts)]
            train, ev = _commands(run.arm, run.seed, run.sweepdir, self.extra, self.python)
            env = {"ONONA_DISTRIBUTED": "1"} if p.tpu else {
                "JAX_COORDINATOR_ADDRESS": ray.get(members[0].coordinator.remote()),
                "JAX_NUM_PROCESSES": str(hosts)}
            refs = [m.run.remote([train], n, run.workdir, env if p.tpu else {**env, "JAX_PROCESS_ID": str(i)},
                                 f".p{i}") for i, m in enumerate(members)]
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                how = self.result(ready[0])
                if how[0] == "pre-empted" or (how[0] != "done" and not pending):
                    return how  # (the members are killed below: never half a run)
                if how[0] != "done":  # a member that failed because a peer died: the peer's loss decides
                    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=GANG_GRACE_S)
                    lost = [h for h in map(self.result, ready) if h[0] == "pre-empted"]
                    return lost[0] if lost else how
            return self.result(members[0].run.remote([ev], n, run.workdir, {}, ""))
        except ray.exceptions.RayError as err:
            return _lost(err)
        finally:
            for m in members:
                ray.kill(m)
            if spg is not None:
                spg.shutdown()
            else:
                ray.util.remove_placement_group(pg)

    def run(self) -> dict:
        threads = [threading.Thread(target=self.drive, args=(r,), name=r.key, daemon=True) for r in self.runs]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(PROGRESS_S / len(threads))
                for r in self.runs:
                    rec = fleet.state(r)
                    if rec["state"] == "running":
                        self.say(f"{r.key}: running, step {rec['step']}/{r.steps}")
        except KeyboardInterrupt:
            self.stop.set()
            raise cli.Interrupted("the sweep's driver stopped; its runs stop with it (they saved their last "
                                  "checkpoint); rerun the same command to resume them") from None
        return {r.key: fleet.state(r) for r in self.runs}


def _lost(err) -> tuple:
    """A worker, actor or node that died under an attempt: a pre-emption."""
    return "pre-empted", f"lost: {type(err).__name__}: {str(err).strip().splitlines()[0][:200]}", "", None, ""


def tpu_slice(tpu: str) -> tuple[str, str]:
    """(Ray's accelerator version, topology) of --tpu=<version>:<topology> (v5e is Ray's v5litepod)."""
    version, _, topology = tpu.partition(":")
    return TPU_NAMES.get(version, version), topology


def _tpu_chips(tpu: str) -> int:
    from ray.util import tpu as ray_tpu

    return ray_tpu.get_num_chips_from_topology(tpu_slice(tpu)[1])


def _tpu_hosts(tpu: str) -> int:
    from ray.util import tpu as ray_tpu

    version, topology = tpu_slice(tpu)
    return max(1, _tpu_chips(tpu) // ray_tpu.get_chips_per_host(topology, version))


def run_sweep(address: str, runs, budgets: fleet.Budgets, placement: Placement, extra=(), python=None,
              log=print, ray=None) -> dict:
    """The runs on the cluster at `address` (already connected when `ray` is given); their states."""
    ray = ray or connect(address)
    return Engine(ray, runs, budgets, placement, extra, python, log).run()
