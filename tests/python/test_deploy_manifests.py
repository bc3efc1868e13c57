"""deploy/: every Kubernetes manifest is valid against the Kubernetes OpenAPI schemas (offline,
the schemas bundled with kubernetes-validate, strict: no unknown fields), and the manifests
agree with each other and with the server: selectors match the pods' labels, probes name
routes env-server serves, every flag given is one `env-server --help` lists, the resources
are the ones derived from the admission flags, the grace period covers the drain, and the
Containerfiles copy files that exist and build packages that exist."""

import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest Kubernetes the manifests are for (appArmorProfile is a field from 1.30 on) and the
# newest the validator knows.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
GIB = 1 << 30


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def one(kind: str) -> dict:
    found = [d for _, d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"one {kind} expected, found {len(found)}"
    return found[0]


def server_flags() -> set[str]:
    binary = Path(os.environ.get("CUDA_AGENT_SERVER_BIN", ROOT / "target" / "debug" / "env-server"))
    if not binary.exists():
        pytest.fail(f"{binary} is not built: cargo build -p env-server (or set CUDA_AGENT_SERVER_BIN)")
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z0-9-]+)", text, re.M))


def router_routes() -> set[str]:
    src = (ROOT / "env-server" / "src" / "api.rs").read_text()
    return set(re.findall(r'\.route\(\s*"([^"]+)"', src))


def flag_values(args: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        assert a.startswith("--"), f"argument {a!r} follows no flag"
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        out[a] = value
        i += 2 if value is not None else 1
    return out


def quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": GIB, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)([KMGT]i)?", q)
    assert m, f"unexpected quantity {q}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def container() -> dict:
    containers = one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    docs = documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"DaemonSet", "Service", "PodDisruptionBudget", "Namespace"} <= kinds, kinds
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name} ({doc['kind']}) against Kubernetes {version}: {e.message} at {list(e.path)}")


def test_kustomization_lists_every_manifest_and_nothing_else():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(k["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    namespace = k["namespace"]
    for name, doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, name
    assert one("Namespace")["metadata"]["name"] == namespace
    images = {i["name"] for i in k.get("images", [])}
    assert container()["image"].split(":")[0] in images


def test_selectors_match_the_pods_labels_and_ports_their_names():
    ds = one("DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "DaemonSet": ds["spec"]["selector"]["matchLabels"],
        "Service": one("Service")["spec"]["selector"],
        "PodDisruptionBudget": one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    }
    for kind, sel in selectors.items():
        assert sel and all(labels.get(k) == v for k, v in sel.items()), f"{kind} selects {sel}, pods are {labels}"
    svc = one("Service")
    assert svc["spec"]["clusterIP"] == "None", "headless: clients resolve every server"
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports
        assert p["port"] == ports[p["targetPort"]]
    bind = flag_values(container()["args"])["--bind"]
    assert int(bind.rsplit(":", 1)[1]) == ports["http"]


def test_probes_name_routes_the_server_serves():
    c = container()
    routes = router_routes()
    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/ready", "readiness is admission, not liveness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v1/health"
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in routes, f"{probe} asks for {get['path']}, not a route of env-server ({sorted(routes)})"
        assert get["port"] in ports


def test_the_container_args_are_flags_the_server_takes():
    flags = server_flags()
    assert "--drain-grace-s" in flags and "--bind" in flags, "parsed the help"
    given = flag_values(container()["args"])
    unknown = set(given) - flags
    assert not unknown, f"env-server does not take {unknown}"
    for containerfile in ("Containerfile", "Containerfile.cpu"):
        text = (DEPLOY / containerfile).read_text()
        cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
        assert cmd, containerfile
        unknown = set(flag_values(yaml.safe_load(cmd.group(1)))) - flags
        assert not unknown, f"{containerfile}: env-server does not take {unknown}"


def test_the_grace_period_covers_the_drain():
    ds = one("DaemonSet")["spec"]["template"]["spec"]
    grace = float(flag_values(container()["args"])["--drain-grace-s"])
    # The drain's grace, then up to 10 s for requests still open (docs/SECURITY.md).
    assert ds["terminationGracePeriodSeconds"] > grace + 10


def test_resources_are_derived_from_the_admission_flags():
    c = container()
    args = flag_values(c["args"])
    builds = int(args["--max-builds"])
    depth = int(args["--prestart-depth"])
    reserve = int(args["--min-available-memory-bytes"])
    requests = c["resources"]["requests"]
    gpus = int(requests["nvidia.com/gpu"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == requests["nvidia.com/gpu"]
    assert int(requests["cpu"]) == builds + gpus + 1
    assert quantity_bytes(requests["memory"]) == builds * 2 * GIB + gpus * depth * 3 * GIB + reserve
    assert "memory" not in c["resources"].get("limits", {}), "the server admits by the node's memory"
    assert int(args["--max-commands"]) <= int(args["--max-episodes"])


def test_the_key_data_dir_and_python_are_where_the_args_say():
    ds = one("DaemonSet")["spec"]["template"]["spec"]
    c = container()
    args = flag_values(c["args"])
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in ds["volumes"]}
    key = Path(args["--api-key-file"])
    secret_mount = next(m for m in mounts.values() if "secret" in volumes[m["name"]])
    secret = volumes[secret_mount["name"]]["secret"]
    assert key.parent == Path(secret_mount["mountPath"]) and secret_mount.get("readOnly")
    assert key.name in {i["path"] for i in secret["items"]}
    assert secret["defaultMode"] & 0o077 == 0, "the key file is the owner's alone"
    assert "--api-key" not in args, "a key in the args is readable by every local process"
    data = next(m for m in mounts.values() if m["mountPath"] == args["--data-dir"])
    assert "hostPath" in volumes[data["name"]], "the data dir is node-local"
    assert any(m["mountPath"] == "/run/cuda-agent" for m in mounts.values()), "the uid pool's locks"
    for containerfile in ("Containerfile", "Containerfile.cpu"):
        assert args["--python"] == "/opt/cuda-agent/venv/bin/python"
        assert "ln -s \"$venv\" /opt/cuda-agent/venv" in (DEPLOY / containerfile).read_text()
    caps = c["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"] and "SYS_ADMIN" in caps["add"] and not c["securityContext"]["privileged"]


@pytest.mark.parametrize("containerfile", ["Containerfile", "Containerfile.cpu"])
def test_containerfiles_copy_what_exists_and_build_what_exists(containerfile):
    text = (DEPLOY / containerfile).read_text().replace("\\\n", " ")
    for line in text.splitlines():
        m = re.match(r"COPY (?!--from)(.+)", line)
        if m and m.group(1).strip() != ". .":
            *sources, _dest = m.group(1).split()
            for s in sources:
                assert (ROOT / s).exists(), f"{containerfile} copies {s}, which does not exist"
    workspace = (ROOT / "Cargo.toml").read_text()
    need = re.search(r'rust-version = "(\d+)\.(\d+)"', workspace).groups()
    have = re.search(r"rust:(\d+)\.(\d+)", text).groups()
    assert tuple(map(int, have)) >= tuple(map(int, need)), "the build image's Rust is older than rust-version"
    for package, binary in re.findall(r"-p ([\w-]+) --bin ([\w-]+)", text):
        manifest = (ROOT / package / "Cargo.toml").read_text()
        assert f'name = "{package}"' in manifest
        assert (ROOT / package / "src" / "bin" / f"{binary}.rs").exists() or (ROOT / package / "src" / "main.rs").exists()
    assert (DEPLOY / "Containerfile.dockerignore").exists()


def test_the_cuda_image_has_the_toolkit_torch_was_built_with():
    # torch.utils.cpp_extension refuses an nvcc whose major version differs from the CUDA torch
    # was built with: an image with another toolkit would fail every CUDA candidate's build.
    import torch

    tag = re.search(r"ARG CUDA_IMAGE=\S*/cuda:(\d+)\.(\d+)", (DEPLOY / "Containerfile").read_text())
    assert tag, "the CUDA Containerfile names its base image in ARG CUDA_IMAGE"
    if torch.version.cuda is None:
        pytest.skip("this torch is a CPU build: it names no CUDA version to compare")
    assert tag.group(1) == torch.version.cuda.split(".")[0], f"image CUDA {tag.group(1)}.{tag.group(2)}, torch built with {torch.version.cuda}"
