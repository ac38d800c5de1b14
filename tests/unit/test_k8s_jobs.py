"""The Kubernetes manifests: docker/k8s/*.yaml (the run as Jobs), docker/k8s/gpu/ (GPU workers)
and docker/k8s/jobset/ (the same run as one JobSet).

No cluster is needed. The manifests are validated against the Kubernetes API schemas when
kubernetes-validate is installed, and checked here for what makes a run end: every workload is
a Job that completes when its daemons exit 0, the scheduler's Job is never run again after its
run ended, ranks are completion indices (never derived from addresses), and each container's
command line, with its environment as the kubelet would expand it, passes the real CLI's
`--check`. A scheduler started on the directory of a finished run starts nothing.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest
import yaml
from test_deploy_files import (
    CPU_DOCKERFILE,
    DEFAULT_CONFIG,
    DOCKER,
    ROOT,
    dockerfile_entrypoint,
    map_paths,
    run_container_command,
    shim_path,  # noqa: F401 (a fixture)
    split_address,
)

from hetps.runconfig.load import config_from_dict, load_config

K8S = DOCKER / "k8s"
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_UID = "metadata.labels['batch.kubernetes.io/controller-uid']"
FAKE_UID = "0b7c6f1e-4a52-4a7e-9d1c-2f0e8f6a9b31"
PLAIN = {
    ("ConfigMap", "hetps-config"),
    ("PersistentVolumeClaim", "hetps-runs"),
    ("Service", "hetps"),
    ("Job", "hetps-scheduler"),
    ("Job", "hetps-ps"),
    ("Job", "hetps-worker"),
    ("Job", "hetps-evaluator"),
}
EXIT_BAD_CONFIG = 2
SCHEDULER_NO_RETRY = {1, 2, 3}  # failed, bad config, diverged: a new pod could only repeat it


def load(folder) -> dict[tuple[str, str], dict]:
    objects = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} defined twice"
            assert "namespace" not in doc["metadata"], f"{path.name}: {key} names a namespace"
            objects[key] = doc
    return objects


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    return load(K8S)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return load(K8S / "gpu")[("Job", "hetps-worker-gpu")]


@pytest.fixture(scope="module")
def jobset() -> dict:
    return load(K8S / "jobset")[("JobSet", "hetps")]


@pytest.fixture(scope="module")
def cfg(k8s):
    return config_from_dict(
        yaml.safe_load(k8s[("ConfigMap", "hetps-config")]["data"]["default.yaml"])
    )


def jobs(k8s, gpu) -> dict[str, dict]:
    return {
        **{name: obj for (kind, name), obj in k8s.items() if kind == "Job"},
        "hetps-worker-gpu": gpu,
    }


def container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict, index: int | None = None) -> dict[str, str]:
    """The container's environment as the kubelet makes it (downward API: index and Job uid)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in (INDEX, JOB_UID), (e["name"], path)
            env[e["name"]] = str(index) if path == INDEX else FAKE_UID
    return env


def k8s_expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ escapes; unknown names stay)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


# ---------------------------------------------------------------- objects and schemas
def test_objects(k8s, gpu, jobset):
    assert set(k8s) == PLAIN
    assert gpu["kind"] == "Job" and jobset["apiVersion"].startswith("jobset.x-k8s.io/")


def test_objects_match_the_api_schemas(k8s, gpu):
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate not installed: the manifests "
        "are checked by the structural tests here, not against the API schemas",
    )
    for obj in [*k8s.values(), gpu]:  # the JobSet is a CRD: no schema in kubernetes-validate
        # raises ValidationError naming the field
        kv.validate(obj, kv.latest_version(), strict=True)


def test_configmap_is_the_default_config(k8s, cfg):
    assert (
        k8s[("ConfigMap", "hetps-config")]["data"]["default.yaml"] == DEFAULT_CONFIG.read_text()
    ), "docker/k8s/configmap.yaml has drifted from configs/default.yaml"
    assert cfg == load_config(DEFAULT_CONFIG)


def test_no_rank_is_derived_from_an_address():
    for path in K8S.rglob("*.yaml"):
        text = path.read_text()
        assert not re.search(r"gethostbyname|ip_address|HOSTNAME##", text), path


# ---------------------------------------------------------------- runs that end
def test_every_workload_is_a_job_that_completes(k8s, gpu, cfg):
    for name, job in jobs(k8s, gpu).items():
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        assert "replicas" not in spec and spec["completions"] == spec["parallelism"] >= 1, name
        # never Always: an exit 0 ends the pod
        assert pod["restartPolicy"] in ("Never", "OnFailure"), name
        assert 1 <= spec["backoffLimit"] <= 10, name
        rules = spec.get("podFailurePolicy", {}).get("rules", [])
        if rules:
            assert pod["restartPolicy"] == "Never", (
                f"{name}: podFailurePolicy needs restartPolicy Never"
            )
            fail = [r for r in rules if r["action"] == "FailJob"]
            assert all(r["onExitCodes"]["containerName"] == container(job)["name"] for r in fail), (
                name
            )
            assert any(EXIT_BAD_CONFIG in r["onExitCodes"]["values"] for r in fail), (
                f"{name}: a bad config must fail the Job, not be retried"
            )
    assert k8s[("Job", "hetps-ps")]["spec"]["completions"] == len(cfg.cluster.shards)
    assert k8s[("Job", "hetps-worker")]["spec"]["completions"] == len(cfg.cluster.workers)
    assert k8s[("Job", "hetps-evaluator")]["spec"]["completions"] == 1


def test_a_finished_scheduler_is_never_started_again(k8s):
    job = k8s[("Job", "hetps-scheduler")]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    # exit 0 completes the Job: nothing restarts it
    assert spec["completions"] == spec["parallelism"] == 1
    assert pod["restartPolicy"] == "Never"
    (fail,) = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert (
        set(fail["onExitCodes"]["values"]) == SCHEDULER_NO_RETRY
        and fail["onExitCodes"]["operator"] == "In"
    )
    # the run directory is the Job's own: a replacement pod of this Job carries its run on,
    # and a new Job (a new run) never writes into an old run's directory
    args = container(job)["args"]
    run_dir = args[args.index("--run-dir") + 1]
    assert "$(HETPS_RUN_UID)" in run_dir
    uid = next(e for e in container(job)["env"] if e["name"] == "HETPS_RUN_UID")
    assert uid["valueFrom"]["fieldRef"]["fieldPath"] == JOB_UID


def test_indexed_ranks(k8s):
    for name in ("hetps-ps", "hetps-worker"):
        job = k8s[("Job", name)]
        assert job["spec"]["completionMode"] == "Indexed", name
        rank = next(e for e in container(job)["env"] if e["name"] == "HETPS_RANK")
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == INDEX, name


def test_pods_are_named_and_scraped(k8s, gpu):
    service = k8s[("Service", "hetps")]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    for name, job in jobs(k8s, gpu).items():
        template = job["spec"]["template"]
        pod, c = template["spec"], container(job)
        assert service["selector"].items() <= template["metadata"]["labels"].items(), name
        if name != "hetps-worker-gpu":  # reached by DNS: HOSTNAME.hetps
            assert pod["subdomain"] == "hetps", name
        port = int(env_of(c, 0)["HETPS_METRICS_PORT"])
        assert {"name": "metrics", "containerPort": port} in c["ports"], name
        notes = template["metadata"]["annotations"]
        assert (
            notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == port
        ), name
        assert env_of(c, 0)["HETPS_METRICS_HOST"] == "0.0.0.0", name
        assert c["resources"]["requests"].get("cpu") and c["resources"]["requests"].get("memory"), (
            name
        )
        if name != "hetps-scheduler":
            host, rpc = split_address(env_of(c, 0)["HETPS_SCHEDULER"])
            assert host == "hetps-scheduler.hetps" and rpc in [
                p["port"] for p in service["ports"]
            ], name
    assert (
        k8s[("Job", "hetps-scheduler")]["spec"]["template"]["spec"]["hostname"] == "hetps-scheduler"
    )


def test_gpu_workers(gpu):
    c = container(gpu)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "hetps:cuda"
    # no indices beside the CPU workers': claimed from the scheduler
    assert env_of(c)["HETPS_RANK"] == "auto"
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu["spec"]["template"]["spec"]["tolerations"])


# ---------------------------------------------------------------- the JobSet
def as_in_jobset(spec: dict) -> dict:
    """A plain Job's spec as the JobSet holds it: its pods named by the JobSet."""
    text = json.dumps(spec).replace("hetps-scheduler.hetps:7000", "hetps-scheduler-0-0.hetps:7000")
    text = text.replace(
        "tcp://hetps-ps-$(HETPS_RANK).hetps:", "tcp://hetps-ps-0-$(HETPS_RANK).hetps:"
    )
    out = json.loads(text)
    for key in ("hostname", "subdomain"):
        out["template"]["spec"].pop(key, None)
    return out


def test_jobset_completes_with_the_scheduler_and_fails_as_a_whole(k8s, jobset):
    spec = jobset["spec"]
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["scheduler"]}
    assert spec["failurePolicy"]["maxRestarts"] == 0
    assert spec["network"]["enableDNSHostnames"] is True and spec["network"]["subdomain"] == "hetps"
    replicated = {r["name"]: r for r in spec["replicatedJobs"]}
    assert set(replicated) == {"scheduler", "ps", "worker", "evaluator"}
    for name, r in replicated.items():
        assert r["replicas"] == 1, name
        expected = as_in_jobset(copy.deepcopy(k8s[("Job", f"hetps-{name}")]["spec"]))
        got = copy.deepcopy(r["template"]["spec"])
        got.pop("completionMode", None) if name in ("scheduler", "evaluator") else None
        expected.pop("completionMode", None) if name in ("scheduler", "evaluator") else None
        assert got == expected, (
            f"jobset/hetps.yaml's {name} has drifted from docker/k8s/{name}.yaml"
        )


# ---------------------------------------------------------------- command lines
def pods():
    """(source, job, index, expected --check values) for every kind of pod the manifests make."""
    plain, js = "tcp://hetps-scheduler.hetps:7000", "tcp://hetps-scheduler-0-0.hetps:7000"
    out = [
        (
            "k8s",
            "hetps-scheduler",
            0,
            {
                "role": "scheduler",
                "bind": "tcp://0.0.0.0:7000",
                "run_dir": f"/runs/default-{FAKE_UID}",
            },
        )
    ]
    out += [
        (
            "k8s",
            "hetps-ps",
            i,
            {
                "role": "ps",
                "rank": str(i),
                "bind": "tcp://0.0.0.0:7100",
                "advertise": f"tcp://hetps-ps-{i}.hetps:7100",
                "scheduler": plain,
                "replica_advertise": f"tcp://hetps-ps-{i}.hetps:7101",
            },
        )
        for i in range(2)
    ]
    out += [
        ("k8s", "hetps-worker", i, {"role": "worker", "rank": str(i), "scheduler": plain})
        for i in (0, 3)
    ]
    out += [
        ("k8s", "hetps-evaluator", 0, {"role": "evaluator", "scheduler": plain}),
        ("gpu", "hetps-worker-gpu", 0, {"role": "worker", "rank": "auto", "scheduler": plain}),
        (
            "jobset",
            "ps",
            1,
            {
                "role": "ps",
                "rank": "1",
                "advertise": "tcp://hetps-ps-0-1.hetps:7100",
                "replica_advertise": "tcp://hetps-ps-0-1.hetps:7101",
                "scheduler": js,
            },
        ),
        ("jobset", "worker", 2, {"role": "worker", "rank": "2", "scheduler": js}),
        ("jobset", "scheduler", 0, {"role": "scheduler", "run_dir": f"/runs/default-{FAKE_UID}"}),
    ]
    return [pytest.param(*p, id=f"{p[0]}-{p[1]}-{p[2]}") for p in out]


@pytest.mark.parametrize("source,name,index,expected", pods())
def test_container_command_passes_check(
    source, name, index, expected, k8s, gpu, jobset, tmp_path, shim_path
):
    if source == "jobset":
        job = next(r["template"] for r in jobset["spec"]["replicatedJobs"] if r["name"] == name)
    else:
        job = gpu if source == "gpu" else k8s[("Job", name)]
    c = container(job)
    # /configs is the ConfigMap: lay its files out as the kubelet would
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    for key, text in k8s[("ConfigMap", "hetps-config")]["data"].items():
        (config_dir / key).write_text(text)
    mounts = {"/configs": config_dir}
    env = {k: map_paths(v, mounts) for k, v in env_of(c, index).items()}
    entrypoint = c.get("command") or dockerfile_entrypoint(CPU_DOCKERFILE)
    argv = [k8s_expand(str(a), env) for a in [*entrypoint, *c.get("args", [])]]
    resolved = run_container_command(argv, env, shim_path)
    assert {k: resolved.get(k) for k in expected} == expected, resolved
    assert resolved["config"] == str(config_dir / "default.yaml")


def test_a_scheduler_on_a_finished_runs_directory_starts_nothing(tmp_path):
    """An orchestrator that starts the scheduler again after its run ended (same directory) gets exit 0
    and no new run: the old run's files stay as they were."""
    (tmp_path / "scheduler-state.json").write_text(json.dumps({"run_id": "r1", "finished": True}))
    (tmp_path / "summary.json").write_text('{"status": "completed"}')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetps.scheduler",
            "--run-dir",
            str(tmp_path),
            "--bind",
            "tcp://127.0.0.1:0",
            "eval.enabled=false",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "run r1" in done.stderr and "has finished" in done.stderr
    assert not (tmp_path / "scheduler.addr").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "completed"}
