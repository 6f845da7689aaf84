"""deploy/ and the image: what can be checked without Docker or a cluster. The YAML
parses, the front's Envoy config is the renderer's (and Envoy validates it), every flag
the manifests pass exists in the CLI they run, probes, ports and grace periods agree
with the Dockerfile and the drain timeout, and the image runs as TGI's does: its
entrypoint is text-generation-launcher, which takes `docker run IMAGE --model-id X`
with the image's environment to port 80 and the /data Hub cache."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from textgen.service.cli import build_parser
from textgen.service.processes.envoy import envoy_binary
from textgen.service.settings.table import Settings
from textgen.service.settings.tgi_launcher import settings_from

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_objects() -> dict[tuple[str, str], dict]:
    return {
        (d["kind"], d["metadata"]["name"]): d
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for d in load_all(path)
    }


def dockerfile() -> tuple[list[str], set[int]]:
    """The image's ENTRYPOINT and EXPOSEd ports."""
    text = (ROOT / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.MULTILINE).group(1))
    exposed = {
        int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.MULTILINE) for p in line.split()
    }
    return entrypoint, exposed


def dockerfile_env() -> dict[str, str]:
    """The variables the image sets (its ENV lines, continuations joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.+)$", text, re.MULTILINE):
        env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return env


def parse(command: list[str]):
    """`textgen <command>` through the real CLI parser: unknown flags fail here."""
    try:
        return build_parser().parse_args(command)
    except SystemExit as exc:  # argparse's way of refusing
        raise AssertionError(f"textgen {shlex.join(command)} is refused by the CLI") from exc


def serve_help() -> str:
    textgen = Path(sys.executable).with_name("textgen")
    return subprocess.run(
        [str(textgen), "serve", "--help"], capture_output=True, text=True, timeout=30, check=True
    ).stdout


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_every_manifest_parses():
    paths = sorted(DEPLOY.rglob("*.yaml"))
    assert {p.name for p in paths} >= {
        "compose.yaml", "replicas.yaml", "front.yaml", "envoy-configmap.yaml", "kustomization.yaml",
    }  # fmt: skip
    for path in paths:
        assert load_all(path), path
    kustomization = load_all(K8S / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert (K8S / "multi-host" / "leaderworkerset.yaml") in paths


@pytest.mark.server
def test_configmap_is_the_rendered_front_config_and_envoy_validates_it(tmp_path):
    spec = importlib.util.spec_from_file_location("render_configmap", K8S / "render_configmap.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    committed = (K8S / "envoy-configmap.yaml").read_text()
    assert committed == render.configmap(), (
        "deploy/kubernetes/envoy-configmap.yaml is stale: "
        "run .venv/bin/python deploy/kubernetes/render_configmap.py"
    )
    config = json.loads(load_all(K8S / "envoy-configmap.yaml")[0]["data"][render.KEY])
    path = tmp_path / render.KEY
    path.write_text(json.dumps(config))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"
    assert "outlier_detection" in cluster


@pytest.mark.server
def test_replica_deployment_matches_the_image_and_the_cli():
    objects = k8s_objects()
    deployment = objects[("Deployment", "textgen")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    entrypoint, exposed = dockerfile()
    assert entrypoint == ["text-generation-launcher"]
    # a gRPC-only replica runs `textgen serve`: every flag is one of its
    command, args = container["command"], container["args"]
    assert command == ["textgen", "serve"]
    parse([*command[1:], *args])
    # a Service named textgen would otherwise set TEXTGEN_PORT=tcp://..., serve's --port
    assert pod["enableServiceLinks"] is False
    help_text = serve_help()
    for flag in (a for a in args if a.startswith("--")):
        assert flag in help_text, flag
    for env in container.get("env", []):
        flag = "--" + env["name"].removeprefix("TEXTGEN_").lower().replace("_", "-")
        assert not env["name"].startswith("TEXTGEN_") or flag in help_text, env["name"]

    grpc_port = int(flag_value(args, "--grpc-port"))
    assert grpc_port in exposed
    assert "--no-envoy" in args  # HTTP is the front's
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("grpc", grpc_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port, probe
        assert container[probe]["grpc"].get("service", "") == ""  # what the server sets

    drain = float(
        flag_value(args, "--graceful-termination-timeout")
        or Settings().graceful_termination_timeout
    )
    assert drain >= 90
    assert pod["terminationGracePeriodSeconds"] >= drain + 10
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == 1

    service = objects[("Service", "textgen-replicas")]
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS lists every replica
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == grpc_port and service_port["targetPort"] == "grpc"


LWS = K8S / "multi-host"
# what the LeaderWorkerSet controller puts in every container of a group, for the parse
LWS_VARIABLES = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "leader.lws", "LWS_WORKER_INDEX": "1"}


def expanded(args: list[str], env: list[dict]) -> list[str]:
    """`args` as the kubelet passes them: $(VAR) from the container's env and LWS's."""
    values = {**LWS_VARIABLES, **{e["name"]: e.get("value", "") for e in env}}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


def test_the_leaderworkerset_is_one_sharded_replica_per_group():
    """The leader is `textgen serve --num-shard size` (rank 0, gRPC and Envoy), worker i is
    `textgen shard --rank i`, with the same settings, rendezvous and one GPU each; both
    parse with the real CLI, and the Service reaches the leaders only."""
    (lws, service) = load_all(LWS / "leaderworkerset.yaml")
    assert load_all(LWS / "kustomization.yaml")[0]["resources"] == ["leaderworkerset.yaml"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # no half model serves
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    _, exposed = dockerfile()
    leader_args = expanded(leader["args"], leader["env"])
    assert leader["command"] == ["textgen", "serve"]
    serve = parse([*leader["command"][1:], *leader_args])
    shard = parse([*worker["command"][1:], *expanded(worker["args"], worker["env"])])
    assert worker["command"] == ["textgen", "shard"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert template[role]["spec"]["enableServiceLinks"] is False
    assert leader["env"] == worker["env"]  # one model, dtype and limits for every rank
    assert int(LWS_VARIABLES["LWS_GROUP_SIZE"]) == serve.num_shard == shard.num_shard
    assert "$(LWS_GROUP_SIZE)" in leader["args"] and "$(LWS_WORKER_INDEX)" in worker["args"]
    assert shard.rank == int(LWS_VARIABLES["LWS_WORKER_INDEX"])
    assert serve.local_shards == shard.local_shards == 1  # a rank, and a GPU, per pod
    assert (serve.master_addr, serve.master_port) == (shard.master_addr, shard.master_port)
    assert serve.master_addr == LWS_VARIABLES["LWS_LEADER_ADDRESS"]
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports == {"http": serve.port, "grpc": serve.grpc_port, "rendezvous": serve.master_port}
    assert {serve.port, serve.grpc_port} <= exposed and not serve.no_envoy
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["grpc"]["port"] == serve.grpc_port, probe
    for container in (leader, worker):
        for kind in ("requests", "limits"):
            assert container["resources"][kind]["nvidia.com/gpu"] == 1
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data", "/dev/shm"}
    grace = float(
        next(e["value"] for e in leader["env"] if e["name"].endswith("TERMINATION_TIMEOUT"))
    )
    assert template["leaderTemplate"]["spec"]["terminationGracePeriodSeconds"] >= grace + 10
    leader_labels = template["leaderTemplate"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= leader_labels.items()
    assert (
        not service["spec"]["selector"].items()
        <= template["workerTemplate"]["metadata"]["labels"].items()
    )


def test_front_reads_the_configmap_over_the_headless_service():
    objects = k8s_objects()
    front = objects[("Deployment", "textgen-front")]
    pod = front["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_path = Path(flag_value(container["args"], "-c"))
    (mount,) = container["volumeMounts"]
    assert config_path.parent == Path(mount["mountPath"])
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    configmap = objects[("ConfigMap", volume["configMap"]["name"])]
    config = json.loads(configmap["data"][config_path.name])
    assert container["image"].endswith(":v1.40.0")  # the Envoy the config is validated with

    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"
    assert container["ports"][0]["containerPort"] == listener["port_value"]
    service = objects[("Service", "textgen")]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    assert service["spec"]["selector"] == front["spec"]["selector"]["matchLabels"]

    cluster = config["static_resources"]["clusters"][0]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    replicas = objects[("Service", "textgen-replicas")]
    assert address["address"] == replicas["metadata"]["name"]
    assert address["port_value"] == replicas["spec"]["ports"][0]["port"]


def test_compose_replicas_and_front_use_real_flags():
    compose = load_all(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    _, exposed = dockerfile()
    replicas = {n: s for n, s in services.items() if n.startswith("textgen-")}
    assert len(replicas) >= 2
    for service in replicas.values():
        assert (
            service["build"]["context"] == ".." and service["build"]["dockerfile"] == "Dockerfile"
        )
        entrypoint = service["entrypoint"]
        assert entrypoint == ["textgen", "serve"]
        args = parse([*entrypoint[1:], *service["command"]])
        assert args.no_envoy and args.grpc_port in exposed
        assert (
            float(service["stop_grace_period"].removesuffix("s"))
            >= args.graceful_termination_timeout + 10
        )
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
    gpus = [
        s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
        for s in replicas.values()
    ]
    assert len(set(gpus)) == len(gpus), "two replicas on one GPU"

    front = services["front"]
    assert front["entrypoint"] == ["textgen", "proxy"]
    args = parse(["proxy", *front["command"]])
    assert {f"{u.host}:{u.port}" for u in args.dns} == {f"{n}:{r.grpc_port}" for n, r in (
        (n, parse([*s["entrypoint"][1:], *s["command"]])) for n, s in replicas.items()
    )}  # fmt: skip
    assert front["ports"] == [f"{args.port}:{args.port}"]


@pytest.mark.server
def test_dockerfile_passes_hadolint():
    """The image's recipe, linted offline (hadolint, with .hadolint.yaml's reasons)."""
    hadolint = Path(sys.executable).with_name("hadolint")
    result = subprocess.run(
        [str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_uses_the_base_images_own_python():
    """Ubuntu 24.04 (the CUDA base) ships Python 3.12 as its only python3: a versioned
    package (python3.11) exists only in a third-party PPA, and the build would stop."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+-ubuntu24\.04$", text, re.MULTILINE)
    installs = " ".join(re.findall(r"apt-get install ([^\n&]+)", text))
    assert {"python3", "python3-venv"} <= set(installs.split())
    assert not re.search(r"python3\.\d+", text), "a versioned Python the base doesn't have"
    # the image runs as an unprivileged user that owns the model volume
    user = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert user and user[-1] not in ("root", "0")
    deployment = k8s_objects()[("Deployment", "textgen")]
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert str(security["runAsUser"]) == user[-1] and security["runAsNonRoot"] is True


def test_readme_commands_are_real():
    """Every `textgen ...` line of deploy/README.md parses with the CLI."""
    commands = [
        line.strip().rstrip("&").strip()
        for line in (DEPLOY / "README.md").read_text().splitlines()
        if line.strip().startswith("textgen ")
    ]
    assert any(c.startswith("textgen proxy") for c in commands)
    for command in commands:
        parse(shlex.split(command)[1:])


def test_the_textgen_cache_is_on_the_volume_every_manifest_mounts():
    """The model and --compile's artifacts live in TEXTGEN_CACHE: on the image's volume,
    which compose and Kubernetes mount, so a new container finds them."""
    text = (ROOT / "Dockerfile").read_text()
    cache = Path(re.search(r"\bTEXTGEN_CACHE=(\S+)", text).group(1))
    (volume,) = re.findall(r"^VOLUME (\S+)$", text, re.MULTILINE)
    assert cache.is_relative_to(volume)
    compose = load_all(DEPLOY / "compose.yaml")[0]
    for name, service in compose["services"].items():
        if name.startswith("textgen-"):
            assert any(v.endswith(f":{volume}") for v in service["volumes"]), name
    pod = k8s_objects()[("Deployment", "textgen")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert volume in {m["mountPath"] for m in container["volumeMounts"]}


def test_the_image_runs_as_tgis_does():
    """`docker run --gpus all -p 8080:80 -v $PWD/data:/data IMAGE --model-id X`: the
    entrypoint is the launcher (a console script of the package), and with the image's
    environment (and Docker's HOSTNAME, the container's name) it listens on 0.0.0.0:80,
    keeps the Hub cache in the /data volume and serves metrics on TGI's 9000."""
    entrypoint, exposed = dockerfile()
    assert entrypoint == ["text-generation-launcher"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["text-generation-launcher"] == "textgen.service.cli:tgi_launcher_main"
    env = dockerfile_env()
    assert (env["PORT"], env["HUGGINGFACE_HUB_CACHE"]) == ("80", "/data")
    settings = settings_from(["--model-id", "org/name"], {**env, "HOSTNAME": "3f2a9c1d0b7e"})
    assert (settings.model_id, settings.hostname, settings.port) == ("org/name", "0.0.0.0", 80)
    assert settings.huggingface_hub_cache == "/data"
    assert {settings.port, settings.prometheus_port} <= exposed
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^VOLUME /data$", text, re.MULTILINE)


def test_the_readmes_docker_runs_are_real():
    """Each `docker run ... textgen ARGS` of the README parses with what runs it: the
    launcher (the image's entrypoint), or the textgen CLI under `--entrypoint textgen`;
    and one of its published ports maps to the port that listens."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    runs = [shlex.split(line) for line in text.splitlines() if line.startswith("docker run ")]
    assert len(runs) >= 3
    env = dockerfile_env()
    for run in runs:
        options, image, args = docker_run(run)
        assert image == "textgen", run
        if options.get("--entrypoint") == "textgen":
            port = parse(args).port
        else:
            port = settings_from(args, env).port
        assert any(p.endswith(f":{port}") for p in options["-p"]), run


# `docker run` options that take a value (those the README uses)
_DOCKER_VALUES = {"-p", "-v", "-e", "-t", "--gpus", "--shm-size", "--entrypoint"}


def docker_run(run: list[str]) -> tuple[dict, str, list[str]]:
    """`docker run OPTIONS IMAGE ARGS` -> (options, IMAGE, ARGS); -p collects a list."""
    options: dict = {"-p": []}
    i = 2
    while run[i].startswith("-"):
        name = run[i]
        value = run[i + 1] if name in _DOCKER_VALUES else None
        if name == "-p":
            options["-p"].append(value)
        else:
            options[name] = value
        i += 2 if name in _DOCKER_VALUES else 1
    return options, run[i], run[i + 1 :]
