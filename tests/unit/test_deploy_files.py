"""The deployment files: docker/Dockerfile, docker/Dockerfile.cuda and docker/docker-compose.yml
(the Kubernetes manifests: test_k8s_jobs.py, which uses the helpers here).

No Docker daemon or Kubernetes cluster is needed. The manifests are parsed and cross-checked
(names, selectors, volumes, addresses), `docker-compose config` validates the compose file
(skipped when Debian's docker-compose client is not installed; .ci/run installs it), and every
container's command line — its entrypoint, command and environment as the container would see
them, the config path mapped onto the files mounted there — is run through the real CLI with
`--check` appended, which parses flags, environment and config and prints the resolved role, rank
and addresses without connecting anywhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from hetps.runconfig.load import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
CPU_DOCKERFILE = DOCKER / "Dockerfile"
CUDA_DOCKERFILE = DOCKER / "Dockerfile.cuda"
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what pip needs to build hetps, as pyproject.toml says: its package folders and its readme
PACKAGE_DIRS = tuple(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
BUILD_FILES = ("pyproject.toml", PYPROJECT["project"]["readme"], *PACKAGE_DIRS)

COMPOSE_SERVICES = {
    "scheduler",
    "ps0",
    "ps1",
    "worker0",
    "worker1",
    "worker2",
    "worker3",
    "worker",
    "evaluator",
    "worker-gpu0",
    "worker-gpu1",
}
MONITORING_SERVICES = {"prometheus"}  # profile `monitoring`; checked in test_monitoring_files.py


# ---------------------------------------------------------------- helpers
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    return parse_dockerfile(path.read_text())


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """dockerfile_instructions of a Dockerfile's text."""
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_entrypoint(path: Path) -> list[str]:
    entry = [args for word, args in dockerfile_instructions(path) if word == "ENTRYPOINT"]
    assert entry, f"{path.name}: no ENTRYPOINT"
    return json.loads(entry[-1])  # exec form, so signals reach hetps


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution ($$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}),
    used when the docker-compose client is not installed."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("bare")
        op, default = m.group("op"), m.group("default") or ""
        if name in env and not (op == ":-" and env[name] == ""):
            return env[name]
        return default if op else ""

    pattern = r"\$\$|\$\{(?P<braced>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}|\$(?P<bare>\w+)"
    return re.sub(pattern, sub, value)


def interpolate_all(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_all(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_all(v, env) for k, v in node.items()}
    return node


def compose_env() -> dict[str, str]:
    """The environment docker-compose runs in for these tests: none of the file's variables set."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}


def docker_compose() -> str | None:
    return shutil.which("docker-compose")


def load_compose() -> dict:
    """The compose file as docker-compose resolves it (`config`), or, without the client,
    parsed here with the same variable substitution."""
    binary = docker_compose()
    if binary:
        done = subprocess.run(
            [binary, "-f", str(COMPOSE), "config"],
            capture_output=True,
            text=True,
            env=compose_env(),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return yaml.safe_load(done.stdout)
    raw = yaml.safe_load(COMPOSE.read_text())
    return interpolate_all({k: v for k, v in raw.items() if not str(k).startswith("x-")}, {})


def env_dict(environment) -> dict[str, str]:
    if environment is None:
        return {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {k: "" if v is None else str(v) for k, v in environment.items()}


def as_argv(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def map_paths(value: str, mounts: dict[str, Path]) -> str:
    """A container path under a mounted directory -> the host path it stands for."""
    for inside, outside in mounts.items():
        if value == inside or value.startswith(inside.rstrip("/") + "/"):
            return str(outside) + value[len(inside.rstrip("/")) :]
    return value


@pytest.fixture(scope="module")
def shim_path(tmp_path_factory) -> str:
    """PATH for the container commands: `hetps` runs the real CLI with --check appended
    (`python -m hetps.frontend.cli ARGS --check`), `python` is this interpreter."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "hetps").write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m hetps.frontend.cli "$@" --check\n'
    )
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"


def run_container_command(argv: list[str], env: dict[str, str], shim: str) -> dict[str, str]:
    """Run a container's argv with --check; return the resolved values it printed
    (`hetps ROLE: ok key=value ...` -> {"role": ROLE, key: value, ...})."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HETPS_")}
    full_env.update(env)
    full_env["PATH"] = shim
    exe = shutil.which(argv[0], path=shim)
    assert exe, f"{argv[0]!r} is not on the container's PATH"
    done = subprocess.run(
        [exe, *argv[1:]], env=full_env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, (
        f"{argv} exited {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    )
    for line in done.stdout.splitlines():
        m = re.match(r"hetps (\w+): ok\b(.*)", line)
        if m:
            return {"role": m.group(1), **dict(re.findall(r"(\w+)=(\S+)", m.group(2)))}
    raise AssertionError(f"{argv}: no 'hetps ROLE: ok' line in {done.stdout!r}")


def service_dockerfile(svc: dict) -> Path:
    context = Path(svc["build"]["context"])
    return (
        (context if context.is_absolute() else DOCKER / context) / svc["build"]["dockerfile"]
    ).resolve()


def split_address(address: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", address)
    assert m, f"not a tcp://HOST:PORT address: {address!r}"
    return m.group(1), int(m.group(2))


# ---------------------------------------------------------------- Dockerfiles
def test_cpu_dockerfile():
    steps = dockerfile_instructions(CPU_DOCKERFILE)
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"python:3\.1[1-9][\w.-]*-slim[\w.-]*", froms[0]), froms
    assert dockerfile_entrypoint(CPU_DOCKERFILE) == ["hetps"]
    runs = " ".join(args for word, args in steps if word == "RUN")
    # the CPU torch wheels
    assert "download.pytorch.org/whl/cpu" in " ".join(args for _, args in steps)
    assert re.search(r"pip install .*\.\[data\]", runs), "installs hetps with the data extra"


def test_cuda_dockerfile():
    steps = dockerfile_instructions(CUDA_DOCKERFILE)
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for w, a in steps if w == "ARG" and "=" in a)
    froms = [
        re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), a)
        for w, a in steps
        if w == "FROM"
    ]
    assert len(froms) == 1 and re.fullmatch(
        r"pytorch/pytorch:[\w.]+-cuda[\w.-]+-runtime", froms[0]
    ), froms
    assert dockerfile_entrypoint(CUDA_DOCKERFILE) == ["hetps"]
    runs = " ".join(a for w, a in steps if w == "RUN")
    assert re.search(r"pip install .*\.\[data\]", runs)
    # the base image's CUDA torch stays: no torch/torchvision requirement on any pip command line
    for command in re.findall(r"pip install[^&;]*", runs):
        assert not re.search(r"(^|\s)['\"]?torch(vision)?([<>=~!\s'\"]|$)", command), command


def missing_copies(steps: list[tuple[str, str]]) -> list[str]:
    """The files and folders pip needs to build hetps (BUILD_FILES) that no COPY copies."""
    copied = {src.rstrip("/") for w, a in steps if w == "COPY" for src in a.split()[:-1]}
    return [d for d in BUILD_FILES if d not in copied]


def without_copy_of(steps: list[tuple[str, str]], name: str) -> list[tuple[str, str]]:
    """`steps` with `name` taken out of every COPY (a COPY left with no source dropped)."""
    out = []
    for word, args in steps:
        if word == "COPY":
            *sources, dest = args.split()
            sources = [s for s in sources if s.rstrip("/") != name]
            if not sources:
                continue
            args = " ".join([*sources, dest])
        out.append((word, args))
    return out


def installs_hetps(word: str, args: str) -> bool:
    return word == "RUN" and re.search(r"pip install [^&;]*['\"]?\.(\[\w+\])?['\"]?", args)


def replay_copies(steps: list[tuple[str, str]], workdir: Path) -> None:
    """Copy into `workdir` what the COPY instructions before the RUN that pip-installs hetps copy
    into the image's WORKDIR (destinations relative to it), from the repository root (the build
    context) with Docker's rules: a folder's contents go into the destination, a file goes into
    a destination ending in `/` (or one of several sources) or becomes the destination. The
    .dockerignore patterns without a `/` (e.g. `__pycache__`) are left out as Docker leaves
    them out."""
    ignored = [
        line.strip().removeprefix("**/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    ignore = shutil.ignore_patterns(*(p for p in ignored if "/" not in p))
    for word, args in steps:
        if installs_hetps(word, args):
            return
        if word != "COPY":
            continue
        *sources, dest = args.split()
        if dest.startswith("/"):  # outside the WORKDIR the pip step builds from
            continue
        target = workdir / dest
        for src in sources:
            path = ROOT / src
            if path.is_dir():
                shutil.copytree(path, target, ignore=ignore, dirs_exist_ok=True)
            elif dest.endswith("/") or len(sources) > 1:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    raise AssertionError("no RUN instruction pip-installs hetps (`pip install .` or `.[extra]`)")


def build_wheel(steps: list[tuple[str, str]], tmp: Path) -> subprocess.CompletedProcess:
    """Build hetps's wheel, offline, from exactly what the Dockerfile copies before its pip step,
    in a clean directory (`tmp/src`), as the image's `pip install .` builds it (the wheel goes to
    `tmp/wheel`). No dependency is fetched: the build uses this environment's setuptools."""
    src = tmp / "src"
    src.mkdir()
    replay_copies(steps, src)
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--quiet", "--wheel-dir", str(tmp / "wheel"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )


def source_packages() -> set[str]:
    """Every hetps package of the tree: each folder with an __init__.py under a folder that
    pyproject's package-dir maps to a package, named under that package."""
    return {
        name + "".join(f".{part}" for part in init.parent.relative_to(ROOT / folder).parts)
        for name, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


@pytest.mark.parametrize("path", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_copies_the_package_and_runs_unprivileged(path):
    steps = dockerfile_instructions(path)
    missing = missing_copies(steps)
    assert not missing, f"{path.name} does not copy {missing} (pyproject installs them)"
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{path.name} runs as root"


@pytest.mark.parametrize("name", BUILD_FILES)
def test_the_copy_check_names_a_folder_a_dockerfile_leaves_out(name):
    """The check above fails, naming it, for a Dockerfile that copies all but one of them."""
    doctored = without_copy_of(dockerfile_instructions(CPU_DOCKERFILE), name)
    assert missing_copies(doctored) == [name]


@pytest.mark.parametrize("path", [CPU_DOCKERFILE, CUDA_DOCKERFILE], ids=lambda p: p.name)
def test_the_image_build_step_builds_every_package(path, tmp_path):
    """The image's `pip install .` step, run on exactly the files its COPY lines copy: the wheel
    builds and holds every package of pyproject.toml and of the tree (a sub-package missing from
    pyproject's `packages` would be missing from an image, though an editable install finds it)."""
    done = build_wheel(dockerfile_instructions(path), tmp_path)
    assert done.returncode == 0, f"{path.name}: the pip step fails:\n{done.stderr}"
    (wheel,) = (tmp_path / "wheel").glob("hetps-*.whl")
    with zipfile.ZipFile(wheel) as z:
        packages = {
            n.removesuffix("/__init__.py").replace("/", ".")
            for n in z.namelist()
            if n.endswith("/__init__.py")
        }
    expected = set(PYPROJECT["tool"]["setuptools"]["packages"]) | source_packages()
    assert "hetps.sim" in expected and "hetps.ps.policies" in expected
    assert not expected - packages, f"{path.name}: the wheel lacks {sorted(expected - packages)}"


def test_the_image_build_fails_without_a_package_folder(tmp_path):
    """The build check can fail: with `sim` not copied, pip stops as it would in `docker build`."""
    done = build_wheel(without_copy_of(dockerfile_instructions(CPU_DOCKERFILE), "sim"), tmp_path)
    assert done.returncode != 0
    assert "package directory 'sim' does not exist" in done.stderr, done.stderr


# ---------------------------------------------------------------- docker-compose
def test_compose_config_validates():
    binary = docker_compose()
    if binary is None:
        pytest.skip(
            "docker-compose not installed (.ci/run installs Debian's docker-compose); "
            "the service commands are still checked from the parsed file"
        )
    done = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=compose_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    services = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "--services"],
        capture_output=True,
        text=True,
        env=compose_env(),
        timeout=120,
    )
    assert set(services.stdout.split()) == COMPOSE_SERVICES | MONITORING_SERVICES


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


def test_compose_structure(compose):
    assert set(compose["services"]) == COMPOSE_SERVICES | MONITORING_SERVICES
    services = {n: svc for n, svc in compose["services"].items() if n in COMPOSE_SERVICES}
    cfg = load_config(DEFAULT_CONFIG)
    assert {"runs", "checkpoints"} <= set(compose.get("volumes") or {})
    for name, svc in services.items():
        assert svc.get("restart") in ("on-failure", "unless-stopped", "always") or str(
            svc.get("restart", "")
        ).startswith("on-failure:"), f"{name}: no restart policy"
        assert svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        env = env_dict(svc.get("environment"))
        assert env.get("HETPS_CONFIG") == "/configs/default.yaml", name
        assert any(str(v).split(":")[1:2] == ["/configs"] for v in svc.get("volumes", [])), (
            f"{name}: the configs directory is not mounted at /configs"
        )
        if name != "scheduler":  # every other node reaches the scheduler service by name
            host, port = split_address(env["HETPS_SCHEDULER"])
            assert host == "scheduler" and f"tcp://0.0.0.0:{port}" in as_argv(
                services["scheduler"]["command"]
            )
            assert "scheduler" in (svc.get("depends_on") or {}), name
    # the scheduler's run directory is on the runs volume
    sched = services["scheduler"]
    run_dir = env_dict(sched["environment"])["HETPS_RUN_DIR"]
    runs_mount = [v.split(":")[1] for v in sched["volumes"] if v.split(":")[0] == "runs"]
    assert runs_mount and run_dir.startswith(runs_mount[0] + "/"), (run_dir, sched["volumes"])
    # one fixed service per configured shard and worker, ranks 0..n-1, matching names
    fixed = {
        role: sorted(n for n in services if re.fullmatch(rf"{role}\d+", n))
        for role in ("ps", "worker")
    }
    assert fixed == {
        "ps": [f"ps{i}" for i in range(len(cfg.cluster.shards))],
        "worker": [f"worker{i}" for i in range(len(cfg.cluster.workers))],
    }
    # the scalable services: none by default; GPU workers only with the gpu profile
    assert int(services["worker"].get("scale", 1)) == 0
    # GPU workers: the gpu profile, the CUDA image, one distinct GPU each
    gpu_ids = []
    for name in sorted(n for n in services if n.startswith("worker-gpu")):
        gpu = services[name]
        assert "gpu" in gpu.get("profiles", []), name
        assert gpu["build"]["dockerfile"].endswith("Dockerfile.cuda"), name
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in device.get("capabilities", []) and "count" not in device, name
        gpu_ids += device["device_ids"]
    assert len(gpu_ids) == 2 and len(set(gpu_ids)) == len(gpu_ids), gpu_ids
    for name, svc in services.items():
        assert service_dockerfile(svc) in (CPU_DOCKERFILE, CUDA_DOCKERFILE), name


def compose_expectations(name: str) -> dict[str, str]:
    if name == "scheduler":
        return {"role": "scheduler", "bind": "tcp://0.0.0.0:7000", "run_dir": "/runs/default"}
    if m := re.fullmatch(r"ps(\d+)", name):
        return {
            "role": "ps",
            "rank": m.group(1),
            "bind": "tcp://0.0.0.0:7100",
            "advertise": f"tcp://{name}:7100",
            "scheduler": "tcp://scheduler:7000",
            "replica_advertise": f"tcp://{name}:7101",
        }
    if m := re.fullmatch(r"worker(\d+)", name):
        return {"role": "worker", "rank": m.group(1), "scheduler": "tcp://scheduler:7000"}
    if name == "evaluator":
        return {"role": "evaluator", "scheduler": "tcp://scheduler:7000"}
    # scaled and GPU workers: a rank claimed from the scheduler, never one derived from an address
    return {"role": "worker", "rank": "auto", "scheduler": "tcp://scheduler:7000"}


@pytest.mark.parametrize("name", sorted(COMPOSE_SERVICES))
def test_compose_service_command_passes_check(name, compose, shim_path):
    svc = compose["services"][name]
    entrypoint = as_argv(svc.get("entrypoint")) or dockerfile_entrypoint(service_dockerfile(svc))
    mounts = {}
    for volume in svc.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith((".", "/")):  # a bind mount (named volumes are not read by --check)
            mounts[target] = (
                (DOCKER / source).resolve() if not Path(source).is_absolute() else Path(source)
            )
    env = {k: map_paths(v, mounts) for k, v in env_dict(svc.get("environment")).items()}
    argv = [*entrypoint, *as_argv(svc.get("command"))]
    argv = [argv[0], *(map_paths(a, mounts) for a in argv[1:])]
    resolved = run_container_command(argv, env, shim_path)
    expected = compose_expectations(name)
    assert {k: resolved.get(k) for k in expected} == expected, resolved
    assert resolved["config"] == str(ROOT / "configs" / "default.yaml")


def test_compose_advertised_shard_addresses_are_service_names(compose):
    services = compose["services"]
    for name, svc in services.items():
        argv = as_argv(svc.get("command"))
        if "--advertise" in argv:
            host, port = split_address(argv[argv.index("--advertise") + 1])
            assert host == name and host in services
            assert f"tcp://0.0.0.0:{port}" == argv[argv.index("--bind") + 1]
        # the backup it holds, with cluster.replicas: a second port
        if "--replica-advertise" in argv:
            host, port = split_address(argv[argv.index("--replica-advertise") + 1])
            assert (
                host == name and f"tcp://0.0.0.0:{port}" == argv[argv.index("--replica-bind") + 1]
            )
            assert port != split_address(argv[argv.index("--advertise") + 1])[1]
