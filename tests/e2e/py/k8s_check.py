"""Validates the Kubernetes base in deploy/k8s.

Every object of every file listed in kustomization.yaml is checked against the Kubernetes OpenAPI
schemas of one Kubernetes version with `kubernetes-validate` (strict: unknown fields are errors).
Then the objects are checked against each other, which no schema does: selectors match pod
labels, Services and probes name container ports that exist, Secret and ConfigMap references
resolve, workers ask for a GPU (a `nvidia.com/gpu` limit, or a resource claim of the pod; workers
sharing one each pass their own `--device`), and every grace period outlasts the drain timeout of
the config file its container reads.

A resource that is a directory is a base: its objects are loaded the same way, and the
overlay's `$patch: delete` patches remove objects from them (the only patches checked here).

Usage: k8s_check.py DEPLOY_K8S_DIR --kubernetes-version 1.33.0 [--dump-configs DIR]
       k8s_check.py --rendered FILE --kubernetes-version 1.33.0
With --dump-configs, each ConfigMap key is written to DIR/<key> so the caller can parse the TOML
files with the binaries' own flag parser. With --rendered, FILE is the output of
`kubectl kustomize DEPLOY_K8S_DIR`, checked the same way, and every image must have been given a
registry by the kustomization.

Prints one JSON object: {"kubernetes_version", "objects": ["Kind/name", ...], "configs": [...],
"workers": [{"deployment", "container", "binary", "args"}, ...]} (the workers' command lines, for
the caller to parse with the binaries' flag parser).
Exits 1 with the list of problems when anything is wrong.
"""

import argparse
import json
import os
import sys
import tomllib

import kubernetes_validate
import yaml


def load(directory):
    """The objects a kustomization makes: its files, its bases' objects (a resource that is a
    directory), less the objects its `$patch: delete` patches remove."""
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    listed = kustomization.get("resources", [])
    present = sorted(
        n for n in os.listdir(directory) if n.endswith((".yaml", ".yml")) and n != "kustomization.yaml"
    )
    problems = []
    for name in present:
        if name not in listed:
            problems.append(f"{name} is not listed in kustomization.yaml resources")
    objects = []
    for name in listed:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            problems.append(f"kustomization.yaml lists {name}, which does not exist")
            continue
        if os.path.isdir(path):
            _, base_objects, base_problems = load(path)
            objects += [(os.path.join(name, n), o) for n, o in base_objects]
            problems += [f"{name}: {p}" for p in base_problems]
            continue
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    objects.append((name, doc))
    for p in kustomization.get("patches", []):
        if "patch" in p:
            patch = yaml.safe_load(p["patch"])
        else:
            with open(os.path.join(directory, p["path"])) as f:
                patch = yaml.safe_load(f)
        if patch.get("$patch") != "delete":
            problems.append(f"patch of {ident(patch)}: only `$patch: delete` patches are checked here")
            continue
        kept = [(n, o) for n, o in objects if ident(o) != ident(patch)]
        if len(kept) == len(objects):
            problems.append(f"patch deletes {ident(patch)}, which no resource makes")
        objects = kept
    return kustomization, objects, problems


def port_named(cports, name):
    """The container port called `name`, or `<container>-<name>` in a pod of several workers."""
    for n, port in cports.items():
        if n == name or n.endswith("-" + name):
            return port
    return None


def ident(obj):
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def cross_check(objects):
    problems = []
    by_kind = {}
    for _, o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind.get("ConfigMap", [])}
    secrets = {
        o["metadata"]["name"]: set(o.get("stringData", {})) | set(o.get("data", {}))
        for o in by_kind.get("Secret", [])
    }
    deployments = by_kind.get("Deployment", []) + by_kind.get("StatefulSet", [])
    # The workers' `router` list must name every router replica by its stable name.
    router_names = set()
    for st in by_kind.get("StatefulSet", []):
        sname, svc = st["metadata"]["name"], st["spec"].get("serviceName")
        if svc not in {o["metadata"]["name"] for o in by_kind.get("Service", [])}:
            problems.append(f"{ident(st)}: serviceName {svc} is not a Service in the base")
        for i in range(st["spec"].get("replicas", 1)):
            router_names.add(f"{sname}-{i}.{svc}")
    claim_templates = {o["metadata"]["name"] for o in by_kind.get("ResourceClaimTemplate", [])}
    pod_ports = {}
    workers = []
    for d in deployments:
        name = ident(d)
        spec = d["spec"]
        pod = spec["template"]
        labels = pod["metadata"].get("labels", {})
        if not matches(spec["selector"].get("matchLabels"), labels):
            problems.append(f"{name}: selector does not match the pod template's labels")
        pspec = pod["spec"]
        sc = pspec.get("securityContext", {})
        if not sc.get("runAsNonRoot"):
            problems.append(f"{name}: pod does not set runAsNonRoot")
        volumes = {v["name"]: v for v in pspec.get("volumes", [])}
        grace = pspec.get("terminationGracePeriodSeconds", 30)
        ports = set()
        pod_claims = {}
        for rc in pspec.get("resourceClaims", []):
            template = rc.get("resourceClaimTemplateName")
            if template is not None and template not in claim_templates:
                problems.append(f"{name}: resource claim {rc['name']} names template {template}, which does not exist")
            pod_claims[rc["name"]] = template
        devices = {}
        for c in pspec["containers"]:
            cname = f"{name} container {c['name']}"
            cports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            ports |= set(cports)
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                get = c.get(probe, {}).get("httpGet")
                if probe != "startupProbe" and get is None:
                    problems.append(f"{cname}: no {probe} over HTTP")
                    continue
                if get is not None and get["port"] not in cports and get["port"] not in cports.values():
                    problems.append(f"{cname}: {probe} uses port {get['port']}, which the container does not expose")
            if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/health":
                problems.append(f"{cname}: liveness must probe /health")
            if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/ready":
                problems.append(f"{cname}: readiness must probe /ready")
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                problems.append(f"{cname}: allowPrivilegeEscalation is not false")
            if c.get("lifecycle", {}).get("preStop"):
                problems.append(f"{cname}: has a preStop hook; SIGTERM alone drains")
            binary = os.path.basename((c.get("command") or [""])[0])
            role = {"tandem-prefill": "prefill", "tandem-decode": "decode"}.get(binary)
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            claims = [cl["name"] for cl in c.get("resources", {}).get("claims", [])]
            for cl in claims:
                if cl not in pod_claims:
                    problems.append(f"{cname}: claims {cl}, which is not a resource claim of the pod")
            if role is not None and not claims and str(gpus) != "1":
                problems.append(f"{cname}: a {role} worker must ask for nvidia.com/gpu: 1 or claim GPUs (has {gpus})")
            args = c.get("args", [])
            if role is not None:
                workers.append({"deployment": name, "container": c["name"], "binary": binary, "args": args})
                # Workers that share claimed GPUs must each name their own.
                if claims:
                    device = args[args.index("--device") + 1] if "--device" in args else None
                    if device is None:
                        problems.append(f"{cname}: shares claimed GPUs but names no --device")
                    elif device in devices:
                        problems.append(f"{cname}: --device {device} is also container {devices[device]}'s")
                    else:
                        devices[device] = c["name"]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], set()):
                    problems.append(f"{cname}: env {e['name']} names secret key {ref['name']}/{ref['key']}, which does not exist")
            # The config file the container reads, through its ConfigMap mount.
            config = args[args.index("--config") + 1] if "--config" in args else None
            if config is None:
                problems.append(f"{cname}: no --config")
                continue
            found = None
            for m in c.get("volumeMounts", []):
                if config.startswith(m["mountPath"].rstrip("/") + "/"):
                    vol = volumes.get(m["name"], {})
                    cm = vol.get("configMap", {}).get("name")
                    key = config[len(m["mountPath"].rstrip("/")) + 1 :]
                    if cm not in configmaps or key not in configmaps[cm]:
                        problems.append(f"{cname}: --config {config} is not a key of a ConfigMap in the base")
                    else:
                        found = tomllib.loads(configmaps[cm][key])
            if found is None:
                problems.append(f"{cname}: --config {config} is not mounted from a ConfigMap")
                continue
            if "router" in found and router_names:
                named = {r.rsplit(":", 1)[0] for r in found["router"].split(",")}
                if named != router_names:
                    problems.append(f"{cname}: router {found['router']!r} does not name exactly the router replicas {sorted(router_names)}")
            drain_s = found.get("drain-timeout-ms", 30000) / 1000
            if grace <= drain_s:
                problems.append(f"{name}: terminationGracePeriodSeconds {grace} does not outlast drain-timeout-ms ({drain_s} s)")
            for key, port_name in (("listen", "grpc"), ("http-listen", "http"), ("kv-listen", "kv")):
                if key in found:
                    port = int(found[key].rsplit(":", 1)[1])
                    if port_named(cports, port_name) != port:
                        problems.append(f"{cname}: {key} port {port} is not the container port named {port_name} ({port_named(cports, port_name)})")
        pod_ports[name] = (labels, ports)
    for s in by_kind.get("Service", []):
        sel = s["spec"].get("selector", {})
        targets = [(n, ports) for n, (labels, ports) in pod_ports.items() if matches(sel, labels)]
        if not targets:
            problems.append(f"{ident(s)}: selector matches no workload's pods")
        for p in s["spec"].get("ports", []):
            for n, ports in targets:
                if isinstance(p.get("targetPort"), str) and p["targetPort"] not in ports:
                    problems.append(f"{ident(s)}: targetPort {p['targetPort']} is not a port of {n}")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"]["selector"].get("matchLabels", {})
        if not any(matches(sel, labels) for labels, _ in pod_ports.values()):
            problems.append(f"{ident(pdb)}: selector matches no workload's pods")
    return problems, workers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("directory", nargs="?")
    ap.add_argument("--rendered")
    ap.add_argument("--kubernetes-version", required=True)
    ap.add_argument("--dump-configs")
    a = ap.parse_args()

    if a.rendered:
        with open(a.rendered) as f:
            objects = [(a.rendered, d) for d in yaml.safe_load_all(f) if d is not None]
        problems = []
        for _, o in objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                for c in o["spec"]["template"]["spec"]["containers"]:
                    if "/" not in c["image"]:
                        problems.append(f"{ident(o)}: image {c['image']!r} was not rewritten by the kustomization")
            if o["metadata"].get("namespace", "tandem") != "tandem":
                problems.append(f"{ident(o)}: namespace {o['metadata'].get('namespace')}")
    else:
        _, objects, problems = load(a.directory)
    for name, obj in objects:
        try:
            kubernetes_validate.validate(obj, a.kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            problems.append(f"{name}: {ident(obj)}: {path}: {e.message}")
        except Exception as e:  # schema not found, malformed object
            problems.append(f"{name}: {ident(obj)}: {type(e).__name__}: {e}")
    workers = []
    if not problems:
        more, workers = cross_check(objects)
        problems += more

    configs = []
    if a.dump_configs:
        os.makedirs(a.dump_configs, exist_ok=True)
        for _, o in objects:
            if o["kind"] == "ConfigMap":
                for key, text in o.get("data", {}).items():
                    with open(os.path.join(a.dump_configs, key), "w") as f:
                        f.write(text)
                    configs.append(key)

    if problems:
        print("k8s_check: " + str(len(problems)) + " problem(s):", file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        sys.exit(1)
    print(json.dumps({
        "kubernetes_version": a.kubernetes_version,
        "objects": [ident(o) for _, o in objects],
        "configs": sorted(configs),
        "workers": workers,
    }))


if __name__ == "__main__":
    main()
