"""The scale-out examples of deploy/README.md (issue 38, item 3), checked
without Docker or a GPU:

  1. docker-compose.yml's replicas profile: one server per GPU, each on its
     own device, running the gpu profile's command, published where
     deploy/nginx/nginx.conf's upstream expects them (and nowhere else), and
     nginx on that same file, built from deploy/nginx/Dockerfile;
  2. its pipeline profile: two stages on two GPUs whose --layers spans are
     cut at one number (LAYERSERVE_SPLIT) and otherwise run the same command;
  3. the Kubernetes overlays (deploy/k8s-overlays), built by `kubectl
     kustomize` from deploy/k8s: N pods of one GPU each on one node behind
     the session-hashing Ingress; and two stages whose Services, disruption
     budgets and Ingresses reach only their own pods, whose spans chain, and
     whose Deployments are deploy/k8s's but for their names, labels and span;
  4. the pipeline for real, on the CPU: a random checkpoint written by
     examples/random_checkpoint.py, the pipeline profile's two --layers spans
     served by two CPU layerserve processes and chained as the README says
     (`layerctl infer` twice; and sessions stepped through both with
     tritonclient), against one server holding every layer: equal within
     1e-5 (FP32).

The overlays need kubectl (1.27 or later: kustomize v5); where it is missing
those tests are skipped, saying so (Debian 12's kubernetes-client is too old
to build them). Ports are the kernel's; every wait is bounded.
"""

import copy
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from commands import compose_services, run
from layerserve_process import LayerserveProcess
from tiny_servers import SMALL_SERVER_FLAGS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

NGINX_CONF = DEPLOY / "nginx" / "nginx.conf"
NGINX_DOCKERFILE = DEPLOY / "nginx" / "Dockerfile"
OVERLAYS = DEPLOY / "k8s-overlays"
GPU = "nvidia.com/gpu"
SESSION_HASH = "$http_x_session_id"


# --- 1, 2. docker-compose ---------------------------------------------------------------

def in_profile(services, profile):
    return {name: s for name, s in services.items() if profile in s.get("profiles", [])}


def device_ids(service):
    """The GPUs a service reserves by id (each device request's ids)."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}) \
        .get("devices", [])
    assert all(d.get("driver") == "nvidia" and "count" not in d for d in devices), devices
    return [i for d in devices for i in d.get("device_ids", [])]


def published(service):
    """[(host address, host port, container port)] of a service's ports, as
    `docker-compose config` writes them (short or long form)."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), int(p["published"]), int(p["target"])))
        else:
            parts = str(p).split("/")[0].split(":")
            host_ip = parts[0] if len(parts) == 3 else ""
            out.append((host_ip, int(parts[-2]), int(parts[-1])))
    return out


def nginx_upstreams():
    """The server addresses of nginx.conf's upstream."""
    block = re.search(r"upstream layerserve \{(.*?)\n    \}", NGINX_CONF.read_text(), re.S)
    return re.findall(r"^\s*server (\S+) ", block.group(1), re.M)


def nginx_directive(name, text=None):
    """The arguments of each `name ...;` line of nginx.conf."""
    return re.findall(rf"^\s*{name} ([^;]+);", text or NGINX_CONF.read_text(), re.M)


def test_compose_replicas_are_one_per_gpu_behind_the_shipped_nginx():
    services = compose_services("replicas")
    profile = in_profile(services, "replicas")
    replicas = {n: s for n, s in profile.items() if n.startswith("layerserve")}
    assert set(profile) - set(replicas) == {"nginx"}, sorted(profile)
    assert len(replicas) >= 2

    gpus = [device_ids(s) for s in replicas.values()]
    assert all(len(g) == 1 for g in gpus), f"each replica reserves one GPU by id: {gpus}"
    assert len({g[0] for g in gpus}) == len(gpus), f"two replicas share a GPU: {gpus}"

    # Each replica runs what the gpu profile runs, on the image it runs.
    gpu = services["layerserve-gpu"]
    for name, s in replicas.items():
        assert s["command"] == gpu["command"], name
        assert s["image"] == gpu["image"] and s["build"] == gpu["build"], name
        assert device_ids(s) and "--backend=cuda" in s["command"], name

    # Reachable on the host's loopback only, exactly at nginx's upstream.
    grpc_port = int(next(a.split("=")[1] for a in gpu["command"]
                         if a.startswith("--grpc-port=")))
    addresses = []
    for name, s in replicas.items():
        (port,) = published(s)
        assert port[0] == "127.0.0.1" and port[2] == grpc_port, (name, port)
        addresses.append(f"127.0.0.1:{port[1]}")
    assert sorted(addresses) == sorted(nginx_upstreams()), \
        "the replicas' published ports and nginx.conf's upstream servers differ"


def test_compose_nginx_runs_the_shipped_configuration():
    nginx = compose_services("replicas")["nginx"]
    # On the host's network, where the upstream's 127.0.0.1 addresses are the
    # replicas' published ports and clients keep their own addresses.
    assert nginx["network_mode"] == "host" and "ports" not in nginx
    assert set(nginx["depends_on"]) == {n for n in in_profile(compose_services("replicas"),
                                                               "replicas") if n != "nginx"}
    mounts = {}
    for v in nginx["volumes"]:
        source, target, *mode = v.split(":")
        mounts[target] = (Path(source), mode)
    # The image starts nginx on the path the shipped file is mounted at.
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", NGINX_DOCKERFILE.read_text(), re.M)
    argv = yaml.safe_load(entrypoint.group(1))
    conf = argv[argv.index("-c") + 1]
    assert mounts[conf] == (NGINX_CONF, ["ro"]), mounts
    # ... with the certificate and key where nginx.conf reads them.
    (cert,) = nginx_directive("ssl_certificate")
    (key,) = nginx_directive("ssl_certificate_key")
    tls_dir = str(Path(cert).parent)
    assert Path(key).parent == Path(cert).parent and tls_dir in mounts, (tls_dir, mounts)
    assert (Path(nginx["build"]["context"]) / "Dockerfile").resolve() == NGINX_DOCKERFILE


def test_nginx_image_is_debians_nginx_with_the_stream_module():
    """The packages the deployment tests run nginx.conf on, from a fully
    qualified base image; the stream module is where nginx.conf loads it."""
    text = NGINX_DOCKERFILE.read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert base == "docker.io/library/debian:12-slim", base
    installs = re.search(r"apt-get install ([^&]+)", text).group(1).split()
    assert {"nginx", "libnginx-mod-stream"} <= set(installs), installs
    (module,) = nginx_directive("load_module")
    assert module == "/usr/lib/nginx/modules/ngx_stream_module.so", module


def test_compose_replicas_leave_nginx_its_ports():
    """nginx listens on the host (8001, 8443, 8444): no container of the
    profile publishes one of those."""
    listen = {int(re.search(r"(\d+)", a).group(1)) for a in nginx_directive("listen")
              if not a.startswith("unix:")}
    services = compose_services("replicas")
    taken = {p[1] for n, s in services.items()
             if "replicas" in s.get("profiles", ["replicas"]) for p in published(s)}
    assert listen and not listen & taken, (listen, taken)


def pipeline_stages(**env):
    stages = in_profile(compose_services("pipeline", **env), "pipeline")
    assert sorted(stages) == ["layerserve-stage0", "layerserve-stage1"], sorted(stages)
    return stages["layerserve-stage0"], stages["layerserve-stage1"]


def layers_flag(command):
    (layers,) = [a.split("=", 1)[1] for a in command if a.startswith("--layers=")]
    return layers


def test_compose_pipeline_splits_the_layers_at_one_number_over_two_gpus():
    first, second = pipeline_stages(LAYERSERVE_SPLIT="7")
    assert (layers_flag(first["command"]), layers_flag(second["command"])) == (":7", "7:")
    first, second = pipeline_stages()
    assert (layers_flag(first["command"]), layers_flag(second["command"])) == (":16", "16:")

    assert device_ids(first) != device_ids(second) and all(
        len(device_ids(s)) == 1 for s in (first, second)), (device_ids(first), device_ids(second))
    assert {p[1] for p in published(first)}.isdisjoint(p[1] for p in published(second))
    assert first["volumes"] == second["volumes"], "the stages read different checkpoints"

    # Apart from the span, both run the gpu profile's command.
    gpu = compose_services("gpu")["layerserve-gpu"]["command"]
    for stage in (first, second):
        assert [a for a in stage["command"] if not a.startswith("--layers=")] == \
            [a for a in gpu if not a.startswith("--layers=")]


# --- 3. Kubernetes overlays ---------------------------------------------------------------

def kustomize(path):
    """The objects `kubectl kustomize` builds from a kustomization."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("no kubectl: the overlays are built with kubectl's kustomize (v5, "
                    "kubectl 1.27 or later)")
    return [o for o in yaml.safe_load_all(run(kubectl, "kustomize", path)) if o]


def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind, name):
    (o,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return o


def selects(selector, labels):
    return selector.items() <= labels.items()


def pod_labels(deployment):
    return deployment["spec"]["template"]["metadata"]["labels"]


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def check_reaches(objects, deployment):
    """Every Ingress that names the Deployment's Service hashes sessions and
    reaches its pods' gRPC port; the Service and the disruption budget select
    its pods. Returns the Service."""
    labels = pod_labels(deployment)
    (service,) = [s for s in of_kind(objects, "Service") if selects(s["spec"]["selector"], labels)]
    (budget,) = [b for b in of_kind(objects, "PodDisruptionBudget")
                 if selects(b["spec"]["selector"]["matchLabels"], labels)]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    ingresses = [i for i in of_kind(objects, "Ingress")
                 if all(p["backend"]["service"]["name"] == service["metadata"]["name"]
                        for r in i["spec"]["rules"] for p in r["http"]["paths"])]
    assert ingresses, f"no Ingress reaches {service['metadata']['name']}"
    grpc_ports = {p["name"] for p in container(deployment)["ports"]}
    for ingress in ingresses:
        annotations = ingress["metadata"]["annotations"]
        assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == SESSION_HASH
        assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
        for rule in ingress["spec"]["rules"]:
            assert rule["host"] in {h for t in ingress["spec"]["tls"] for h in t["hosts"]}
            for path in rule["http"]["paths"]:
                port_name = path["backend"]["service"]["port"]["name"]
                (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
                assert port["targetPort"] in grpc_ports, port
    return service, budget, ingresses


def one_gpu_per_pod(deployment):
    resources = container(deployment)["resources"]
    return resources["requests"].get(GPU) == 1 and resources["limits"].get(GPU) == 1


def test_k8s_base_kustomization_lists_existing_files():
    """deploy/k8s/kustomization.yaml (read without kubectl): every resource
    is a file there, and pvc.yaml, which every overlay's pods mount, is
    applied on its own."""
    base = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert all((DEPLOY / "k8s" / r).is_file() for r in base["resources"]), base["resources"]
    assert "pvc.yaml" not in base["resources"]
    for overlay in ["replicas", "pipeline/stage-0", "pipeline/stage-1"]:
        k = yaml.safe_load((OVERLAYS / overlay / "kustomization.yaml").read_text())
        assert all((OVERLAYS / overlay / r).resolve() == (DEPLOY / "k8s").resolve()
                   for r in k["resources"]), (overlay, k["resources"])


def test_k8s_base_builds_into_the_files_it_lists():
    built = kustomize(DEPLOY / "k8s")
    files = [o for f in yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())["resources"]
             for o in yaml.safe_load_all((DEPLOY / "k8s" / f).read_text()) if o]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, built)) == sorted(map(key, files))
    assert sorted(built, key=key) == sorted(files, key=key)


def test_k8s_replicas_overlay_runs_one_pod_per_gpu_of_one_node():
    objects = kustomize(OVERLAYS / "replicas")
    (deployment,) = of_kind(objects, "Deployment")
    spec = yaml.safe_load((OVERLAYS / "replicas/kustomization.yaml").read_text())
    (count,) = [r["count"] for r in spec["replicas"]]
    assert deployment["spec"]["replicas"] == count >= 2
    assert one_gpu_per_pod(deployment)
    node = deployment["spec"]["template"]["spec"]["nodeSelector"]
    assert list(node) == ["kubernetes.io/hostname"], node
    check_reaches(objects, deployment)


def test_k8s_pipeline_overlay_runs_two_chained_stages_on_their_own_pods():
    objects = kustomize(OVERLAYS / "pipeline")
    deployments = of_kind(objects, "Deployment")
    assert len(deployments) == 2

    # The spans chain from the base's first layer to its last.
    base = yaml.safe_load((DEPLOY / "k8s/deployment.yaml").read_text())
    first, end = map(int, layers_flag(container(base)["args"]).split(":"))
    spans = sorted(tuple(map(int, layers_flag(container(d)["args"]).split(":")))
                   for d in deployments)
    assert spans[0][0] == first and spans[-1][1] == end and spans[0][1] == spans[1][0], spans

    # Each stage's Service, budget and Ingresses reach its own pods only.
    reached = [check_reaches(objects, d) for d in deployments]
    for (service, budget, ingresses), other in zip(reached, reversed(deployments)):
        assert not selects(service["spec"]["selector"], pod_labels(other))
        assert not selects(budget["spec"]["selector"]["matchLabels"], pod_labels(other))
    hosts = [{r["host"] for i in ingresses for r in i["spec"]["rules"]} for _, _, ingresses in reached]
    assert hosts[0].isdisjoint(hosts[1]), hosts

    # Each Deployment is the base's, but for its name, labels and span, and
    # mounts the one checkpoint claim of pvc.yaml.
    (claim,) = [o["metadata"]["name"] for o in yaml.safe_load_all((DEPLOY / "k8s/pvc.yaml").read_text())
                if o and o["kind"] == "PersistentVolumeClaim"]
    for d in deployments:
        assert one_gpu_per_pod(d)
        same = copy.deepcopy(d)
        same["metadata"] = base["metadata"]
        same["spec"]["selector"] = base["spec"]["selector"]
        same["spec"]["template"]["metadata"]["labels"] = pod_labels(base)
        args = container(same)["args"]
        args[args.index(f"--layers={layers_flag(args)}")] = f"--layers={first}:{end}"
        assert same == base, f"{d['metadata']['name']} differs from deploy/k8s/deployment.yaml"
        volumes = d["spec"]["template"]["spec"]["volumes"]
        assert [v["persistentVolumeClaim"]["claimName"] for v in volumes] == [claim]


# --- 4. the pipeline on the CPU -----------------------------------------------------------

CHECKPOINT = dict(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=100)
SPLIT = 2
SERVER_FLAGS = [*SMALL_SERVER_FLAGS, "--drain-sessions-timeout-s=0"]
TOLERANCE = 1e-5
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, server_bin):
    """(stage 0, stage 1, one server of every layer), CPU servers of one
    random checkpoint; the stages serve the pipeline profile's spans for
    LAYERSERVE_SPLIT=2 under its model name."""
    work = tmp_path_factory.mktemp("pipeline")
    model_dir = work / "tiny-llama"
    run(sys.executable, ROOT / "examples/random_checkpoint.py", model_dir,
        *[f"--{k.replace('_', '-')}={v}" for k, v in CHECKPOINT.items()], "--dtype=F32",
        "--seed=38")
    stages = pipeline_stages(LAYERSERVE_SPLIT=str(SPLIT), LAYERSERVE_MODEL_NAME="tiny")
    servers = []
    try:
        for i, stage in enumerate(stages):
            flags = [a for a in stage["command"] if a.startswith(("--layers=", "--model-name="))]
            servers.append(LayerserveProcess(server_bin, [*SERVER_FLAGS, *flags,
                                                          f"--model-dir={model_dir}"],
                                             work / f"stage-{i}.log"))
        servers.append(LayerserveProcess(server_bin, [*SERVER_FLAGS, "--model-name=tiny",
                                                      f"--model-dir={model_dir}"],
                                         work / "whole.log"))
        yield servers
    finally:
        for s in servers:
            s.stop()


def assert_equal_within(got, want, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err), err.shape)
    scale = max(1.0, float(np.abs(want).max()))
    assert err[worst] <= TOLERANCE * scale, (
        f"{what}: worst at {worst}: {got[worst]} vs {want[worst]} (scale {scale})")


def test_pipeline_stages_serve_the_split_spans(pipeline):
    first, second, whole = pipeline
    assert first.layers == (0, SPLIT) and second.layers == (SPLIT, CHECKPOINT["layers"])
    assert whole.layers == (0, CHECKPOINT["layers"])
    assert first.model == second.model == whole.model == "tiny"


def test_pipeline_chained_with_layerctl_equals_one_server(pipeline, ctl_bin, tmp_path):
    """deploy/README.md's commands: `layerctl infer` on stage 0, then on
    stage 1 with stage 0's output."""
    first, second, whole = pipeline
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((2, 8, CHECKPOINT["hidden"]))
            .astype("<f4"))

    def infer(server, inp, out):
        run(ctl_bin, "infer", f"--url={server.grpc_url}", "--model=tiny", f"--input={inp}",
            f"--output={out}")

    infer(first, x, tmp_path / "h.npy")
    infer(second, tmp_path / "h.npy", tmp_path / "y.npy")
    infer(whole, x, tmp_path / "ref.npy")
    assert_equal_within(np.load(tmp_path / "y.npy"), np.load(tmp_path / "ref.npy"),
                        f"chained :{SPLIT} -> {SPLIT}: against all layers")


def infer(client, x, **sequence):
    inp = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    headers = {"x-session-id": str(sequence["sequence_id"])} if sequence else None
    return client.infer("tiny", [inp], headers=headers, client_timeout=TIMEOUT_S,
                        **sequence).as_numpy("hidden_states")


def test_pipeline_sessions_through_both_stages_equal_one_server(pipeline):
    """A session stepped through both stages, as examples/pipeline_generate.py
    does (each stage keeps its own layers' keys and values under the one id),
    answers as a session on one server of every layer."""
    first, second, whole = pipeline
    rng = np.random.default_rng(1)
    steps = [rng.standard_normal((1, n, CHECKPOINT["hidden"])).astype(np.float32)
             for n in (5, 1, 1, 3)]
    clients = [grpcclient.InferenceServerClient(s.grpc_url) for s in pipeline]
    to_first, to_second, to_whole = clients
    sid = 38
    try:
        for i, x in enumerate(steps):
            sequence = dict(sequence_id=sid, sequence_start=i == 0,
                            sequence_end=i == len(steps) - 1)
            chained = infer(to_second, infer(to_first, x, **sequence), **sequence)
            want = infer(to_whole, x, **sequence)
            assert_equal_within(chained, want, f"session {sid}, step {i}")
    finally:
        for c in clients:
            c.close()
    for server in pipeline:
        open_now = server.samples().get(
            ("layerserve_sessions_open", frozenset({("model", "tiny")})), 0)
        assert open_now == 0, f"{server.layers}: a session left open"
