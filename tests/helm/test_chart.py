"""The Helm chart (helm/dsa-pd): rendered by Helm's engine, every object validated, the embedded serve config checked.

Cases: the default values (the CPU demo), the chart's CI values files
(helm/dsa-pd/ci/: DeepSeek-V3.2 and GLM-5 at real scale, the one-GPU config
with decode autoscaled by the chart and auth on) and a monolithic config. For
each: every object validates (tests/helm/chart.py says against what), the
serveConfigV2 is the source config plus only the documented additions and
passes `dsa-pd check`, the worker groups hold what the app's own placement
plan asks for, and only the OpenAI port can leave the cluster. Bad values
fail the render with a message naming the value.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import shutil
import subprocess
import sys

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    REPO,
    Rendered,
    ci_values,
    render,
    validate_object,
)

CASES = {
    "default": None,
    **{name: ci_values(name) for name in CI_VALUES},
    "monolithic": {"serveConfig": {"preset": "tiny_mono_gpu"}},
}
DEPLOYMENT = {"prefill": "PrefillServer", "decode": "DecodeServer"}


@functools.cache
def rendered(case: str) -> Rendered:
    return render(copy.deepcopy(CASES[case]))


def values_of(case: str) -> dict:
    """The values of a case coalesced with the chart's defaults, as Helm does."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.merge_values(copy.deepcopy(CASES[case]))


def source_config(values: dict) -> dict:
    """The serve config a case starts from: the inline one, or configs/<preset>.yaml."""
    if values["serveConfig"].get("inline"):
        return copy.deepcopy(values["serveConfig"]["inline"])
    return yaml.safe_load((REPO / "configs" / f"{values['serveConfig']['preset']}.yaml").read_text())


def ray_containers(r: Rendered) -> dict[str, dict]:
    return {group: t["spec"]["containers"][0] for group, t in r.pod_templates().items()}


def test_ci_values_files_are_the_expected_ones():
    # The must-show cases: the real-scale DeepSeek-V3.2 and GLM-5 configs, autoscaling decode, auth on.
    assert set(CI_VALUES) == {"dsv32", "glm5", "autoscaling-auth"}
    assert ci_values("dsv32")["serveConfig"]["preset"] == "dsv32_pd"
    assert ci_values("glm5")["serveConfig"]["preset"] == "glm5_pd"
    assert ci_values("autoscaling-auth")["auth"]["enabled"] is True
    assert ci_values("dsv32")["auth"] == {"enabled": True, "secretName": "dsa-pd-api-key", "source": "file"}
    assert ci_values("autoscaling-auth")["decode"]["autoscaling"]


def test_chart_presets_are_the_repository_configs():
    # .Files.Get reads inside the chart only, so the chart carries copies of configs/;
    # a config edited in one place and not the other fails here.
    # To refresh them: cp configs/*.yaml helm/dsa-pd/files/configs/
    repo = {p.name: p.read_bytes() for p in (REPO / "configs").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "files" / "configs").glob("*.yaml")}
    assert sorted(chart) == sorted(repo)
    for name, text in repo.items():
        assert chart[name] == text, f"helm/dsa-pd/files/configs/{name} differs from configs/{name}"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert sorted(schema["properties"]["serveConfig"]["properties"]["preset"]["enum"]) == \
        sorted(p.removesuffix(".yaml") for p in repo)


@pytest.mark.parametrize("case", list(CASES))
def test_every_rendered_object_validates(case):
    r = rendered(case)
    kinds = sorted(o["kind"] for o in r.objects if o["kind"] != "ConfigMap")
    values = values_of(case)
    monitor = ["PodMonitor"] if values["metrics"]["podMonitor"]["enabled"] else []
    if values["metrics"]["serviceMonitor"]["enabled"]:
        monitor += ["Service", "ServiceMonitor"]
    assert kinds == sorted(["RayService", *monitor])
    for obj in r.objects:
        validate_object(obj)


def test_the_validators_reject_a_misspelt_field():
    # The validation above can fail: one wrong field name in each kind of schema is an error.
    r = rendered("glm5")
    bad = copy.deepcopy(r.rayservice)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        validate_object(bad)
    bad = copy.deepcopy(r.rayservice)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        validate_object(bad)
    bad = copy.deepcopy(r.one("ServiceMonitor"))
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        validate_object(bad)
    bad = copy.deepcopy(rendered("default").one("PodMonitor"))
    bad["spec"]["podMetricsEndpoints"][0]["port"] = 8080  # a port *name* (string)
    with pytest.raises(jsonschema.ValidationError):
        validate_object(bad)
    bad = copy.deepcopy(r.one("Service"))
    bad["spec"]["ports"][0]["prot"] = 80
    with pytest.raises(kubernetes_validate.ValidationError, match="prot"):
        validate_object(bad)
    bad = copy.deepcopy(r.rayservice)  # a bad quantity in a pod template: the core schema's pattern
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "8 GB"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_object(bad)


@pytest.mark.parametrize("case", list(CASES))
def test_serve_config_is_the_source_plus_the_documented_additions(case):
    """serveConfigV2 is the YAML `serve run` takes: the source config, plus only what values.yaml
    documents (role pins; api_key_env or api_key_file with auth; autoscaling bounds from the values)."""
    r, values = rendered(case), values_of(case)
    got = r.serve_config
    source = source_config(values)
    app, src_app = got["applications"][0], source["applications"][0]
    roles = ["decode"] if src_app["args"].get("mode") == "monolithic" else ["prefill", "decode"]
    assert [d["name"] for d in app.pop("deployments")] == [DEPLOYMENT[role] for role in roles]
    args = app["args"]
    if values["auth"]["enabled"] and values["auth"]["source"] == "file":
        assert args.pop("api_key_file") == values["auth"]["mountPath"] + "/api-key"
    elif values["auth"]["enabled"]:
        assert args.pop("api_key_env") == "DSA_PD_API_KEY"
    for role in roles:
        auto = values[role]["autoscaling"]
        if auto:
            want = {"min_replicas": auto.get("minReplicas", 1), "max_replicas": auto["maxReplicas"]}
            if "targetOngoingRequests" in auto:
                want["target_ongoing_requests"] = auto["targetOngoingRequests"]
            assert args[role].pop("autoscaling") == want and "num_replicas" not in args[role]
            for key in ("autoscaling", "num_replicas"):
                if key in src_app["args"][role]:
                    args[role][key] = src_app["args"][role][key]
    # Equal as parsed by PyYAML (what `serve run` uses): a float Helm printed as "1e-06"
    # would be the string "1e-06" here and differ from the source's 1.0e-6.
    assert got == source


def test_an_inline_config_renders_as_its_preset():
    inline = yaml.safe_load((REPO / "configs" / "dsv32_pd.yaml").read_text())
    by_preset = render({"serveConfig": {"preset": "dsv32_pd"}})
    by_inline = render({"serveConfig": {"inline": inline}})
    assert by_inline.serve_config == by_preset.serve_config
    assert by_inline.rayservice["spec"]["rayClusterConfig"] == by_preset.rayservice["spec"]["rayClusterConfig"]


def dsa_pd_check(text: str, tmp_path) -> tuple[int, str]:
    """`dsa-pd check` on a serve config file (the command's own entry point, in this process)."""
    from deployments.cli import main

    path = tmp_path / "serveConfigV2.yaml"
    path.write_text(text)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", str(path)])
    return code, out.getvalue()


@pytest.mark.parametrize("case", list(CASES))
def test_embedded_serve_config_passes_dsa_pd_check(case, tmp_path):
    code, report = dsa_pd_check(rendered(case).serve_config_text, tmp_path)
    assert code == 0, report
    assert ": OK" in report


def test_dsa_pd_check_of_the_embedded_config_can_fail(tmp_path):
    # A config the chart renders (it does not plan memory) but the controller refuses: a
    # decode pool too large for an H200. The check above would report it.
    inline = yaml.safe_load((REPO / "configs" / "dsv32_pd.yaml").read_text())
    inline["applications"][0]["args"]["decode"]["num_pages"] = 100_000
    code, report = dsa_pd_check(render({"serveConfig": {"inline": inline}}).serve_config_text, tmp_path)
    assert code == 1 and "decode" in report, report


@pytest.mark.parametrize("case", list(CASES))
def test_worker_groups_hold_what_the_app_places(case):
    """Each role's pins equal the app's own placement plan (deployments/controller/placement.py) plus a
    label selector of its group's Ray label, and the group's pods hold its replicas at both ends
    of the replica range with no pod left idle at the low end."""
    from ray._private.label_utils import validate_label_selector, validate_node_labels

    from deployments.app_config import AppConfig
    from deployments.controller import plan_placement

    r = rendered(case)
    cfg = AppConfig.model_validate(r.app_args)
    plan = plan_placement(cfg)
    pins = {d["name"]: d for d in r.serve_config["applications"][0]["deployments"]}
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    assert [g["groupName"] for g in cluster["workerGroupSpecs"]] == list(cfg.roles)
    autoscaled = False
    for role in cfg.roles:
        place = plan.for_role(role)
        opts = place.deployment_options()
        pin, group = pins[DEPLOYMENT[role]], r.worker_group(role)
        assert group["labels"] == {"dsa-pd/pool": role}
        validate_node_labels(group["labels"])  # what `ray start --labels` accepts
        if "placement_group_bundles" in opts:
            assert pin["placement_group_bundles"] == opts["placement_group_bundles"]
            assert pin["placement_group_strategy"] == opts["placement_group_strategy"]
            assert pin["placement_group_bundle_label_selector"] == [group["labels"]]
            assert "ray_actor_options" not in pin  # the replica actor keeps the app's (no resources)
            cpu = sum(b.get("CPU", 0) for b in opts["placement_group_bundles"])
            gpu = sum(b.get("GPU", 0) for b in opts["placement_group_bundles"])
        else:
            assert pin["ray_actor_options"] == {**opts["ray_actor_options"], "label_selector": group["labels"]}
            cpu, gpu = opts["ray_actor_options"]["num_cpus"], opts["ray_actor_options"]["num_gpus"]
        assert validate_label_selector(group["labels"]) is None

        # Ray's view of one pod, and Kubernetes' (the same GPUs, at least as many CPUs).
        ray_cpus, ray_gpus = int(group["rayStartParams"]["num-cpus"]), int(group["rayStartParams"]["num-gpus"])
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert int(res["limits"].get("nvidia.com/gpu", 0)) == ray_gpus
        assert float(res["requests"]["cpu"]) >= ray_cpus
        fits = math.inf
        if gpu:
            fits = math.floor(ray_gpus / gpu + 1e-9)
        if cpu:
            fits = min(fits, math.floor(ray_cpus / cpu + 1e-9))
        lo, hi = place.replica_range
        assert fits >= 1, f"a {role} pod cannot hold one replica"
        assert group["minReplicas"] * fits >= lo and group["maxReplicas"] * fits >= hi
        assert (group["minReplicas"] - 1) * fits < lo, "a pod more than the low end needs"
        assert group["replicas"] == group["minReplicas"]
        if not gpu:
            assert ray_gpus == 0, "GPUs on a pod of a CPU-only role"
        autoscaled |= lo < hi
        if lo == hi:
            assert group["minReplicas"] == group["maxReplicas"]
    assert cluster["enableInTreeAutoscaling"] is autoscaled


def test_autoscaling_decode():
    # Set by the chart's values: Serve's bounds in the config, KubeRay's autoscaler on, decode pods
    # ceil(3 / 2) - ceil(5 / 2) = 2-3 (two half-GPU replicas per one-GPU pod), prefill fixed.
    r = rendered("autoscaling-auth")
    assert r.app_args["decode"]["autoscaling"] == {"min_replicas": 3, "max_replicas": 5, "target_ongoing_requests": 32}
    cluster = r.rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"] == {"version": "v2", "idleTimeoutSeconds": 600, "upscalingMode": "Default"}
    decode, prefill = r.worker_group("decode"), r.worker_group("prefill")
    assert (decode["minReplicas"], decode["maxReplicas"]) == (2, 3)
    assert (prefill["minReplicas"], prefill["maxReplicas"]) == (1, 1)
    # Set by the serve config itself (DeepSeek-V3.2: decode 1-4 replicas of 8 GPUs).
    dsv32 = rendered("dsv32").rayservice["spec"]["rayClusterConfig"]
    assert dsv32["enableInTreeAutoscaling"] is True
    assert [(g["groupName"], g["minReplicas"], g["maxReplicas"]) for g in dsv32["workerGroupSpecs"]] == \
        [("prefill", 1, 1), ("decode", 1, 4)]
    assert rendered("default").rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False


def test_the_pins_name_the_deployments_serve_builds():
    """The pins' names are the app's deployments, and the plan they copy is what Serve builds from
    the app (ray.serve's own build of the DeepSeek-V3.2 application, nothing started)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray.serve._private.build_app import build_app as serve_build

    from deployments.app import build_app

    r = rendered("dsv32")
    built = {d.name: d for d in serve_build(build_app(r.app_args), name="dsv32",
                                            make_deployment_handle=lambda deployment, app_name: None).deployments}
    for pin in r.serve_config["applications"][0]["deployments"]:
        d = built[pin["name"]]
        assert d._replica_config.placement_group_bundles == pin["placement_group_bundles"]
        assert d._replica_config.placement_group_strategy == pin["placement_group_strategy"]


@pytest.mark.parametrize("case", list(CASES))
def test_only_the_openai_port_can_leave_the_cluster(case):
    r, values = rendered(case), values_of(case)
    for svc in r.of_kind("Service"):
        assert svc["spec"]["type"] == "ClusterIP", svc["metadata"]["name"]
    spec = r.rayservice["spec"]
    assert spec["rayClusterConfig"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    serve_svc = spec["serveService"]["spec"]
    assert serve_svc["type"] == values["service"]["type"]
    assert [(p["name"], p["port"]) for p in serve_svc["ports"]] == [("serve", 8000)]
    for group, template in r.pod_templates().items():
        assert not template["spec"].get("hostNetwork"), group
        for c in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            assert all("hostPort" not in p for p in c.get("ports", [])), group
    if case == "default":
        assert serve_svc["type"] == "ClusterIP"


@pytest.mark.parametrize("case", ["default", "glm5"])
def test_monitors_scrape_every_ray_pod(case):
    r, values = rendered(case), values_of(case)
    port = values["metrics"]["port"]
    templates = r.pod_templates()
    for group, c in ray_containers(r).items():
        assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"], group
        params = r.rayservice["spec"]["rayClusterConfig"]
        params = params["headGroupSpec"] if group == "head" else r.worker_group(group)
        assert params["rayStartParams"]["metrics-export-port"] == str(port)

    def selects(selector: dict, labels: dict) -> bool:
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items())

    if case == "default":
        pm = r.one("PodMonitor")["spec"]
        assert all(selects(pm["selector"], t["metadata"]["labels"]) for t in templates.values())
        assert pm["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        assert [e["port"] for e in pm["podMetricsEndpoints"]] == ["metrics"]
    else:
        assert not r.of_kind("PodMonitor")
        sm, svc = r.one("ServiceMonitor"), r.one("Service")
        assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert all(svc["spec"]["selector"].items() <= t["metadata"]["labels"].items() for t in templates.values())
        assert svc["spec"]["clusterIP"] == "None"
        assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [("metrics", port, "metrics")]
        assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]


def dashboard_configmaps(r: Rendered) -> list[dict]:
    return [o for o in r.of_kind("ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"]


def test_one_dashboard_configmap_per_json_file():
    files = sorted((CHART / "dashboards").glob("*.json"))
    maps = dashboard_configmaps(rendered("default"))
    assert len(maps) == len(files)
    assert sorted(name for m in maps for name in m["data"]) == [f.name for f in files]
    for m in maps:
        (name, text), = m["data"].items()
        assert text == (CHART / "dashboards" / name).read_text().rstrip("\n")
        assert len(json.dumps(m).encode()) < 1 << 20, f"{name}: over the API server's 1 MiB per object"
    assert not dashboard_configmaps(render({"dashboards": {"enabled": False}}))


def test_dashboard_configmaps_of_any_files(tmp_path):
    # The template on files of its own (the checked-in dashboards may be few or none): one
    # ConfigMap each, a valid name from any file name, the JSON unchanged, Grafana's labels.
    chart = tmp_path / "dsa-pd"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("dashboards"))
    (chart / "dashboards").mkdir()
    boards = {"dsa_pd_Overview.json": {"title": "Overview", "panels": []},
              "transfer.json": {"title": "Transfer", "panels": [{"type": "timeseries"}]}}
    for name, board in boards.items():
        (chart / "dashboards" / name).write_text(json.dumps(board, indent=2))
    (chart / "dashboards" / "notes.md").write_text("not a dashboard")
    r = render({"dashboards": {"namespace": "monitoring", "labels": {"team": "llm"},
                               "annotations": {"grafana_folder": "dsa-pd"}}}, chart_dir=chart)
    maps = dashboard_configmaps(r)
    assert sorted(m["metadata"]["name"] for m in maps) == ["demo-dsa-pd-dashboard-dsa-pd-overview",
                                                           "demo-dsa-pd-dashboard-transfer"]
    for m in maps:
        (name, text), = m["data"].items()
        assert json.loads(text) == boards[name]
        assert m["metadata"]["namespace"] == "monitoring"
        assert m["metadata"]["labels"]["team"] == "llm"
        assert m["metadata"]["annotations"] == {"grafana_folder": "dsa-pd"}
        validate_object(m)
    assert "2 ConfigMap(s)" in r.notes


def test_model_storage_hf_token_and_pod_settings():
    r, values = rendered("dsv32"), values_of("dsv32")
    for group, template in r.pod_templates().items():
        spec, c = template["spec"], template["spec"]["containers"][0]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "deepseek-v32-weights", "readOnly": True}} \
            in spec["volumes"], group
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"], group
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in c["env"]
        assert c["image"] == "registry.example.com/dsa-pd:0.1.0-cu13"
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        want = values["head" if group == "head" else group]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": want["sharedMemory"]}
        assert spec.get("nodeSelector", {}) == want["nodeSelector"]
        assert spec.get("tolerations", []) == want["tolerations"]
        assert spec.get("affinity", {}) == want["affinity"]
        assert c["resources"]["limits"]["memory"] == want["memory"]
        assert all(e in c["env"] for e in want["env"])
        assert "initContainers" not in spec  # a checkpoint, not a tiny model
    assert r.worker_group("prefill")["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    glm5 = rendered("glm5")
    for template in glm5.pod_templates().values():
        assert {"name": "models", "hostPath": {"path": "/mnt/nvme/models", "type": "Directory"}} \
            in template["spec"]["volumes"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in template["spec"]["containers"][0]["volumeMounts"]
    default = rendered("default")
    for template in default.pod_templates().values():
        assert all(v["name"] != "models" for v in template["spec"]["volumes"])
        assert all(e["name"] != "HF_TOKEN" for e in template["spec"]["containers"][0].get("env", []))


def test_auth_from_a_secret():
    r = rendered("autoscaling-auth")
    assert r.app_args["api_key_env"] == "DSA_PD_API_KEY"
    want = {"name": "DSA_PD_API_KEY", "valueFrom": {"secretKeyRef": {"name": "dsa-pd-api-key", "key": "key"}}}
    for group, c in ray_containers(r).items():  # the ingress may run on any Ray node
        assert want in c["env"], group
    assert "Authorization: Bearer $DSA_PD_API_KEY" in r.notes and "secret dsa-pd-api-key" in r.notes
    off = rendered("default")
    assert "api_key_env" not in off.app_args
    assert all(e["name"] != "DSA_PD_API_KEY" for c in ray_containers(off).values() for e in c.get("env", []))


@pytest.mark.parametrize("frontend, value", [(None, "1"), ("haproxy", "1"), ("serve-proxy", "0")])
def test_the_http_front_end_is_set_in_every_ray_pod(frontend, value):
    """httpFrontend (default haproxy): RAY_SERVE_ENABLE_HA_PROXY in every Ray container, which Ray reads as its
    processes start (the controller picks HAProxy or its Python proxy; ingress replicas open their own ports)."""
    r = render({} if frontend is None else {"httpFrontend": frontend})
    for group, c in ray_containers(r).items():
        assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": value} in c["env"], group


def test_auth_from_a_secret_mounted_as_a_file(tmp_path):
    """auth.source file: every Ray container mounts only the Secret's key, read-only, where the serve
    config's api_key_file points (no key in any environment), and the ingress's own loader reads
    the file as the kubelet writes it (the Secret's bytes, here with a trailing newline)."""
    from deployments.app_config import AppConfig
    from deployments.auth import load_api_key

    r = rendered("dsv32")
    path = r.app_args["api_key_file"]
    assert path == "/etc/dsa-pd/auth/api-key" and "api_key_env" not in r.app_args
    volume = {"name": "api-key", "secret": {"secretName": "dsa-pd-api-key",
                                            "items": [{"key": "api-key", "path": "api-key"}]}}
    for group, template in r.pod_templates().items():  # the ingress may run on any Ray node
        c = template["spec"]["containers"][0]
        assert volume in template["spec"]["volumes"], group
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-key"]
        assert mount == {"name": "api-key", "mountPath": "/etc/dsa-pd/auth", "readOnly": True}, group
        assert all(e["name"] != "DSA_PD_API_KEY" for e in c.get("env", [])), group
        # The file the app reads is the volume's projected item.
        assert path == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    (tmp_path / "api-key").write_text("s3cret-key\n")
    args = {**r.app_args, "api_key_file": str(tmp_path / "api-key")}
    assert load_api_key(AppConfig.model_validate(args)) == "s3cret-key"
    assert "mounted at /etc/dsa-pd/auth/api-key" in r.notes
    # A mount path of one's own; the env source leaves no volume behind.
    values = copy.deepcopy(CASES["dsv32"])
    values["auth"]["mountPath"] = "/run/secrets/dsa-pd"
    moved = render(values)
    assert moved.app_args["api_key_file"] == "/run/secrets/dsa-pd/api-key"
    env = rendered("autoscaling-auth")
    assert all(v["name"] != "api-key" for t in env.pod_templates().values() for v in t["spec"]["volumes"])


def test_notes_say_how_to_reach_the_endpoint_and_dashboards():
    notes = rendered("default").notes
    assert "kubectl -n llm port-forward svc/demo-dsa-pd-serve-svc 8000:8000" in notes
    assert "curl localhost:8000/v1/models" in notes
    assert 'grafana_dashboard="1"' in notes and "port-forward svc/<kube-prometheus-stack release>-grafana" in notes


def test_tiny_model_init_container_makes_the_apps_model_dir(tmp_path, monkeypatch):
    """A tiny-model config: each pod's init container makes the checkpoint, with the image's
    dsa-pd, where the app (the build task, the ingress, the replicas, on any pod) looks for it."""
    from deployments.app_config import AppConfig

    r = rendered("default")
    for group, template in r.pod_templates().items():
        (init,) = template["spec"]["initContainers"]
        c = template["spec"]["containers"][0]
        cache = next(e["value"] for e in c["env"] if e["name"] == "DSA_PD_CACHE")
        assert {"name": "DSA_PD_CACHE", "value": cache} in init["env"]
        assert {"name": "tiny-model-cache", "mountPath": cache} in init["volumeMounts"]
        assert {"name": "tiny-model-cache", "mountPath": cache} in c["volumeMounts"], group
    cmd = init["command"]
    assert cmd[0] == "python"
    env = dict(os.environ, DSA_PD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    made = subprocess.run([sys.executable, *cmd[1:]], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, check=False)
    assert made.returncode == 0, made.stderr[-2000:]
    monkeypatch.setenv("DSA_PD_CACHE", str(tmp_path / "cache"))
    want = AppConfig.model_validate(r.app_args).model.checkpoint_dir()
    assert made.stdout.strip().splitlines()[-1] == str(want)
    assert (want / "config.json").exists()


def test_lint():
    for name, path in [("default", None), *CI_VALUES.items()]:
        values = None if path is None else ci_values(name)
        report = helm_python.lint(CHART, values, strict=True)
        assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], (name, report)


DSV32 = {"serveConfig": {"preset": "dsv32_pd"}}


@pytest.mark.parametrize("values, message", [
    # GPU counts the tensor-parallel size cannot use (the serve config's tp 8).
    ({**DSV32, "prefill": {"gpusPerPod": 4}}, "prefill.gpusPerPod: 4 GPUs cannot hold one prefill replica"),
    ({**DSV32, "decode": {"gpusPerPod": 12}}, ("decode.gpusPerPod: 12 is not a multiple of the decode role's "
                                               "tensor_parallel_size 8")),
    ({**DSV32, "decode": {"gpusPerPod": 16}}, ("decode.gpusPerPod: 16 is more than the serve config's "
                                               "decode.gpus_per_node (8)")),
    ({"decode": {"gpusPerPod": 1}}, "decode.gpusPerPod: 1, but the decode role runs on device cpu"),
    ({**DSV32, "decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
     "decode.autoscaling.minReplicas: 5 is more than maxReplicas 2"),
    ({**DSV32, "modelStorage": {"type": "pvc", "mountPath": "/weights", "pvc": {"claimName": "w"}}},
     ("modelStorage.mountPath: the model storage is mounted at /weights, but the serve config's model.path "
      "/models/DeepSeek-V3.2 is not under it")),
    ({"modelStorage": {"type": "pvc"}}, "modelStorage.pvc.claimName"),
    ({"auth": {"enabled": True}}, "auth.secretName: auth.enabled needs an existing Secret"),
    ({"serveConfig": {"inline": {"applications": [{"name": "x", "import_path": "deployments.app:build_app",
                                                   "args": {"api_key_env": "KEY"}}]}}},
     "auth.enabled: the serve config sets args.api_key_env (KEY)"),
    ({"serveConfig": {"inline": {"applications": [{"name": "x", "import_path": "deployments.app:build_app",
                                                   "args": {"api_key_file": "/k"}}]}}},
     "auth.enabled: the serve config sets args.api_key_file (/k), but the chart mounts no key file"),
    # The key's Secret volume needs a directory of its own.
    ({**DSV32, "modelStorage": {"type": "pvc", "pvc": {"claimName": "w"}},
      "auth": {"enabled": True, "secretName": "k", "source": "file", "mountPath": "/models/key"}},
     "auth.mountPath: /models/key overlaps modelStorage.mountPath at /models"),
    ({"auth": {"enabled": True, "secretName": "k", "source": "file", "mountPath": "/dev"}},
     "auth.mountPath: /dev overlaps the shared memory (/dev/shm) at /dev/shm"),
    ({"auth": {"enabled": True, "secretName": "k", "source": "file", "mountPath": "/var/cache/dsa-pd"}},
     "auth.mountPath: /var/cache/dsa-pd overlaps the tiny model's cache"),
    ({"auth": {"source": "vault"}}, "at '/auth/source'"),
    ({"auth": {"mountPath": "/etc/key/"}}, "at '/auth/mountPath'"),
    ({"serveConfig": {"inline": {"applications": []}}}, "serveConfig: the chart deploys one dsa-pd application"),
    ({"serveConfig": {"inline": {"applications": [{"name": "x", "import_path": "my.app:build"}]}}},
     "serveConfig: applications[0].import_path must be deployments.app:build_app"),
    # values.schema.json, checked by Helm before rendering.
    ({"serveConfig": {"preset": "dsv4"}}, "at '/serveConfig/preset': value must be one of"),
    ({"decode": {"gpus": 8}}, "at '/decode': additional properties 'gpus' not allowed"),
    ({"decode": {"gpusPerPod": -8}}, "at '/decode/gpusPerPod'"),
    ({"decode": {"autoscaling": {"minReplicas": 2}}}, "missing property 'maxReplicas'"),
    ({"service": {"type": "External"}}, "at '/service/type'"),
    ({"head": {"memory": "8 GB"}}, "at '/head/memory'"),
    ({"httpFrontend": "nginx"}, "at '/httpFrontend': value must be one of"),
])
def test_bad_values_fail_the_render_naming_the_value(values, message):
    with pytest.raises((helm_python.HelmRenderError, helm_python.HelmValuesError)) as e:
        render(values)
    assert message in str(e.value)
