"""deploy/k8s stays valid and true to the code (no cluster runs here, so check what we can).

Every built-in object is validated offline, strictly (unknown fields refused, as `kubectl apply`
does), by kubernetes-validate against the schemas it bundles, for the oldest Kubernetes these
manifests support and the newest it knows. KEDA's ScaledObject is a custom resource, in none of
those schemas: SCALED_OBJECT below is a schema written for the fields we use, from KEDA's
documentation, with its HPA behavior checked against Kubernetes' own definition.
"""
from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path, PurePosixPath

import fakeredis
import jsonschema
import pytest
import referencing
import yaml
from fastapi.testclient import TestClient
from kubernetes_validate import utils as k8s

from api.app import create_app
from api.core.metrics import ApiMetrics
from shared.model_source import served_name
from shared.settings import ApiSettings, CommonSettings, SchedulerSettings, WorkerSettings
from streamq.cli import main as cli_main
from worker.engine.threaded import Threaded
from worker.service.metrics import WorkerMetrics
from worker.backends.null_engine import NullEngine
from worker.service.service import WorkerService

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OLDEST = "1.29"  # autoscaling/v2, and every field used here, are older
VERSIONS = (OLDEST, k8s.latest_version())
SETTINGS = {"api": ApiSettings, "worker": WorkerSettings, "scheduler": SchedulerSettings,
            "prepare-model": CommonSettings}
IMAGE = "streamq:latest"


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifests() -> dict[Path, list[dict]]:
    return {path: _documents(path) for path in sorted(K8S.rglob("*.yaml")) if path.name != "kustomization.yaml"}


MANIFESTS = _manifests()
OBJECTS = [doc for docs in MANIFESTS.values() for doc in docs]


def _one(kind: str, name: str) -> dict:
    [found] = [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _pod(name: str) -> dict:
    return _one("Deployment", name)["spec"]["template"]["spec"]


def _container(pod: dict, name: str) -> dict:
    [found] = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    return found


def _streamq_containers() -> list[tuple[str, dict]]:
    """(workload, container) for every container that runs the streamq image."""
    found = []
    for o in OBJECTS:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            pod = o["spec"]["template"]["spec"]
            found += [(o["metadata"]["name"], c) for c in pod["containers"] + pod.get("initContainers", [])
                      if c["image"].split(":")[0] == IMAGE.split(":")[0]]
    return found


def _env(container: dict) -> dict[str, str | None]:
    """The container's variables: literal values, None for those from a Secret; the ConfigMap's included."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        env.update(_one("ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value")
    return env


def _settings(container: dict):
    """The container's settings class, built from its literal STREAMQ_* values (so they must be in bounds)."""
    cls = SETTINGS[container["command"][1]]
    values = {k.removeprefix("STREAMQ_").lower(): v for k, v in _env(container).items()
              if k.startswith("STREAMQ_") and v is not None}
    return cls(**values)


def _port(container: dict, port: int | str) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def _probes(container: dict) -> list[dict]:
    return [container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container]


# -- kustomize ---------------------------------------------------------------------------------------------------

def test_the_kustomizations_list_every_manifest_and_only_existing_ones():
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    assert sorted(base["resources"]) == sorted(p.name for p in MANIFESTS if p.parent == K8S / "base")
    assert base["namespace"] == _one("Namespace", base["namespace"])["metadata"]["name"]
    keda = yaml.safe_load((K8S / "keda" / "kustomization.yaml").read_text())
    # The base as a sibling: kustomize refuses an overlay inside its base ("cycle detected").
    assert keda["resources"][0] == "../base" and all((K8S / "keda" / r).exists() for r in keda["resources"])
    assert sorted(keda["resources"][1:]) == sorted(p.name for p in MANIFESTS if p.parent == K8S / "keda")
    assert keda["namespace"] == base["namespace"]  # else the ScaledObject lands beside no worker
    assert not any(o["metadata"].get("namespace") for o in OBJECTS)  # the kustomization's namespace applies
    monitoring = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    # Applied beside base or keda, not on top of one: both can have it.
    assert "../base" not in monitoring["resources"] and monitoring["namespace"] == base["namespace"]
    own = [r for r in monitoring["resources"] if not r.startswith("../")]
    assert sorted(own) == sorted(p.name for p in MANIFESTS if p.parent == K8S / "monitoring")
    assert sorted(r for r in monitoring["resources"] if r.startswith("../")) == ["../../grafana", "../../prometheus"]
    assert sorted(p.name for p in K8S.iterdir()) == ["README.md", "base", "keda", "monitoring"]


def test_the_image_is_the_one_docker_compose_builds():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["x-streamq"]["image"] == IMAGE
    [image] = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]
    assert f"{image['newName']}:{image['newTag']}" == IMAGE and image["name"] == IMAGE.split(":")[0]
    containers = _streamq_containers()
    assert {w for w, _ in containers} == {"streamq-api", "streamq-worker", "streamq-scheduler"}
    assert all(c["image"] == IMAGE for _, c in containers)


# -- schemas -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", list(MANIFESTS), ids=lambda p: str(p.relative_to(K8S)))
def test_every_object_validates_against_the_kubernetes_schema(path, version):
    for doc in MANIFESTS[path]:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: test_the_scaled_object_validates
        try:
            k8s.validate(doc, version, strict=True)
        except k8s.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message}")


def test_the_validator_refuses_a_wrong_field():
    """The schemas are found and strict: a misspelt field and a wrong type both fail."""
    api = _one("Deployment", "streamq-api")
    misspelt = yaml.safe_load(yaml.safe_dump(api))
    misspelt["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    wrong_type = yaml.safe_load(yaml.safe_dump(api))
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    for doc in (misspelt, wrong_type):
        with pytest.raises(k8s.ValidationError):
            k8s.validate(doc, OLDEST, strict=True)


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_HPA_BEHAVIOR = ("https://kubernetes.io/api/_definitions.json"
                 "#/$defs/io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior")
# KEDA's ScaledObject (keda.sh/v1alpha1), the fields this project may use; unknown ones are refused.
SCALED_OBJECT = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": {"type": "string"}, "labels": _STRING_MAP, "annotations": _STRING_MAP}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
                 "properties": {
            "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
                "envSourceContainerName": {"type": "string"}}},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "initialCooldownPeriod": {"type": "integer", "minimum": 0},
            "idleReplicaCount": {"type": "integer", "minimum": 0},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": {"type": "object", "additionalProperties": False,
                         "required": ["failureThreshold", "replicas"], "properties": {
                "failureThreshold": {"type": "integer", "minimum": 1}, "replicas": {"type": "integer"}}},
            "advanced": {"type": "object", "additionalProperties": False, "properties": {
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                    "name": {"type": "string"}, "behavior": {"$ref": _HPA_BEHAVIOR}}}}},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["type", "metadata"], "properties": {
                    "type": {"type": "string"}, "name": {"type": "string"},
                    "metadata": _STRING_MAP,  # KEDA takes strings only: threshold: "96", not 96
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "useCachedMetrics": {"type": "boolean"},
                    "authenticationRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                                          "properties": {"name": {"type": "string"},
                                                         "kind": {"enum": ["TriggerAuthentication",
                                                                           "ClusterTriggerAuthentication"]}}}}}}}}}}
# The prometheus scaler's metadata keys (KEDA's documentation), and those it needs.
PROMETHEUS_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
                   "customHeaders", "ignoreNullValues", "unsafeSsl", "timeout", "authModes"}
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}


def _scaled_object_validator() -> jsonschema.Validator:
    folder = files("kubernetes_validate") / "kubernetes-json-schema" / f"v{OLDEST}.0-local-strict"
    definitions = referencing.Resource.from_contents(json.loads((folder / "_definitions.json").read_text()))
    return jsonschema.Draft202012Validator(SCALED_OBJECT, registry=definitions @ referencing.Registry())


def _scaled_object() -> dict:
    [scaled] = [o for o in OBJECTS if o["kind"] == "ScaledObject"]
    return scaled


def test_the_scaled_object_validates():
    validator = _scaled_object_validator()
    scaled = _scaled_object()
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(scaled)]
    assert not errors
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert PROMETHEUS_REQUIRED <= trigger["metadata"].keys() <= PROMETHEUS_KEYS
        float(trigger["metadata"]["threshold"]), float(trigger["metadata"]["activationThreshold"])
    spec = scaled["spec"]
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]


def test_the_scaled_object_schema_refuses_what_keda_would():
    validator = _scaled_object_validator()
    for change in ({"minReplicas": 1},  # the HPA's name for it, not KEDA's
                   {"triggers": [{"type": "prometheus", "metadata": {"threshold": 96}}]},
                   {"advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {"window": 3}}}}}):
        scaled = yaml.safe_load(yaml.safe_dump(_scaled_object()))
        scaled["spec"].update(change)
        assert list(validator.iter_errors(scaled)), change


# -- true to the code --------------------------------------------------------------------------------------------

def test_every_container_runs_a_streamq_command():
    for workload, container in _streamq_containers():
        command = container["command"]
        assert command[0] == "streamq" and command[1] in SETTINGS, (workload, command)
        with pytest.raises(SystemExit) as info:
            cli_main([*command[1:], "--help"])
        assert info.value.code == 0, (workload, command)


def test_every_environment_variable_is_a_setting_with_a_valid_value():
    for workload, container in _streamq_containers():
        cls = SETTINGS[container["command"][1]]
        for var in _env(container):
            if var == "REDIS_URL":
                continue
            assert var.startswith("STREAMQ_"), (workload, var)
            assert var.removeprefix("STREAMQ_").lower() in cls.model_fields, f"{workload}: {var}"
        _settings(container)  # the values are in the settings' bounds


def test_redis_url_comes_from_the_secret_and_names_the_trial_redis_service():
    secret = _one("Secret", "streamq-redis")["stringData"]["REDIS_URL"]
    for workload, container in _streamq_containers():
        if container["command"][1] == "prepare-model":
            continue  # it needs no Redis
        [var] = [v for v in container["env"] if v["name"] == "REDIS_URL"]
        assert var["valueFrom"]["secretKeyRef"] == {"name": "streamq-redis", "key": "REDIS_URL"}, workload
    host, port = re.fullmatch(r"redis://:[^@]+@([^:/]+):(\d+)/\d+", secret).groups()
    service = _one("Service", host)
    [service_port] = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    [redis] = _one("StatefulSet", host)["spec"]["template"]["spec"]["containers"]
    assert _port(redis, service_port["targetPort"]) == int(port)
    assert CommonSettings(redis_url=secret).redis_url == secret


def test_services_reach_their_pods_on_a_container_port():
    for service in (o for o in OBJECTS if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        [workload] = [o for o in OBJECTS if o["kind"] in ("Deployment", "StatefulSet")
                      and o["spec"]["selector"]["matchLabels"] == selector]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        [container] = workload["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            _port(container, port["targetPort"])  # names a port the container has


def test_the_api_listens_where_its_port_probes_and_service_say():
    api = _container(_pod("streamq-api"), "api")
    settings = _settings(api)
    assert settings.host == "0.0.0.0" and settings.port == ApiSettings.model_fields["port"].default
    assert [p["containerPort"] for p in api["ports"]] == [settings.port]
    assert all(_port(api, probe["httpGet"]["port"]) == settings.port for probe in _probes(api))
    [service_port] = _one("Service", "streamq-api")["spec"]["ports"]
    assert _port(api, service_port["targetPort"]) == settings.port


def test_the_api_probes_are_api_routes_that_need_no_key():
    api = _container(_pod("streamq-api"), "api")
    app = create_app(_settings(api))
    paths = {probe["httpGet"]["path"] for probe in _probes(api)}
    assert paths and paths <= app.openapi()["paths"].keys()
    # With keys required (the api binds 0.0.0.0), only the health checks answer without one (docs/security.md).
    assert paths <= {"/healthz", "/readyz"}
    if "/healthz" in paths:  # answers with no key, and without Redis (no lifespan here), to a pod address's Host
        assert TestClient(app, base_url="http://10.1.2.3:8000").get("/healthz").status_code == 200


def test_the_worker_probes_are_its_health_checks_on_its_metrics_port():
    worker = _container(_pod("streamq-worker"), "worker")
    settings = _settings(worker)
    assert settings.metrics_host == "0.0.0.0"
    assert [p["containerPort"] for p in worker["ports"]] == [settings.metrics_port]
    probes = _probes(worker)
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= worker.keys()
    assert all(_port(worker, probe["httpGet"]["port"]) == settings.metrics_port for probe in probes)
    service = WorkerService(fakeredis.FakeAsyncRedis(), Threaded(NullEngine(1, 1.0), "null"), settings, "m")
    assert {probe["httpGet"]["path"] for probe in probes} <= service.probes().keys()
    assert worker["livenessProbe"]["httpGet"]["path"] == "/livez"
    # Generous for a model load: minutes, not the seconds of the other probes.
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    annotations = _one("Deployment", "streamq-worker")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.metrics_port)


def test_the_worker_has_a_gpu_and_the_model_cache():
    pod = _pod("streamq-worker")
    worker = _container(pod, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    _mounts_the_model_cache(pod, worker)
    strategy = _one("Deployment", "streamq-worker")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxSurge"] == 0  # an update needs no spare GPU


def _mounts_the_model_cache(pod: dict, container: dict) -> None:
    cache_dir = str(_settings(container).model_cache_dir)
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == cache_dir]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # worker, api and scheduler pods on several nodes


def test_the_model_is_prepared_before_the_api_and_the_worker_start():
    for name in ("streamq-api", "streamq-worker"):
        pod = _pod(name)
        prepare = _container(pod, "prepare-model")
        assert prepare in pod["initContainers"] and prepare["command"] == ["streamq", "prepare-model"]
        _mounts_the_model_cache(pod, prepare)
        main = pod["containers"][0]
        _mounts_the_model_cache(pod, main)
        assert _settings(prepare).model == _settings(main).model  # the same ConfigMap
    scheduler = _pod("streamq-scheduler")
    _mounts_the_model_cache(scheduler, scheduler["containers"][0])  # for the served name of a folder model


def test_the_scheduler_runs_once():
    assert _one("Deployment", "streamq-scheduler")["spec"]["replicas"] == 1


def test_the_api_scales_on_cpu_from_two_replicas_and_autoscaled_counts_are_not_in_the_deployments():
    hpa = _one("HorizontalPodAutoscaler", "streamq-api")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "streamq-api"}
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert "cpu" in _container(_pod("streamq-api"), "api")["resources"]["requests"]  # what Utilization is of
    for name in ("streamq-api", "streamq-worker"):  # the HPA's and KEDA's: `kubectl apply` must not reset them
        assert "replicas" not in _one("Deployment", name)["spec"], name


def test_the_redis_for_trying_it_keeps_an_append_only_file_on_a_volume():
    redis = _one("StatefulSet", "redis")
    [container] = redis["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert command[:5] == compose["services"]["redis"]["command"][:5]
    [mount] = container["volumeMounts"]
    assert mount["mountPath"] == "/data"
    assert mount["name"] in {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}


def test_the_autoscaler_scales_the_workers_on_metrics_the_code_exports():
    scaled = _scaled_object()
    assert scaled["spec"]["scaleTargetRef"]["name"] == "streamq-worker"
    _one("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    exported = {m.name for registry in (WorkerMetrics().registry, ApiMetrics().registry)
                for m in registry.collect()}
    [trigger] = scaled["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    used = set(re.findall(r"streamq:[a-z_]+", query))
    assert used == {"streamq:num_requests_queued", "streamq:num_requests_running", "streamq:num_requests_waiting"}
    assert used <= exported
    # The queued count is the model's, by the name the api serves it under.
    config = _one("ConfigMap", "streamq-config")["data"]
    model = served_name(CommonSettings(model=config["STREAMQ_MODEL"]))
    assert re.findall(r'streamq:num_requests_queued\{model="([^"]+)"\}', query) == [model]
    # Each replica reports the same backlog (it is read from Redis): added once, not once per replica.
    assert "max(streamq:num_requests_queued" in query
    # A worker is asked to carry no more than a batch.
    batch_size = _settings(_container(_pod("streamq-worker"), "worker")).batch_size
    assert 0 < float(trigger["metadata"]["threshold"]) <= batch_size


# -- monitoring: Prometheus and Grafana ---------------------------------------------------------------------------

def _generated_config_maps() -> dict[str, dict]:
    """The ConfigMaps that the monitoring overlay's generators make from deploy/prometheus and deploy/grafana, by
    name, built as kustomize would (it does not run here)."""
    overlay = K8S / "monitoring"
    made = {}
    for resource in yaml.safe_load((overlay / "kustomization.yaml").read_text())["resources"]:
        folder = (overlay / resource).resolve()
        if not folder.is_dir():
            continue
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert kustomization["generatorOptions"]["disableNameSuffixHash"]  # the Deployments name them as written
        for generator in kustomization["configMapGenerator"]:
            data = {}
            for entry in generator["files"]:
                key, _, path = entry.rpartition("=")
                file = (folder / path).resolve()
                assert file.is_relative_to(folder), entry  # kustomize reads no file outside the kustomization's folder
                data[key or file.name] = file.read_text()
            metadata = {"name": generator["name"], "labels": generator.get("options", {}).get("labels", {})}
            made[generator["name"]] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}
    return made


GENERATED = _generated_config_maps()


@pytest.mark.parametrize("version", VERSIONS)
def test_the_generated_config_maps_validate(version):
    assert set(GENERATED) == {"prometheus-config", "grafana-datasources", "grafana-dashboard-providers",
                              "grafana-dashboards"}
    for config_map in GENERATED.values():
        k8s.validate(config_map, version, strict=True)
        assert sum(len(v.encode()) for v in config_map["data"].values()) < 2**20  # a ConfigMap's limit


def _volume_mounts(name: str) -> dict[str, dict]:
    """The one container of Deployment `name`: mount path -> the volume mounted there."""
    pod = _pod(name)
    [container] = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def _config_map_at(mounts: dict[str, dict], path: str) -> dict:
    return GENERATED[mounts[path]["configMap"]["name"]]["data"]


def _prometheus_config() -> dict:
    return yaml.safe_load(GENERATED["prometheus-config"]["data"]["prometheus.yml"])


def test_prometheus_mounts_its_config_rules_and_key():
    [container] = _pod("prometheus")["containers"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    mounts = _volume_mounts("prometheus")
    config_file = PurePosixPath(flags["config.file"])
    files = _config_map_at(mounts, str(config_file.parent))
    config = _prometheus_config()
    assert files[config_file.name] == (ROOT / "deploy" / "prometheus" / "kubernetes.yml").read_text()
    assert all(rules in files for rules in config["rule_files"])  # beside the config, as rule_files reads them
    [key_file] = [PurePosixPath(j["authorization"]["credentials_file"]) for j in config["scrape_configs"]
                  if "authorization" in j]
    secret = mounts[str(key_file.parent)]["secret"]
    assert secret["secretName"] == "streamq-prometheus-key" and secret["optional"]  # it starts before the key exists
    assert "emptyDir" in mounts[flags["storage.tsdb.path"]]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        [container] = _pod(name)["containers"]
        assert container["image"] == compose[name]["image"], name


def test_prometheus_may_list_the_pods_of_its_namespace():
    account = _pod("prometheus")["serviceAccountName"]
    _one("ServiceAccount", account)
    binding = _one("RoleBinding", account)
    namespace = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    role = _one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
    assert {"pods"} <= {r for rule in role["rules"] for r in rule["resources"]}
    assert {"list", "watch"} <= {v for rule in role["rules"] for v in rule["verbs"]}


def test_prometheus_finds_the_api_and_worker_pods_on_their_metrics_ports():
    ports = {"api": _settings(_container(_pod("streamq-api"), "api")).port,
             "worker": _settings(_container(_pod("streamq-worker"), "worker")).metrics_port}
    jobs = {job["job_name"]: job for job in _prometheus_config()["scrape_configs"]}
    assert set(jobs) == {f"streamq-{component}" for component in ports}
    for component, port in ports.items():
        job = jobs[f"streamq-{component}"]
        [discovery] = job["kubernetes_sd_configs"]
        assert discovery["role"] == "pod" and discovery["namespaces"] == {"own_namespace": True}
        [selector] = discovery["selectors"]
        labels = dict(pair.split("=") for pair in selector["label"].split(","))
        deployment = f"streamq-{component}"
        assert labels.items() <= _one("Deployment", deployment)["spec"]["template"]["metadata"]["labels"].items()
        [keep] = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        assert keep["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]
        assert _port(_container(_pod(deployment), component), keep["regex"]) == port


def test_grafana_is_provisioned_from_the_config_maps():
    mounts = _volume_mounts("grafana")
    [source] = yaml.safe_load(_config_map_at(mounts, "/etc/grafana/provisioning/datasources")["prometheus.yml"])[
        "datasources"]
    [service_port] = _one("Service", "prometheus")["spec"]["ports"]
    assert source["url"] == f"http://prometheus:{service_port['port']}"  # the Service, in Grafana's namespace
    [provider] = yaml.safe_load(_config_map_at(mounts, "/etc/grafana/provisioning/dashboards")["streamq.yml"])[
        "providers"]
    dashboards = _config_map_at(mounts, provider["options"]["path"])
    assert json.loads(dashboards["streamq.json"])["uid"]
    # kube-prometheus-stack's Grafana loads the same dashboard from a labelled ConfigMap.
    assert GENERATED["grafana-dashboards"]["metadata"]["labels"] == {"grafana_dashboard": "1"}


def test_the_trial_redis_takes_the_secrets_password_and_refuses_evictions():
    secret = _one("Secret", "streamq-redis")["stringData"]
    password = re.fullmatch(r"redis://:([^@]+)@.*", secret["REDIS_URL"]).group(1)
    assert password == secret["REDIS_PASSWORD"]
    [container] = _one("StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    [var] = [v for v in container["env"] if v["name"] == "REDIS_PASSWORD"]
    assert var["valueFrom"]["secretKeyRef"] == {"name": "streamq-redis", "key": "REDIS_PASSWORD"}
    assert command[command.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"  # expanded by the kubelet
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(command[command.index("--maxmemory") + 1].removesuffix("mb")) < int(
        limit.removesuffix("Gi")) * 1024
    assert "REDISCLI_AUTH" in container["readinessProbe"]["exec"]["command"][-1]


def test_only_the_streamq_pods_reach_redis():
    policy = _one("NetworkPolicy", "redis")["spec"]
    redis = _one("StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= redis.items()
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    [peer] = rule["from"]
    [expression] = peer["podSelector"]["matchExpressions"]
    allowed = set(expression["values"])
    labels = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in OBJECTS
              if o["kind"] in ("Deployment", "StatefulSet")}
    clients = {labels[workload]["app.kubernetes.io/component"] for workload, container in _streamq_containers()
               if any(v["name"] == "REDIS_URL" for v in container.get("env", []))}
    assert allowed == clients == {"api", "worker", "scheduler"}
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "streamq"}
    [port] = rule["ports"]
    assert port["port"] == 6379
