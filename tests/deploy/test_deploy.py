"""The deployment and observability files, checked without Docker or a GPU:
  1. Dockerfile and .dockerignore: instruction-level checks (no Dockerfile
     linter is packaged for Debian 12) of both images: the CPU one on Debian
     slim with nothing of CUDA, the CUDA one the default target; the script
     that picks their runtime packages, on this machine's build;
  2. deploy/docker-compose.yml: `docker-compose config -q` for every profile,
     a demo profile without a checkpoint, fully qualified pinned images, the
     cpu and demo profiles on the CPU image and the gpu one on the CUDA image
     (test_scale_out.py checks the replicas and pipeline profiles);
  3. Prometheus: `promtool check config`, `check rules`, `test rules`;
  4. the Grafana dashboard: parses; every query reads the ${datasource}
     variable (default: the provisioned uid) and filters by $model and
     $instance; a summary row, a latency heatmap, units that fit the queries;
  5. every metric named in a dashboard, rule or HPA/adapter file is exported
     by a real layerserve (live scrape on loopback; the CUDA-only families, and
     the KV cache ones when the server keeps no KV cache, are checked against
     the metrics header instead);
  6. a real Prometheus scrapes that server every second during a
     `layerctl bench` run, and each dashboard query, and the p99 latency,
     come back from its HTTP API;
  7. deploy/README.md's split-model recipe: two servers with --layers 0:2
     and 2:4 chained with `layerctl infer` give the full model's output;
  8. the README's quick start: scripts/serve.sh builds every binary the
     README then runs; its BF16 tritonclient example runs against a server;
     `cmake --install` of that build puts both on a prefix's PATH, with the
     example and the docs;
  9. Kubernetes: the claim the Deployment mounts exists, a disruption
     budget covers it, its image is pinned to the project version, every
     flag the Deployment and compose pass is one the server accepts, the
     kill timeouts outlast the drain, the HPA scales on what its adapter
     serves, and the Ingresses hash sessions onto the pods
     (test_ingress_limits.py checks their limits, test_scale_out.py the
     overlays in deploy/k8s-overlays);
 10. deploy/nginx/nginx.conf passes `nginx -t`, hashes on x-session-id and
     keeps its limits; deploy/haproxy/haproxy.cfg passes `haproxy -c` and
     rate-limits connections before TLS (test_session_routing.py runs nginx
     in front of three replicas, test_proxy_limits.py attacks through both).

scripts/test.sh runs this file as its "deploy-check" stage, after ctest; alone,
from the repository root:
  LAYERSERVE_BIN=build/server/layerserve LAYERCTL_BIN=build/client/layerctl \\
    python3 -m pytest -v tests/deploy
(those two are also the defaults). docker-compose, promtool, prometheus, nginx
and haproxy come from scripts/install-deps.sh; a missing one fails the tests that need it.
Servers and Prometheus listen on loopback only, on ports the kernel picks.
"""

import fnmatch
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from commands import compose, compose_services, run, tool
from layerserve_process import LayerserveProcess
from nginx_proxy import free_port, make_certificate, render_haproxy_cfg, render_nginx_conf

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

DATASOURCE_UID = "layerserve-prom"
# Families only the CUDA backend exports: the CPU server here cannot show
# them, so their names are checked against the metrics header instead.
CUDA_ONLY = {"layerserve_kernel_duration_seconds", "layerserve_gpu_memory_used_bytes",
             "layerserve_batch_launches_total", "layerserve_kernel_timing_sample_every",
             "layerserve_gemm_route"}
# Families a server exports only when its backend keeps a KV cache (after
# PrometheusMetrics::SetKvCache, called by server/main.cc). Where the live
# server's scrape lacks them, their names are checked against the metrics
# header instead and the dashboard's queries of them may come back empty; where
# it has them, they are checked live like every other family.
KV_CACHE_ONLY = {"layerserve_sessions_open", "layerserve_sessions_in_flight",
                 "layerserve_kv_cache_blocks_used", "layerserve_kv_cache_blocks",
                 "layerserve_kv_cache_block_tokens", "layerserve_kv_cache_bytes",
                 "layerserve_max_sessions", "layerserve_sessions_freed_total",
                 "layerserve_session_steps_rejected_total"}
# Families only a mixture-of-experts span exports (PrometheusMetrics::
# SetExperts): the demo server here is dense, so their names are checked
# against the metrics header, and the dashboard's queries of them may come
# back empty.
MOE_ONLY = {"layerserve_expert_tokens_total"}
# Families a server sets at start (PrometheusMetrics::SetLimits and
# SetBuildInfo, called by server/main.cc); test_limits_and_build_info_are_exported
# checks a live server exports them.
SET_AT_START = {"layerserve_max_queue_size", "layerserve_max_queue_bytes",
                "layerserve_max_batch_tokens", "layerserve_max_queue_delay_seconds",
                "layerserve_build_info"}
SERVER_FLAGS = ["--backend=cpu", "--cpu-threads=2"]
WAIT_S = 30  # for Prometheus to get ready, and then to scrape the server


# --- 1. Dockerfile ---------------------------------------------------------------

DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                       "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
                       "SHELL"}
FROM_RE = re.compile(r"(\S+)(?:\s+AS\s+(\S+))?", re.I)


class Dockerfile:
    """Logical instructions (comments dropped, backslash continuations
    joined) and the instructions of the final stage."""

    def __init__(self, path):
        self.instructions, pending = [], ""
        for line in open(path):
            s = line.rstrip("\n")
            if not pending and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if pending and s.lstrip().startswith("#"):
                continue
            if s.endswith("\\"):
                pending += s[:-1] + " "
                continue
            self.instructions.append((pending + s).strip())
            pending = ""
        self.ends_in_continuation = bool(pending)
        last_from = max((i for i, x in enumerate(self.instructions) if x.startswith("FROM ")),
                        default=0)
        self.final_stage = self.instructions[last_from:]
        # {stage name: its instructions, FROM first}, in file order.
        self.stages = {}
        for ins in self.instructions:
            m = FROM_RE.fullmatch(ins[len("FROM "):].strip()) if ins.startswith("FROM ") else None
            if m:
                current = self.stages.setdefault(m.group(2) or f"stage{len(self.stages)}", [])
            if self.stages:
                current.append(ins)

    def base_image(self, stage):
        return FROM_RE.fullmatch(self.stages[stage][0][len("FROM "):].strip()).group(1)

    def copied_from(self, stage):
        """The stages `stage` copies files from."""
        return {m.group(1) for x in self.stages[stage] if x.startswith("COPY ")
                for m in [re.search(r"--from=(\S+)", x)] if m}

    def split(self):
        """(keyword, rest) of every instruction."""
        return [(ins.partition(" ")[0], ins.partition(" ")[2]) for ins in self.instructions]


@pytest.fixture(scope="module")
def dockerfile():
    return Dockerfile(ROOT / "Dockerfile")


def test_dockerfile_syntax(dockerfile):
    errors = ["file ends inside a line continuation"] if dockerfile.ends_in_continuation else []
    for kw, rest in dockerfile.split():
        if kw.upper() not in DOCKER_INSTRUCTIONS:
            errors.append(f"unknown instruction {kw!r}")
        if kw != kw.upper():
            errors.append(f"instruction not upper case: {kw}")
        if kw == "FROM" and not FROM_RE.fullmatch(rest.strip()):
            errors.append(f"bad FROM: {rest}")
        if kw in ("CMD", "ENTRYPOINT", "HEALTHCHECK") and "[" in rest:
            try:
                json.loads(rest[rest.index("["):])
            except ValueError as e:
                errors.append(f"{kw} exec form is not valid JSON: {e}")
    assert not errors


def test_dockerfile_stages_are_tagged_and_named(dockerfile):
    errors, stages = [], []
    for kw, rest in dockerfile.split():
        if kw == "FROM":
            m = FROM_RE.fullmatch(rest.strip())
            if not m:
                continue  # test_dockerfile_syntax reports it
            image, name = m.groups()
            if not re.search(r":\S", image.replace("${CUDA_VERSION}", "x")):
                errors.append(f"FROM without a tag: {image}")
            stages.append(name)
        elif kw == "COPY":
            m = re.search(r"--from=(\S+)", rest)
            if m and m.group(1) not in stages[:-1]:
                errors.append(f"COPY --from={m.group(1)} names no earlier stage")
    if len(stages) < 2:
        errors.append("expected a multi-stage build")
    assert not errors


def test_dockerfile_base_images_are_fully_qualified(dockerfile):
    """As compose's images are (deploy/README.md says every image is)."""
    bad = []
    for kw, rest in dockerfile.split():
        m = FROM_RE.fullmatch(rest.strip()) if kw == "FROM" else None
        if m and not image_is_fully_qualified(m.group(1).replace("${CUDA_VERSION}", "13.0.2")):
            bad.append(m.group(1))
    assert not bad, "FROM images without a registry or with a floating tag"


# The images compose runs: {its variable: the Dockerfile target that makes it}.
COMPOSE_IMAGES = {"LAYERSERVE_IMAGE": "runtime", "LAYERSERVE_CPU_IMAGE": "cpu"}


def compose_default_image(variable):
    return re.search(r"\$\{" + variable + r":-([^}]+)\}",
                     (DEPLOY / "docker-compose.yml").read_text()).group(1)


def test_dockerfile_build_comments_tag_the_images_compose_runs(dockerfile):
    text = (ROOT / "Dockerfile").read_text()
    for variable, target in COMPOSE_IMAGES.items():
        default = compose_default_image(variable)
        # The last stage is what a build without --target makes.
        target_arg = "" if target == list(dockerfile.stages)[-1] else f"--target {target} "
        assert f"docker build {target_arg}-t {default} ." in text, (
            f"the build comment should tag {default} ({target_arg or 'no --target'})")


@pytest.mark.parametrize("stage", ["cpu", "runtime"])
def test_dockerfile_image_stages(dockerfile, stage):
    """Non-root, both ports, a health check and layerserve as the entry
    point, in each image compose and Kubernetes run."""
    assert stage in dockerfile.stages, f"no stage {stage}"
    tail = dockerfile.stages[stage]
    errors = []
    users = [x[len("USER "):].strip() for x in tail if x.startswith("USER ")]
    if (users[-1] if users else "root") in ("root", "0"):
        errors.append("runs as root")
    exposed = " ".join(x[len("EXPOSE "):] for x in tail if x.startswith("EXPOSE ")).split()
    errors += [f"does not EXPOSE {port}" for port in ("8001", "8002") if port not in exposed]
    healthchecks = [x for x in tail if x.startswith("HEALTHCHECK")]
    if not healthchecks or "health" not in healthchecks[0]:
        errors.append("has no layerctl health HEALTHCHECK")
    if not any(x.startswith("ENTRYPOINT") and "layerserve" in x for x in tail):
        errors.append("ENTRYPOINT is not layerserve")
    assert not errors


def test_dockerfile_last_stage_is_the_cuda_image(dockerfile):
    """`docker build .` without --target keeps making the CUDA image that
    deploy/k8s and the gpu profile run."""
    assert list(dockerfile.stages)[-1] == "runtime"
    assert dockerfile.final_stage == dockerfile.stages["runtime"]
    assert "cuda" in dockerfile.base_image("runtime")


def test_cpu_image_is_debian_slim_without_cuda(dockerfile):
    """The cpu and demo profiles' image (finding 5 of the adoption issue:
    they shipped the multi-GB CUDA runtime): Debian slim, built and run with
    no CUDA, from stages that take nothing from the CUDA ones."""
    stages, todo = set(), ["cpu"]
    while todo:  # the cpu stage and every stage it copies from
        stage = todo.pop()
        stages.add(stage)
        todo += [s for s in dockerfile.copied_from(stage) if s not in stages]
    assert stages == {"cpu", "cpu-build"}, stages
    errors = []
    for stage in sorted(stages):
        base = dockerfile.base_image(stage)
        if not re.fullmatch(r"docker\.io/library/debian:\d+-slim", base):
            errors.append(f"{stage} is FROM {base}, not Debian slim")
        for ins in dockerfile.stages[stage]:
            if re.search(r"cuda|nvidia", ins.replace("-DLAYERSERVE_CUDA=OFF", ""), re.I):
                errors.append(f"{stage} mentions CUDA: {ins[:80]}")
    build = " ".join(dockerfile.stages["cpu-build"])
    if "-DLAYERSERVE_CUDA=OFF" not in build or "LAYERSERVE_BUILD_TESTS=OFF" not in build:
        errors.append("cpu-build does not configure -DLAYERSERVE_CUDA=OFF without tests")
    assert not errors


def apt_installs(instructions):
    """The packages `apt-get install` names in these instructions."""
    names = []
    for ins in instructions:
        for part in ins.split("&&"):
            if "apt-get install" in part:
                names += [w for w in part.split("apt-get install", 1)[1].split()
                          if not w.startswith("-")]
    return names


def test_cpu_build_installs_only_what_the_project_builds_with(dockerfile):
    """The CPU image builds with the packages scripts/install-deps.sh gives
    every build the project tests (its SERVE_DEBS; g++ is build-essential's),
    so that it builds as those do."""
    text = (ROOT / "scripts/install-deps.sh").read_text()
    serve_debs = set(re.search(r"SERVE_DEBS=\(([^)]*)\)", text).group(1).split()) | {"g++"}
    installed = apt_installs(dockerfile.stages["cpu-build"])
    assert installed, "the cpu-build stage installs nothing"
    assert not set(installed) - serve_debs, sorted(set(installed) - serve_debs)


def test_runtime_debs_names_the_packages_of_the_built_server(server_bin, ctl_bin):
    """scripts/runtime-debs.sh, which both build stages run to choose what
    their image installs, on this machine's build (Debian 12, as the cpu
    image): the C library, gRPC's and OpenBLAS's packages, nothing of CUDA."""
    debs = run("bash", ROOT / "scripts/runtime-debs.sh", server_bin, ctl_bin).split()
    assert "libc6" in debs and any(d.startswith("libgrpc++") for d in debs), debs
    assert any(d.startswith("libopenblas0") for d in debs), debs
    assert not [d for d in debs if "cuda" in d or "cublas" in d], debs


@pytest.mark.parametrize("stage", ["cpu-build", "build"])
def test_dockerfile_build_turns_tests_off(dockerfile, stage):
    assert any("LAYERSERVE_BUILD_TESTS=OFF" in x for x in dockerfile.stages[stage])


def test_dockerignore_keeps_what_the_build_reads():
    patterns = [p.strip().rstrip("/") for p in open(ROOT / ".dockerignore")
                if p.strip() and not p.startswith("#")]
    needed = {"CMakeLists.txt"} | set(
        re.findall(r"add_subdirectory\((\S+?)\)", (ROOT / "CMakeLists.txt").read_text()))
    excluded = [f"{pat!r} excludes {path}" for path in sorted(needed) for pat in patterns
                if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/")]
    assert not excluded, "the build needs what these .dockerignore patterns exclude"


# --- 2. docker-compose --------------------------------------------------------------

# Every profile of docker-compose.yml (test_scale_out.py checks replicas and
# pipeline further).
PROFILES = ("demo", "gpu", "cpu", "replicas", "pipeline")


@pytest.mark.parametrize("profile", ["", *PROFILES], ids=["no-profile", *PROFILES])
def test_compose_config_is_valid(profile):
    compose(*(["--profile", profile] if profile else []), "config", "-q")


def test_compose_services():
    services = sorted(compose("config", "--services").split())
    assert services == ["grafana", "layerserve-cpu", "layerserve-demo", "layerserve-gpu",
                        "layerserve-gpu0", "layerserve-gpu1", "layerserve-gpu2", "layerserve-gpu3",
                        "layerserve-stage0", "layerserve-stage1", "nginx", "prometheus"]


def test_compose_demo_profile_needs_no_checkpoint():
    demo = compose_services("demo")["layerserve-demo"]
    assert not any(a.startswith("--model-dir") for a in demo["command"]), demo["command"]
    assert not demo.get("volumes"), "the demo profile mounts a checkpoint"
    assert "--backend=cpu" in demo["command"] and "deploy" not in demo


@pytest.mark.parametrize("service,variable", [("layerserve-demo", "LAYERSERVE_CPU_IMAGE"),
                                              ("layerserve-cpu", "LAYERSERVE_CPU_IMAGE"),
                                              ("layerserve-gpu", "LAYERSERVE_IMAGE")])
def test_compose_profiles_build_and_run_their_image(dockerfile, service, variable):
    """demo and cpu: the Dockerfile's Debian-slim CPU image; gpu: its CUDA
    image. Each service builds the target that makes the image it runs."""
    config = compose_services(*PROFILES)[service]
    target = COMPOSE_IMAGES[variable]
    assert config["image"] == compose_default_image(variable), config["image"]
    assert config["build"].get("target") == target, config["build"]
    assert Path(config["build"]["context"]).resolve() == ROOT
    assert config["build"].get("dockerfile", "Dockerfile") == "Dockerfile"
    assert target in dockerfile.stages


def image_is_fully_qualified(image):
    """registry/path:tag, the registry a host name (a dot or a port) or
    localhost, and a tag other than latest."""
    first, _, rest = image.partition("/")
    registry = rest and ("." in first or ":" in first or first == "localhost")
    tag = rest.rpartition(":")[2] if ":" in rest else ""
    return bool(registry and tag and tag != "latest")


def test_compose_images_are_fully_qualified_and_pinned():
    bad = {n: s.get("image") for n, s in compose_services(*PROFILES).items()
           if not image_is_fully_qualified(s.get("image", ""))}
    assert not bad, "images without a registry or with a floating tag"


def test_compose_gpu_profile_reserves_the_device():
    assert "driver: nvidia" in compose("--profile", "gpu", "config"), \
        "the gpu profile lost its device reservation"


# --- 3. promtool ----------------------------------------------------------------------

def test_promtool_check_config():
    run(tool("promtool"), "check", "config", "--syntax-only", DEPLOY / "prometheus/prometheus.yml")


def test_promtool_check_rules():
    rules = sorted(glob.glob(str(DEPLOY / "prometheus/rules/*.yml")))
    assert rules
    run(tool("promtool"), "check", "rules", *rules)


def test_promtool_test_rules():
    tests_dir = DEPLOY / "prometheus/tests"
    tests = sorted(p.name for p in tests_dir.glob("*.yml"))
    assert tests
    run(tool("promtool"), "test", "rules", *tests, cwd=tests_dir)


# --- 4. Grafana dashboard ---------------------------------------------------------------

DASHBOARD = json.loads((DEPLOY / "grafana/dashboards/layerserve.json").read_text())


def test_datasource_is_provisioned_with_the_dashboards_uid():
    datasource = (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    assert f"uid: {DATASOURCE_UID}" in datasource


def dashboard_variable(name):
    return next((v for v in DASHBOARD["templating"]["list"] if v["name"] == name), None)


def test_dashboard_panels_use_the_datasource_variable():
    """Every panel and query reads the ${datasource} variable, so the
    dashboard imports into any Grafana; it defaults to the provisioned uid."""
    variable = dashboard_variable("datasource")
    assert variable and variable["type"] == "datasource" and variable["query"] == "prometheus"
    assert variable["current"]["value"] == DATASOURCE_UID
    uses = [p.get("datasource") for p in DASHBOARD["panels"] if p["type"] != "row"]
    uses += [t["datasource"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    uses += [v["datasource"] for v in DASHBOARD["templating"]["list"] if "datasource" in v]
    bad = [u for u in uses if u != {"type": "prometheus", "uid": "${datasource}"}]
    assert not bad, "datasources other than the ${datasource} variable"


def test_dashboard_filters_every_series_by_model_and_instance():
    assert dashboard_variable("instance")["definition"].startswith("label_values(")
    bad = []
    for p in DASHBOARD["panels"]:
        for t in p.get("targets", []):
            for selector in re.findall(r"layerserve_\w+(\{[^}]*\})?", t["expr"]):
                if 'model=~"$model"' not in selector or 'instance=~"$instance"' not in selector:
                    bad.append(f"{p['title']}: {t['expr']}")
    assert not bad, "queries not filtered by $model and $instance"


def test_dashboard_opens_with_a_summary_row_of_stats():
    panels = sorted(DASHBOARD["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert panels[0]["type"] == "row" and panels[0]["title"] == "Summary"
    top = [p for p in panels[1:] if p["gridPos"]["y"] < panels[0]["gridPos"]["y"] + 5]
    assert len(top) >= 4 and all(p["type"] == "stat" for p in top), [p["title"] for p in top]


def test_dashboard_has_a_latency_heatmap():
    heatmaps = [p for p in DASHBOARD["panels"] if p["type"] == "heatmap"]
    assert heatmaps, "no heatmap panel"
    (target,) = heatmaps[0]["targets"]
    assert "layerserve_request_duration_seconds_bucket" in target["expr"]
    assert target["format"] == "heatmap" and "by (le)" in target["expr"]
    assert heatmaps[0]["options"]["yAxis"]["unit"] == "s"
    assert heatmaps[0]["options"]["calculate"] is False  # the server's buckets, not re-binned


def expected_unit(expr):
    """The unit a panel showing `expr` must have, from what it computes."""
    if "histogram_quantile" in expr:
        return "s" if "_seconds_bucket" in expr else "short"
    if re.search(r"_seconds_sum\b.*\)\s*$", expr) and " / " not in expr:
        return "percentunit"  # seconds per second: a busy fraction
    if " / " in expr and "layerserve_requests_total" in expr:
        return "percentunit"  # a share of the calls
    if "rate(layerserve_requests_total" in expr or "rate(layerserve_rejections_total" in expr:
        return "reqps"
    if "rate(layerserve_batch_tokens_sum" in expr and " / " not in expr:
        return "suffix: tokens/s"
    if "_bytes" in expr:
        return "bytes"
    return None


def test_dashboard_units_match_the_queries():
    bad = []
    for p in DASHBOARD["panels"]:
        if p["type"] in ("row", "heatmap"):
            continue
        unit = p["fieldConfig"]["defaults"]["unit"]
        for t in p["targets"]:
            want = expected_unit(t["expr"])
            if want and want != unit:
                bad.append(f"{p['title']}: {unit!r}, expected {want!r} for {t['expr']}")
    assert not bad, "panels with a wrong unit"


def test_dashboard_panel_ids_are_unique():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))


# --- 5. metric names against a live server ---------------------------------------------

def promql_expressions():
    """(where, expression) for every PromQL expression or metric name of the
    dashboard, the recording and alerting rules, the HPA and its adapter."""
    exprs = []
    for p in DASHBOARD["panels"]:
        for t in p.get("targets", []):
            exprs.append(("dashboard: " + p["title"], t["expr"]))
    for v in DASHBOARD["templating"]["list"]:
        if "definition" in v:
            exprs.append(("dashboard variable " + v["name"], v["definition"]))
    for f in sorted(glob.glob(str(DEPLOY / "prometheus/rules/*.yml"))):
        for g in yaml.safe_load(open(f))["groups"]:
            for r in g["rules"]:
                exprs.append((f"rule {r.get('record') or r.get('alert')}", str(r["expr"])))
    for r in adapter_rules():
        exprs.append(("adapter seriesQuery", r["seriesQuery"]))
        exprs.append(("adapter metricsQuery", r["metricsQuery"]))
    # The HPA names what the adapter serves; a name the adapter gives a
    # computed series (as:) is checked through the adapter's queries above.
    renamed = {r["name"]["as"] for r in adapter_rules()
               if r["name"]["as"] != r["name"]["matches"].strip("^$")}
    for name in hpa_metric_names():
        if name not in renamed:
            exprs.append(("hpa metric", name))
    return exprs


def adapter_rules():
    return yaml.safe_load(open(DEPLOY / "k8s/prometheus-adapter-values.yaml"))["rules"]["custom"]


def hpa_metric_names():
    hpa = yaml.safe_load(open(DEPLOY / "k8s/hpa.yaml"))
    return [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]


def test_hpa_scales_on_what_the_adapter_serves():
    """Queue depth, KV cache use and open sessions (issue 38), each a metric
    the adapter's rules expose under that name."""
    served = {r["name"]["as"] for r in adapter_rules()}
    names = hpa_metric_names()
    assert set(names) <= served, f"HPA metrics the adapter does not serve: {set(names) - served}"
    assert {"layerserve_queue_depth", "layerserve_kv_cache_used_ratio",
            "layerserve_sessions_open"} <= set(names)


# The series names a family of each type puts on the wire (a histogram has no
# series under its own name). The parser names a counter family without _total.
SERIES_SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                   "summary": ["", "_sum", "_count"]}


def queryable_names(metrics_text):
    """Every series name the scrape's families make available to PromQL,
    including those of labelled families with no series yet."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names |= {family.name + s for s in SERIES_SUFFIXES.get(family.type, [""])}
        names |= {s.name for s in family.samples}
    return names


def declared_in_header():
    header = (ROOT / "server/metrics/prometheus_metrics.h").read_text()
    return set(re.findall(r"(layerserve_\w+)\{", header))


@pytest.fixture(scope="module")
def full_server(server_bin, tmp_path_factory):
    """The demo model, all layers: the server every live check talks to."""
    with LayerserveProcess(server_bin, SERVER_FLAGS,
                           tmp_path_factory.mktemp("full") / "layerserve.log") as server:
        yield server


@pytest.fixture(scope="module")
def served_metrics(full_server, ctl_bin):
    """The /metrics text after one request, so that every labelled family
    has a series."""
    run(ctl_bin, "bench", f"--url={full_server.grpc_url}", "--model=demo", "--tokens=4",
        "--concurrency=1", "--duration-s=1", "--warmup-s=0", "--no-progress")
    return full_server.scrape()[2]


def test_layerctl_health_is_serving(full_server, ctl_bin):
    run(ctl_bin, "health", f"--url={full_server.grpc_url}")


def test_cuda_only_families_are_declared_in_the_header():
    assert CUDA_ONLY <= declared_in_header(), "CUDA-only families missing from prometheus_metrics.h"


def test_moe_families_are_declared_in_the_header():
    assert MOE_ONLY <= declared_in_header(), "MoE families missing from prometheus_metrics.h"


def test_kv_cache_families_are_declared_in_the_header():
    missing = KV_CACHE_ONLY - declared_in_header()
    assert not missing, "KV cache families missing from prometheus_metrics.h"


def test_kv_cache_families_come_all_together_or_not_at_all(served_metrics):
    """SetKvCache creates every session and KV cache family at once; a server
    without a KV cache exports none of them (no 0 / 0 ratio, no limit of 0)."""
    present = KV_CACHE_ONLY & queryable_names(served_metrics)
    assert present in (set(), KV_CACHE_ONLY), f"only some KV cache families: {sorted(present)}"


def test_every_metric_named_is_exported(served_metrics):
    exported, declared = queryable_names(served_metrics), declared_in_header()
    unknown = []
    for where, expr in promql_expressions():
        # A metric name, not part of a recorded name (level:metric:operations).
        for name in re.findall(r"(?<![\w:])(layerserve_[a-z0-9_]+)", expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in exported and not (family in CUDA_ONLY | KV_CACHE_ONLY | MOE_ONLY
                                             and family in declared):
                unknown.append(f"{where}: {name}")
    assert not unknown, "metrics no server exports"


def test_limits_and_build_info_are_exported(served_metrics):
    assert SET_AT_START <= queryable_names(served_metrics)


def test_process_and_request_families_of_a_live_server(full_server, served_metrics):
    """The process_* families (read from /proc at scrape time), tokens per
    request and rejections by reason, as prometheus_client parses them."""
    families = {f.name: f for f in text_string_to_metric_families(served_metrics)}
    value = {f.name: f.samples[0].value for f in families.values()
             if f.name.startswith("process_") and len(f.samples) == 1}
    assert families["process_cpu_seconds"].type == "counter"
    assert value["process_cpu_seconds"] > 0
    assert abs(value["process_start_time_seconds"] - time.time()) < 3600
    assert value["process_resident_memory_bytes"] > 1 << 20
    assert value["process_virtual_memory_bytes"] >= value["process_resident_memory_bytes"]
    assert len(os.listdir(f"/proc/{full_server.pid}/fd")) == pytest.approx(
        value["process_open_fds"], abs=4)
    assert 0 < value["process_open_fds"] < value["process_max_fds"]
    assert value["process_threads"] == pytest.approx(
        len(os.listdir(f"/proc/{full_server.pid}/task")), abs=4)
    tokens = families["layerserve_request_tokens"]
    assert tokens.type == "histogram"
    count = next(s.value for s in tokens.samples if s.name.endswith("_count"))
    total = next(s.value for s in tokens.samples if s.name.endswith("_sum"))
    assert count > 0 and total == 4 * count  # the bench sends [1, 4, hidden]
    reasons = {s.labels["reason"] for s in families["layerserve_rejections"].samples
               if s.name.endswith("_total")}
    assert {"resource_exhausted", "invalid", "unknown_model", "unknown_session", "session_state",
            "unavailable", "deadline", "cancelled"} <= reasons


def test_unknown_model_is_not_counted_as_the_served_model(server_bin, tmp_path):
    """Calls naming a model (or version) this server does not serve count
    under model="other" in metrics and not at all in ModelStatistics; the
    client's name never becomes a label."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    from layerserve_process import parse_samples, sample, total

    with LayerserveProcess(server_bin, SERVER_FLAGS, tmp_path / "layerserve.log") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        x = grpcclient.InferInput("hidden_states", [1, 2, 512], "FP32")
        x.set_data_from_numpy(np.zeros((1, 2, 512), np.float32))
        calls = [("no_such_model", ""), ("demo", "7")]
        for name, version in calls:
            with pytest.raises(InferenceServerException, match="StatusCode.NOT_FOUND"):
                client.infer(name, [x], model_version=version, client_timeout=30)
        client.infer("demo", [x], client_timeout=30)
        samples = parse_samples(server.scrape()[2])
        stats = client.get_inference_statistics("demo", as_json=True)["model_stats"][0]
        client.close()

    assert sample(samples, "layerserve_requests_total", model="demo", code="NOT_FOUND") == 0
    assert sample(samples, "layerserve_requests_total", model="demo", code="OK") == 1
    assert sample(samples, "layerserve_requests_total", model="other",
                  code="NOT_FOUND") == len(calls)
    assert total(samples, "layerserve_request_duration_seconds_count") == 1
    models = {dict(labels).get("model") for (_, labels) in samples if dict(labels).get("model")}
    assert models <= {"demo", "other"}, f"a client's model name became a label: {models}"
    fail = stats["inference_stats"].get("fail", {})
    assert int(fail.get("count", 0)) == 0, f"unknown-model calls counted as demo's failures: {stats}"
    assert int(stats["inference_stats"]["success"]["count"]) == 1


# --- 6. a live Prometheus ---------------------------------------------------------------

def metric_names(expr):
    """The metric names an expression reads (not recorded names)."""
    return set(re.findall(r"(?<![\w:])(layerserve_[a-z0-9_]+)", expr))


def dashboard_queries():
    """pytest params: each dashboard query with Grafana's variables filled in,
    whether it must return a series on the CPU backend, and the KV cache
    families it reads (it need return none when the server keeps no KV cache)."""
    params = []
    for p in DASHBOARD["panels"]:
        for t in p.get("targets", []):
            q = (t["expr"].replace("$__rate_interval", "30s").replace("$model", ".*")
                 .replace("$instance", ".*"))
            needs_data = not any(c in q for c in CUDA_ONLY | MOE_ONLY)
            kv_families = metric_names(q) & KV_CACHE_ONLY
            params.append(pytest.param(q, needs_data, kv_families,
                                       id=f"{p['title']} {t.get('refId', '')}"))
    return params


class Prometheus:
    """A prometheus process and its HTTP API."""

    def __init__(self, config, workdir):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [tool("prometheus"), f"--config.file={config}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_tail(self, lines=20):
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=10) as res:
            return json.load(res) if path.startswith("/api/") else res.read()

    def query(self, q):
        body = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": q}))
        assert body["status"] == "success", f"{q}: {body}"
        return body["data"]["result"]

    def wait_until(self, what, ready):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited; log:\n{self.log_tail()}"
            try:
                if ready():
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        pytest.fail(f"prometheus: {what} not within {WAIT_S} s; log:\n{self.log_tail()}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def live_prometheus_config(full_server, tmp_path_factory):
    """deploy/prometheus/prometheus.yml, scraping the live server every second."""
    cfg = yaml.safe_load(open(DEPLOY / "prometheus/prometheus.yml"))
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["rule_files"] = [str(DEPLOY / "prometheus/rules/*.yml")]
    (job,) = cfg["scrape_configs"]
    job.pop("dns_sd_configs")  # the compose network's alias
    job["static_configs"] = [{"targets": [f"127.0.0.1:{full_server.metrics_port}"]}]
    path = tmp_path_factory.mktemp("prometheus") / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def prometheus(live_prometheus_config, full_server, ctl_bin):
    """A real Prometheus that has scraped the server every second through a
    5 s `layerctl bench` run, and a few times after it."""
    prom = Prometheus(live_prometheus_config, live_prometheus_config.parent)
    try:
        prom.wait_until("/-/ready", lambda: prom.get("/-/ready") is not None)
        # Ready is not scraped: wait for the first successful scrape.
        prom.wait_until("a scrape of the server", lambda: prom.query('up{job="layerserve"} == 1'))
        bench = run(ctl_bin, "bench", f"--url={full_server.grpc_url}", "--model=demo",
                    "--tokens=8", "--concurrency=4", "--duration-s=5", "--no-progress")
        print("bench:", next((x for x in bench.splitlines() if "req/s" in x), bench[:200]))
        time.sleep(3)  # a few scrapes after the last request
        yield prom
    finally:
        prom.stop()


def test_live_prometheus_config_is_valid(live_prometheus_config):
    run(tool("promtool"), "check", "config", live_prometheus_config)


def test_prometheus_computes_p99_latency_of_the_bench(prometheus):
    p99_q = ("histogram_quantile(0.99, sum by (le) "
             "(rate(layerserve_request_duration_seconds_bucket[30s])))")
    deadline = time.monotonic() + 20
    while True:
        res = prometheus.query(p99_q)
        p99 = float(res[0]["value"][1]) if res else math.nan
        if math.isfinite(p99) and p99 > 0:
            break
        if time.monotonic() > deadline:
            counts = prometheus.query("layerserve_request_duration_seconds_count[60s]")
            pytest.fail(f"no finite p99 from prometheus within 20 s: {p99_q}\n"
                        f"last result: {res}\nrequest counts scraped: {counts}")
        time.sleep(1)
    print(f"prometheus: p99 request latency over the bench = {p99 * 1e3:.2f} ms")


def test_prometheus_scrape_target_is_up(prometheus):
    up = prometheus.query('up{job="layerserve"}')
    assert up and up[0]["value"][1] == "1", f"scrape target not up: {up}"


@pytest.mark.parametrize("query,needs_data,kv_families", dashboard_queries())
def test_prometheus_answers_dashboard_query(prometheus, served_metrics, query, needs_data,
                                            kv_families):
    needs_data = needs_data and kv_families <= queryable_names(served_metrics)
    result = prometheus.query(query)
    assert result or not needs_data, f"no data after the bench: {query}"


def test_prometheus_loads_the_rules_without_errors(prometheus):
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    assert groups, "no rule groups loaded"
    failing = [r["name"] for g in groups for r in g["rules"] if r.get("health") == "err"]
    assert not failing, "rules failing to evaluate"


# --- 7. split-model recipe ---------------------------------------------------------------

def test_split_model_recipe(full_server, server_bin, ctl_bin, tmp_path):
    """deploy/README.md: layers 0:2 on one server, 2:4 on another, chained
    with `layerctl infer`, equal the full model's output."""
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((2, 16, 512)).astype("<f4"))

    def infer(server, inp, out):
        run(ctl_bin, "infer", f"--url={server.grpc_url}", "--model=demo", f"--input={inp}",
            f"--output={out}")

    with LayerserveProcess(server_bin, [*SERVER_FLAGS, "--layers=0:2"], tmp_path / "first.log") as a, \
         LayerserveProcess(server_bin, [*SERVER_FLAGS, "--layers=2:4"], tmp_path / "second.log") as b:
        infer(a, x, tmp_path / "h.npy")
        infer(b, tmp_path / "h.npy", tmp_path / "y.npy")
    infer(full_server, x, tmp_path / "ref.npy")

    y, ref = np.load(tmp_path / "y.npy"), np.load(tmp_path / "ref.npy")
    assert y.shape == ref.shape
    err = np.abs(y.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] <= 1e-5 * max(1.0, float(np.abs(ref).max())), (
        f"chained 0:2 -> 2:4 differs from 0:4: worst at {worst}: {y[worst]} vs {ref[worst]}")


# --- 8. quick start ------------------------------------------------------------------------

def test_serve_script_builds_every_binary_the_quick_start_runs():
    """README: `scripts/serve.sh`, then `build/client/layerctl health` from
    another shell: every build/<dir>/<binary> the README runs must be a
    target that serve.sh builds."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    used = set(re.findall(r"^build/\w+/([\w-]+)", quick_start, re.M))
    assert {"layerserve", "layerctl"} <= used, f"quick start no longer runs them: {used}"
    serve = (ROOT / "scripts/serve.sh").read_text()
    built = re.search(r'LAYERSERVE_BUILD_TARGETS="?([\w -]+?)"? bash', serve)
    assert built, "serve.sh no longer names its build targets"
    missing = used - set(built.group(1).split())
    assert not missing, f"scripts/serve.sh does not build {sorted(missing)}"


def test_cmake_install_puts_the_server_layerctl_and_the_example_on_a_prefix(server_bin, ctl_bin, tmp_path):
    """Finding 3 of the adoption issue: nothing could be installed, and
    examples/README.md calls a bare `layerserve`. `cmake --install` of the
    build that made the server (the tree above build/server/) puts layerserve
    and layerctl in PREFIX/bin, runnable from there, the pipeline example and
    the checkpoint commands in PREFIX/share/layerserve/examples and the
    license and docs in
    PREFIX/share/doc/layerserve."""
    build = Path(server_bin).resolve().parents[1]
    assert (build / "cmake_install.cmake").exists(), f"{build} is not a CMake build tree"
    prefix = tmp_path / "prefix"
    run(tool("cmake"), "--install", build, "--prefix", prefix)
    version = (ROOT / "CMakeLists.txt").read_text().split("project(layerserve VERSION ", 1)[1].split()[0]
    for name in ("layerserve", "layerctl"):
        found = shutil.which(name, path=f"{prefix / 'bin'}:/usr/bin:/bin")
        assert found == str(prefix / "bin" / name), f"{name} is not on the prefix's PATH: {found}"
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and out.stdout == f"{name} {version}\n", (name, out.stdout, out.stderr)
    examples = prefix / "share/layerserve/examples"
    for program in ("pipeline_generate.py", "gguf_to_hf.py", "random_checkpoint.py"):
        assert os.access(examples / program, os.X_OK), f"{program} is not installed as a program"
    assert (examples / "README.md").exists()
    # The installed commands find the module they share beside them.
    run(sys.executable, examples / "random_checkpoint.py", tmp_path / "tiny", "--layers", "1",
        "--hidden", "64", "--intermediate", "64", "--vocab", "16")
    assert (tmp_path / "tiny/model.safetensors").exists()
    for doc in ("LICENSE", "README.md", "docs/protocol.md", "docs/flags.md"):
        assert (prefix / "share/doc/layerserve" / doc).exists(), doc


def cuda_choice(tmp_path, nvidia_smi=None, env_cuda=None):
    """scripts/common.sh's cuda_choice with PATH holding only a fake
    nvidia-smi (printing `nvidia_smi`) or none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.unlink(missing_ok=True)
    if nvidia_smi is not None:
        fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{nvidia_smi}'\n")
        fake.chmod(0o755)
    # PATH holds the fake and the tools cuda_choice uses, never the
    # machine's own nvidia-smi.
    for tool in ("grep", "dirname"):
        link = bin_dir / tool
        if not link.exists():
            link.symlink_to(shutil.which(tool))
    env = {"PATH": str(bin_dir)}
    if env_cuda is not None:
        env["LAYERSERVE_CUDA"] = env_cuda
    out = subprocess.run([shutil.which("bash"), "-c", f"source {ROOT}/scripts/common.sh && cuda_choice"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_serve_script_builds_the_cuda_backend_only_where_a_gpu_is(tmp_path):
    """Finding 4 of the adoption issue: the CPU quick start compiled the CUDA
    kernels on machines with no GPU. serve.sh builds with cuda_choice's
    setting: OFF without nvidia-smi or with one that lists no GPU, ON with a
    GPU, and LAYERSERVE_CUDA forces either."""
    assert cuda_choice(tmp_path) == "OFF"
    assert cuda_choice(tmp_path, nvidia_smi="No devices were found") == "OFF"
    assert cuda_choice(tmp_path, nvidia_smi="GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)") == "ON"
    assert cuda_choice(tmp_path, env_cuda="ON") == "ON"
    assert cuda_choice(tmp_path, nvidia_smi="GPU 0: NVIDIA H100", env_cuda="OFF") == "OFF"
    serve = (ROOT / "scripts/serve.sh").read_text()
    assert "cuda=$(cuda_choice)" in serve and '-DLAYERSERVE_CUDA="$cuda"' in serve


def test_serve_script_installs_only_what_the_build_needs():
    """serve.sh asks install-deps.sh for the build's packages (no deployment,
    test or benchmark tools); every one of them is also in the full list."""
    serve = (ROOT / "scripts/serve.sh").read_text()
    assert "LAYERSERVE_DEPS=serve bash" in serve
    deps = (ROOT / "scripts/install-deps.sh").read_text()

    def listed(name):
        body = re.search(rf"^{name}=\((.*?)^\)", deps, re.M | re.S).group(1)
        return {w for line in body.splitlines() for w in line.split("#")[0].split()}
    serve_debs, all_debs = listed("SERVE_DEBS"), listed("DEBS")
    assert serve_debs <= all_debs, f"serve packages not in the full list: {serve_debs - all_debs}"
    assert not serve_debs & {"docker-compose", "prometheus", "clang-format", "python3-pip", "libb64-0d"}


# --- 9. Kubernetes manifests --------------------------------------------------------------

def k8s_objects():
    objects = []
    for f in sorted(glob.glob(str(DEPLOY / "k8s/*.yaml"))):
        if f.endswith(("-values.yaml", "kustomization.yaml")):
            continue  # helm values and the kustomize base, not manifests
        objects += [o for o in yaml.safe_load_all(open(f)) if o]
    return objects


def k8s_deployment():
    (deployment,) = [o for o in k8s_objects() if o["kind"] == "Deployment"]
    return deployment


def test_k8s_every_claim_the_deployment_mounts_exists():
    claims = {o["metadata"]["name"]: o for o in k8s_objects()
              if o["kind"] == "PersistentVolumeClaim"}
    wanted = [v["persistentVolumeClaim"]["claimName"]
              for v in k8s_deployment()["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v]
    assert wanted and all(c in claims for c in wanted), f"missing claims: {wanted} vs {list(claims)}"
    for c in wanted:  # every replica mounts it, read-only
        assert "ReadOnlyMany" in claims[c]["spec"]["accessModes"]


def test_k8s_disruption_budget_covers_the_deployment():
    pod_labels = k8s_deployment()["spec"]["template"]["metadata"]["labels"]
    budgets = [o for o in k8s_objects() if o["kind"] == "PodDisruptionBudget"]
    assert budgets, "no PodDisruptionBudget"
    selector = budgets[0]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert "maxUnavailable" in budgets[0]["spec"] or "minAvailable" in budgets[0]["spec"]


def test_k8s_image_is_pinned_to_the_project_version():
    (container,) = k8s_deployment()["spec"]["template"]["spec"]["containers"]
    version = re.search(r"project\(layerserve VERSION (\S+)",
                        (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert image_is_fully_qualified(container["image"]), container["image"]
    assert container["image"].endswith(":" + version), (container["image"], version)


def flag_value(args, flag, default):
    """The integer value of --flag=N in `args`, or `default`."""
    for a in args:
        if a.startswith(flag + "="):
            return int(a.split("=", 1)[1])
    return default


def server_default(server_bin, flag):
    """A flag's default as `layerserve --help` prints it."""
    m = re.search(re.escape(flag) + r" INT=(\d+)", run(server_bin, "--help"))
    assert m, f"--help shows no default for {flag}"
    return int(m.group(1))


def drain_seconds(server_bin, args):
    """How long a server with `args` may take from SIGTERM to exit: the
    sessions' time, the drain's, and 3 s for its last refusals and exit."""
    sessions = flag_value(args, "--drain-sessions-timeout-s",
                          server_default(server_bin, "--drain-sessions-timeout-s"))
    drain = flag_value(args, "--drain-timeout-s", server_default(server_bin, "--drain-timeout-s"))
    return sessions + drain + 3


def test_k8s_grace_period_outlasts_the_drain(server_bin):
    """SIGKILL must not cut the drain (sessions included) short."""
    spec = k8s_deployment()["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert spec["terminationGracePeriodSeconds"] > drain_seconds(server_bin, container["args"])


def test_compose_stop_grace_period_outlasts_the_drain(server_bin):
    for name, service in compose_services(*PROFILES).items():
        if name.startswith("layerserve"):
            grace = service["stop_grace_period"]
            seconds = int(re.fullmatch(r"(\d+)s", str(grace)).group(1))
            assert seconds > drain_seconds(server_bin, service["command"]), (name, grace)


def test_k8s_ingress_hashes_sessions_onto_the_deployments_pods():
    """The ingress-nginx form of session routing: a consistent hash of the
    x-session-id header, gRPC to the pods, through a Service whose selector
    and port reach the Deployment's gRPC port; on both Ingresses, the one for
    unary calls and the one for ModelStreamInfer (test_ingress_limits.py
    checks their limits)."""
    ingresses = [o for o in k8s_objects() if o["kind"] == "Ingress"]
    assert len(ingresses) == 2, [i["metadata"]["name"] for i in ingresses]
    pod_labels = k8s_deployment()["spec"]["template"]["metadata"]["labels"]
    (container,) = k8s_deployment()["spec"]["template"]["spec"]["containers"]
    for ingress in ingresses:
        annotations = ingress["metadata"]["annotations"]
        assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
        assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
        assert ingress["spec"]["tls"], "ingress-nginx serves HTTP/2 (gRPC) only over TLS"
        (rule,) = ingress["spec"]["rules"]
        (path,) = rule["http"]["paths"]
        backend = path["backend"]["service"]
        (service,) = [o for o in k8s_objects()
                      if o["kind"] == "Service" and o["metadata"]["name"] == backend["name"]]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == backend["port"]["name"]]
        assert port["targetPort"] in {p["name"] for p in container["ports"]}


def test_nginx_config_hashes_sessions_and_passes_grpc(tmp_path):
    """deploy/nginx/nginx.conf as nginx itself reads it (nginx -t, with a
    throwaway certificate in place of the operator's), and the directives
    session routing and the proxy's limits rest on.
    tests/deploy/test_session_routing.py runs it in front of three replicas,
    tests/deploy/test_proxy_limits.py attacks through it."""
    conf = DEPLOY / "nginx/nginx.conf"
    text = conf.read_text()
    for directive in [r"hash \$http_x_session_id consistent;", r"listen 8001;",
                      r"listen 8443 ssl;", r"ssl_alpn h2;", r"grpc_pass grpc://layerserve;",
                      r"limit_conn connections_per_address \d+;",
                      r"limit_conn calls_per_address \d+;", r"http2_max_concurrent_streams \d+;",
                      r"keepalive_requests \d+;", r"client_max_body_size \d+m;",
                      r"listen unix:\S+ http2 proxy_protocol;"]:
        assert re.search(rf"^\s*{directive}", text, re.M), f"nginx.conf lost `{directive}`"
    cert, key = make_certificate(tmp_path)
    rendered = tmp_path / "nginx.conf"
    rendered.write_text(render_nginx_conf(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], 8001,
                                          8443, 8444, tmp_path / "http.sock", cert, key))
    run(tool("nginx"), "-t", "-q", "-c", rendered, "-g", f"pid {tmp_path}/nginx.pid;")


def test_haproxy_config_is_valid_and_rate_limits_before_tls(tmp_path):
    """deploy/haproxy/haproxy.cfg as haproxy reads it (haproxy -c), and the
    rules the handshake rate limit rests on. tests/deploy/test_proxy_limits.py
    floods through it."""
    text = (DEPLOY / "haproxy/haproxy.cfg").read_text()
    for rule in [r"mode tcp", r"tcp-request connection track-sc0 src",
                 r"tcp-request connection reject if \{ sc0_conn_rate gt \d+ \}",
                 r"server nginx 127\.0\.0\.1:8444 send-proxy-v2"]:
        assert re.search(rf"^\s*{rule}", text, re.M), f"haproxy.cfg lost `{rule}`"
    assert "listen 127.0.0.1:8444 ssl proxy_protocol;" in (DEPLOY / "nginx/nginx.conf").read_text()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(render_haproxy_cfg(9443, 8444))
    run(tool("haproxy"), "-c", "-q", "-f", cfg)


def test_deploy_files_pass_only_flags_the_server_has(server_bin):
    """A flag the server does not know stops it at start (exit 1): every
    --flag in the Deployment's args and the compose commands must be one
    `layerserve --help` lists."""
    known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", run(server_bin, "--help")))
    (container,) = k8s_deployment()["spec"]["template"]["spec"]["containers"]
    used = {("k8s", a.split("=")[0]) for a in container["args"]}
    for name, service in compose_services(*PROFILES).items():
        if name.startswith("layerserve"):
            used |= {(name, a.split("=")[0]) for a in service["command"]}
    unknown = sorted(u for u in used if u[1] not in known)
    assert not unknown, "flags the server does not accept"


def test_readme_bf16_tritonclient_example_runs(full_server):
    """The README's BF16 example (tritonclient + ml_dtypes) against a live server."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"BF16 through `tritonclient`.*?```python\n(.*?)```", readme, re.S)
    assert block, "README lost its BF16 tritonclient example"
    code = "\n".join(line.removeprefix("  ") for line in block.group(1).splitlines())
    code = code.replace("localhost:8001", full_server.grpc_url)
    out = run(sys.executable, "-c", code)
    shape, std = re.match(r"\((\d+), (\d+), (\d+)\) (\S+)", out).groups()[:3], float(out.split()[-1])
    assert shape == ("1", "8", "512") and 0.1 < std < 100, out
