//! `lameduck inject` on manifests written by other people: public projects' manifests (the
//! corpus in tests/inject/corpus, origins in its SOURCES file), and one golden test for each way
//! such manifests used to come out broken. The judge is the real kubectl: what it reads in the
//! output is what it read in the input, plus the documented additions and nothing else.

mod support;

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use support::{inject, kubectl};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inject")
}

/// Injects `input` with `args`, checks the output against the golden file `name` (rewritten
/// under `LAMEDUCK_UPDATE_GOLDEN=1`) and that injecting it again changes nothing; returns the
/// output and stderr.
fn golden(input: &str, args: &[&str], name: &str) -> (String, String) {
    let (code, out, err) = inject(input, args);
    assert_eq!(code, 0, "{err}");
    let path = dir().join(name);
    if std::env::var_os("LAMEDUCK_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &out).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(out == want, "differs from {}:\n{out}", path.display());
    let (code, again, err) = inject(&out, args);
    assert_eq!(code, 0, "{err}");
    assert_eq!(again, out, "injecting the output again changed it");
    (out, err)
}

/// The newest kubectl, or a skip message naming the test.
fn newest_kubectl(test: &str) -> Option<PathBuf> {
    let found = kubectl::newest();
    if found.is_none() {
        support::skip(
            test,
            "no kubectl on PATH: what kubectl reads is not compared",
        );
    }
    found
}

/// What kubectl reads in `yaml`, object by object; a refusal fails the test.
fn read(kubectl: &Path, yaml: &str, what: &str) -> Vec<Value> {
    kubectl::label(kubectl, yaml)
        .unwrap_or_else(|stderr| panic!("{} refused {what}:\n{stderr}", kubectl.display()))
}

/// What kubectl reads in `input` and in `output` is the same, object for object, but for what
/// inject documents adding to the objects it injects; returns how many objects were injected.
fn assert_same_to_kubectl(kubectl: &Path, input: &str, output: &str, what: &str) -> usize {
    let mut before = read(kubectl, input, &format!("{what} (input)"));
    let mut after = read(kubectl, output, &format!("{what} (output)"));
    assert_eq!(before.len(), after.len(), "{what}: object count");
    let reference = before.clone();
    without_pod_grace(&mut after, &reference);
    without_pod_grace(&mut before, &reference);
    let mut injected = 0;
    for (before, after) in before.iter().zip(&after) {
        let name = format!("{what}: {} {}", before["kind"], before["metadata"]["name"]);
        if before == after {
            continue;
        }
        injected += 1;
        let mut undone = after.clone();
        undo_injection(&mut undone, &name);
        let mut before = before.clone();
        resolve_probe_ports(&mut before);
        assert_eq!(
            undone, before,
            "{name}: kubectl reads more than the documented additions in inject's output"
        );
    }
    injected
}

/// kubectl decodes every built-in workload among `objects` (its reading of inject's output)
/// into its Kubernetes type, as the API server would: no field of the wrong type.
fn assert_typed(kubectl: &Path, objects: &[Value], what: &str) {
    let workloads: Vec<&Value> = objects
        .iter()
        .filter(|object| {
            matches!(
                (object["apiVersion"].as_str(), object["kind"].as_str()),
                (Some("v1"), Some("Pod" | "ReplicationController"))
                    | (
                        Some("apps/v1"),
                        Some("Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet")
                    )
                    | (Some("batch/v1"), Some("Job" | "CronJob"))
            )
        })
        .collect();
    if workloads.is_empty() {
        return;
    }
    let list = json!({"apiVersion": "v1", "kind": "List", "items": workloads}).to_string();
    let (typed, stderr) = kubectl::read(
        kubectl,
        &list,
        &["set", "resources", "--local", "--limits=cpu=1"],
    )
    .unwrap_or_else(|stderr| panic!("{what}: kubectl cannot decode the workloads: {stderr}"));
    assert_eq!(typed.len(), workloads.len(), "{what}: {stderr}");
}

/// The pod spec of a built-in workload object (kubectl's JSON), if it has one.
fn pod_spec(object: &mut Value) -> Option<&mut Value> {
    let spec = match object["kind"].as_str()? {
        "Pod" => object.get_mut("spec")?,
        "CronJob" => object.pointer_mut("/spec/jobTemplate/spec/template/spec")?,
        _ => object.pointer_mut("/spec/template/spec")?,
    };
    spec.is_object().then_some(spec)
}

/// Takes out of an injected object exactly what docs/kubernetes.md says inject adds: the init
/// containers and the proxy, the shared volume, each app container's mount of it and its
/// hooks (putting back the app's own exec or sleep hook that they chain). Anything else left
/// different is an undocumented change (a raised `terminationGracePeriodSeconds` is checked
/// and set aside by [`without_pod_grace`]).
fn undo_injection(object: &mut Value, name: &str) {
    let spec = pod_spec(object).unwrap_or_else(|| panic!("{name}: changed but not a workload"));
    // The app's probes, which inject points at the admin port, as the proxy was given them.
    let originals: Value = ["initContainers", "containers"]
        .iter()
        .filter_map(|list| spec[list].as_array())
        .flatten()
        .filter(|container| container["name"] == "lameduck-proxy")
        .filter_map(|proxy| proxy["env"].as_array())
        .flatten()
        .find(|var| var["name"] == "LAMEDUCK_APP_PROBES")
        .map(|var| serde_json::from_str(var["value"].as_str().unwrap()).unwrap())
        .unwrap_or(Value::Null);
    let ours = ["lameduck-init", "lameduck-install", "lameduck-proxy"];
    for list in ["initContainers", "containers"] {
        if let Some(containers) = spec[list].as_array_mut() {
            containers.retain(|c| !ours.contains(&c["name"].as_str().unwrap_or_default()));
            for container in containers.iter_mut() {
                undo_container(container);
                undo_probes(container, &originals);
            }
            if containers.is_empty() {
                spec.as_object_mut().unwrap().remove(list);
            }
        }
    }
    let volumes = spec["volumes"].as_array_mut().expect("the shared volume");
    volumes.retain(|volume| volume["name"] != "lameduck-bin");
    if volumes.is_empty() {
        spec.as_object_mut().unwrap().remove("volumes");
    }
}

/// Each probe inject pointed at the admin port, back as the app declared it (named ports
/// resolved: see [`resolve_probe_ports`]).
fn undo_probes(container: &mut Value, originals: &Value) {
    for field in ["readinessProbe", "livenessProbe", "startupProbe"] {
        let Some(probe) = container.get_mut(field).and_then(Value::as_object_mut) else {
            continue;
        };
        let Some(path) = probe
            .get("httpGet")
            .filter(|get| get["port"] == 4191)
            .and_then(|get| get["path"].as_str())
            .map(str::to_string)
        else {
            continue;
        };
        let original = originals[&path]
            .as_object()
            .unwrap_or_else(|| panic!("{path}: rewritten, but the proxy does not run it"));
        probe.remove("httpGet");
        for handler in ["httpGet", "tcpSocket", "grpc"] {
            if let Some(action) = original.get(handler) {
                probe.insert(handler.into(), action.clone());
            }
        }
    }
}

/// Probes' named ports as the numbers of the container's ports of those names (inject hands
/// the proxy numbers, which is what the kubelet resolves them to).
fn resolve_probe_ports(object: &mut Value) {
    let Some(spec) = pod_spec(object) else { return };
    for list in ["initContainers", "containers"] {
        let containers = spec.get_mut(list).and_then(Value::as_array_mut);
        for container in containers.into_iter().flatten() {
            let ports = container.get("ports").cloned().unwrap_or_default();
            for field in ["readinessProbe", "livenessProbe", "startupProbe"] {
                for handler in ["httpGet", "tcpSocket"] {
                    let Some(port) = container.pointer_mut(&format!("/{field}/{handler}/port"))
                    else {
                        continue;
                    };
                    let Some(name) = port.as_str() else { continue };
                    let number = ports
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|declared| declared["name"] == name)
                        .map(|declared| declared["containerPort"].clone());
                    if let Some(number) = number {
                        *port = number;
                    }
                }
            }
        }
    }
}

fn undo_container(container: &mut Value) {
    let object = container.as_object_mut().unwrap();
    if let Some(mounts) = object.get_mut("volumeMounts").and_then(Value::as_array_mut) {
        mounts.retain(|mount| mount["name"] != "lameduck-bin");
        if mounts.is_empty() {
            object.remove("volumeMounts");
        }
    }
    let Some(lifecycle) = object.get_mut("lifecycle").and_then(Value::as_object_mut) else {
        return;
    };
    for event in ["preStop", "postStart"] {
        let Some(command) = lifecycle
            .get(event)
            .and_then(|hook| hook.pointer("/exec/command"))
            .and_then(Value::as_array)
            .cloned()
        else {
            continue;
        };
        if command.first() != Some(&json!("/lameduck/lameduck")) {
            continue;
        }
        let after = |flag: &str| command.iter().position(|arg| arg == flag);
        if let Some(at) = after("--") {
            lifecycle.insert(
                event.into(),
                json!({"exec": {"command": command[at + 1..].to_vec()}}),
            );
        } else if let Some(at) = after("--sleep") {
            let seconds = command[at + 1].as_str().unwrap().trim_end_matches('s');
            let seconds: u64 = seconds.parse().unwrap();
            lifecycle.insert(event.into(), json!({"sleep": {"seconds": seconds}}));
        } else {
            lifecycle.remove(event);
        }
    }
    if lifecycle.is_empty() {
        object.remove("lifecycle");
    }
}

/// Removes `terminationGracePeriodSeconds` from every pod spec, after checking that inject
/// never lowered it.
fn without_pod_grace(objects: &mut [Value], raised_from: &[Value]) {
    for (object, before) in objects.iter_mut().zip(raised_from) {
        let mut before = before.clone();
        let was =
            pod_spec(&mut before).and_then(|spec| spec["terminationGracePeriodSeconds"].as_u64());
        if let Some(spec) = pod_spec(object) {
            let now = spec["terminationGracePeriodSeconds"].as_u64();
            if let (Some(was), Some(now)) = (was, now) {
                assert!(
                    now >= was,
                    "terminationGracePeriodSeconds lowered from {was} to {now}"
                );
            }
            spec.as_object_mut()
                .unwrap()
                .remove("terminationGracePeriodSeconds");
        }
    }
}

/// The corpus: every file inject is given comes out as kubectl read it, but for the pods it
/// meshes; node agents (hostNetwork) and pods of another mesh come out byte for byte with a
/// note; injecting the output again changes nothing; kubectl decodes every output document
/// into its Kubernetes type.
#[test]
fn public_manifests_come_through_as_kubectl_reads_them() {
    let sources = std::fs::read_to_string(dir().join("corpus/SOURCES")).unwrap();
    let files: Vec<&str> = sources
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| line.split('\t').next().unwrap())
        .collect();
    assert!(files.len() >= 15, "the corpus lost its files");
    let kubectl = newest_kubectl("public_manifests_come_through_as_kubectl_reads_them");
    let mut summary = Vec::new();
    let (mut injected_total, mut left_alone) = (0, 0);
    for file in files {
        let input = std::fs::read_to_string(dir().join("corpus").join(file)).unwrap();
        let (code, output, notes) = inject(&input, &[]);
        assert_eq!(code, 0, "{file}: {notes}");
        let (code, again, _) = inject(&output, &[]);
        assert_eq!(code, 0, "{file}: the output refused");
        assert_eq!(
            again, output,
            "{file}: injecting the output again changed it"
        );
        let proxies = output.matches("name: lameduck-proxy\n").count();
        let skipped = notes.matches(": not injected: ").count();
        if proxies == 0 {
            assert_eq!(
                output.trim_end(),
                input.trim_end(),
                "{file}: nothing injected, yet changed"
            );
        }
        for line in notes
            .lines()
            .filter(|line| line.contains(": not injected: "))
        {
            assert!(
                line.contains("hostNetwork") || line.contains("meshed by"),
                "{file}: {line}"
            );
        }
        injected_total += proxies;
        left_alone += skipped;
        summary.push(format!("{file}: {proxies} injected, {skipped} left alone"));
        let Some(kubectl) = &kubectl else { continue };
        let changed = assert_same_to_kubectl(kubectl, &input, &output, file);
        assert_eq!(changed, proxies, "{file}: objects changed vs proxies added");
        assert_typed(kubectl, &read(kubectl, &output, file), file);
    }
    eprintln!("corpus:\n  {}", summary.join("\n  "));
    assert!(
        injected_total >= 20,
        "the corpus meshed only {injected_total} pods"
    );
    assert!(left_alone >= 8, "only {left_alone} pods were left alone");
}

/// A pod on the node's network is never given interception (its NAT rules would land in the
/// node's namespace): it comes out unchanged, with a note saying why.
#[test]
fn host_network_pods_are_left_alone_with_a_note() {
    let input = "\
apiVersion: v1
kind: Pod
metadata:
  name: bare
spec: {hostNetwork: true, containers: [{name: a, image: busybox}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: node-agent
spec:
  selector:
    matchLabels: {app: agent}
  template:
    metadata:
      labels: {app: agent}
      annotations:
        lameduck.io/intercept: disabled
    spec:
      hostNetwork: true
      containers:
      - name: agent
        image: agent:1
";
    let (out, err) = golden(input, &[], "host-network.out.yaml");
    assert_eq!(out, input);
    for name in ["Pod default/bare", "DaemonSet default/node-agent"] {
        assert!(
            err.contains(&format!(
                "{name}: not injected: it uses the node's network (hostNetwork)"
            )),
            "{err}"
        );
    }
}

/// kubectl reads YAML 1.1: plain `0640` is the number 416, `yes` a boolean, `1_000` a
/// thousand, `<<` merges. The output means the same to it, in workloads inject changes and in
/// documents it passes through (a custom resource, a ConfigMap).
#[test]
fn numbers_booleans_and_merge_keys_mean_to_kubectl_what_they_meant() {
    let input = std::fs::read_to_string(dir().join("yaml11.yaml")).unwrap();
    let (out, _) = golden(&input, &[], "yaml11.out.yaml");
    assert!(out.contains("defaultMode: 416"), "{out}");
    assert!(out.contains("runAsUser: 1000"), "{out}");
    assert!(
        !out.contains("'<<'") && !out.contains("\"<<\""),
        "a merge key became a key:\n{out}"
    );
    let Some(kubectl) =
        newest_kubectl("numbers_booleans_and_merge_keys_mean_to_kubectl_what_they_meant")
    else {
        return;
    };
    assert_eq!(
        assert_same_to_kubectl(&kubectl, &input, &out, "the file"),
        1
    );
    let before = read(&kubectl, &input, "the input");
    let volume = "/spec/template/spec/volumes/0/configMap/defaultMode";
    assert_eq!(before[0].pointer(volume), Some(&json!(416)));
    let containers = &before[0]["spec"]["template"]["spec"]["containers"];
    assert_eq!(
        containers[0]["resources"]["limits"]["memory"], "64Mi",
        "merged from the anchor"
    );
    assert_eq!(
        containers[1]["resources"]["limits"]["memory"], "128Mi",
        "overrides the merge"
    );
    let after = read(&kubectl, &out, "the output");
    assert_eq!(after[0].pointer(volume), Some(&json!(416)));
    assert_typed(&kubectl, &after, "the output");
}

/// A `Job` of another API group (Volcano's) is not a `batch/v1` Job: it passes through, and
/// the rest of the file is injected (it used to be refused whole).
#[test]
fn only_built_in_workload_kinds_are_injected() {
    let input = "\
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata:
  name: training
spec:
  minAvailable: 1
  tasks:
  - replicas: 2
    name: worker
    template:
      spec:
        containers: [{name: w, image: trainer:1}]
---
apiVersion: apps/v1beta1
kind: Deployment
metadata:
  name: ancient
spec:
  template:
    spec:
      containers: [{name: a, image: a:1}]
---
apiVersion: batch/v1
kind: Job
metadata:
  name: migrate
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: m, image: migrate:1}]
";
    let (out, _) = golden(input, &[], "kinds.out.yaml");
    let documents: Vec<&str> = out.split("\n---\n").collect();
    assert_eq!(documents.len(), 3);
    assert!(!documents[0].contains("lameduck"), "{}", documents[0]);
    assert!(!documents[1].contains("lameduck"), "{}", documents[1]);
    assert!(
        documents[2].contains("name: lameduck-proxy"),
        "{}",
        documents[2]
    );
}

/// Pods that Linkerd or Istio mesh (their containers, or the annotation or label that asks for
/// injection) are left alone with a note naming the mesh; `sidecar.istio.io/inject: "false"`
/// is no mesh.
#[test]
fn pods_of_another_mesh_are_left_alone() {
    let input = std::fs::read_to_string(dir().join("meshes.yaml")).unwrap();
    let (out, err) = golden(&input, &[], "meshes.out.yaml");
    let documents: Vec<&str> = out.split("\n---\n").collect();
    assert_eq!(documents.len(), 6);
    for (index, document) in documents.iter().enumerate() {
        let meshed_by_us = document.contains("name: lameduck-proxy");
        assert_eq!(
            meshed_by_us,
            index == 5,
            "document {}:\n{document}",
            index + 1
        );
    }
    for (name, mesh) in [
        (
            "linkerd-proxy-container",
            "Linkerd (container linkerd-proxy)",
        ),
        (
            "linkerd-annotation",
            "Linkerd (annotations linkerd.io/inject: enabled)",
        ),
        (
            "istio-label",
            "Istio (labels sidecar.istio.io/inject: true)",
        ),
        ("istio-sidecar", "Istio (container istio-init)"),
        ("istio-revision", "Istio (labels istio.io/rev: canary)"),
    ] {
        assert!(
            err.contains(&format!(
                "default/{name}: not injected: it is meshed by {mesh}"
            )),
            "{name}: {err}"
        );
    }
    assert_eq!(err.matches("meshed by").count(), 5, "{err}");
}

/// Every Pod Security Standards "restricted" rule a container or pod can break, as the
/// Kubernetes docs list them (baseline's and restricted's), for one pod spec. Each violation
/// is `container: rule`, `pod: rule` for the pod's own fields.
fn pod_security_restricted(spec: &Value) -> Vec<String> {
    let mut violations = Vec::new();
    let pod = &spec["securityContext"];
    for namespace in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[namespace] == true {
            violations.push(format!("pod: {namespace}"));
        }
    }
    let allowed_volumes = [
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    for volume in spec["volumes"].as_array().into_iter().flatten() {
        for (kind, _) in volume.as_object().unwrap() {
            if kind != "name" && !allowed_volumes.contains(&kind.as_str()) {
                violations.push(format!("pod: volume type {kind}"));
            }
        }
    }
    if pod["runAsUser"] == 0 {
        violations.push("pod: runAsUser 0".into());
    }
    let seccomp_ok = |context: &Value| {
        matches!(
            context["seccompProfile"]["type"].as_str(),
            Some("RuntimeDefault" | "Localhost")
        )
    };
    let containers = ["initContainers", "containers", "ephemeralContainers"]
        .iter()
        .flat_map(|list| spec[*list].as_array().cloned().unwrap_or_default());
    for container in containers {
        let name = container["name"].as_str().unwrap_or_default().to_string();
        let context = &container["securityContext"];
        let mut broken = |rule: &str| violations.push(format!("{name}: {rule}"));
        if context["privileged"] == true {
            broken("privileged");
        }
        if context["windowsOptions"]["hostProcess"] == true {
            broken("hostProcess");
        }
        if context["allowPrivilegeEscalation"] != false {
            broken("allowPrivilegeEscalation not false");
        }
        let non_root = context["runAsNonRoot"]
            .as_bool()
            .or(pod["runAsNonRoot"].as_bool());
        if non_root != Some(true) {
            broken("runAsNonRoot not true");
        }
        if context["runAsUser"] == 0 {
            broken("runAsUser 0");
        }
        let inherits = context["seccompProfile"].is_null() && seccomp_ok(pod);
        if !(seccomp_ok(context) || inherits) {
            broken("seccompProfile not RuntimeDefault or Localhost");
        }
        let drops: Vec<&str> = context["capabilities"]["drop"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if !drops.contains(&"ALL") {
            broken("capabilities do not drop ALL");
        }
        for added in context["capabilities"]["add"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if added != "NET_BIND_SERVICE" {
                broken(&format!(
                    "capability {} added",
                    added.as_str().unwrap_or("?")
                ));
            }
        }
        for port in container["ports"].as_array().into_iter().flatten() {
            if port["hostPort"].as_u64().is_some_and(|port| port != 0) {
                broken("hostPort");
            }
        }
        if context["procMount"]
            .as_str()
            .is_some_and(|mount| mount != "Default")
        {
            broken("procMount");
        }
    }
    violations
}

/// An app that passes Pod Security "restricted" (with every setting on its own container, so
/// that ours must carry their own) still passes once injected in the explicit mode, native or
/// legacy; with interception, only `lameduck-init` breaks the rules, and only those its NAT
/// rules need (root, NET_ADMIN and NET_RAW), which docs/kubernetes.md names.
#[test]
fn added_containers_pass_pod_security_restricted() {
    let restricted_app = |intercept: &str| {
        format!(
            "\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: locked-down
spec:
  selector:
    matchLabels: {{app: locked}}
  template:
    metadata:
      labels: {{app: locked}}
      annotations:
        lameduck.io/intercept: {intercept}
    spec:
      initContainers:
      - name: setup
        image: setup:1
        securityContext: &restricted
          runAsNonRoot: true
          allowPrivilegeEscalation: false
          seccompProfile: {{type: RuntimeDefault}}
          capabilities: {{drop: [ALL]}}
      containers:
      - name: app
        image: app:1
        ports: [{{containerPort: 8080}}]
        securityContext: *restricted
"
        )
    };
    let spec_of = |yaml: &str| -> Value {
        let mut documents = serde_norway::Deserializer::from_str(yaml);
        let document = documents.next().unwrap();
        use serde::Deserialize;
        let value = serde_norway::Value::deserialize(document).unwrap();
        serde_json::to_value(value).unwrap()["spec"]["template"]["spec"].clone()
    };
    let input = restricted_app("disabled");
    assert_eq!(
        pod_security_restricted(&spec_of(&input)),
        Vec::<String>::new(),
        "the app itself"
    );
    for args in [&[][..], &["--native-sidecar=false"][..]] {
        let (code, out, err) = inject(&input, args);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            pod_security_restricted(&spec_of(&out)),
            Vec::<String>::new(),
            "explicit mode {args:?}:\n{out}"
        );
        let (code, out, err) = inject(&restricted_app("enabled"), args);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            pod_security_restricted(&spec_of(&out)),
            [
                "lameduck-init: runAsNonRoot not true",
                "lameduck-init: runAsUser 0",
                "lameduck-init: capability NET_ADMIN added",
                "lameduck-init: capability NET_RAW added",
            ],
            "interception {args:?}:\n{out}"
        );
    }
}

/// Legacy mode has no proxy running before the app containers: the app's own init containers
/// run before the NAT rules are installed (so their connections are not sent to a port nobody
/// listens on), and the rules come last. Native mode: the rules first, then the proxy, which
/// serves the app's init containers.
#[test]
fn app_init_containers_are_never_cut_off_from_the_network() {
    let input = "\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: waits-for-db
spec:
  selector:
    matchLabels: {app: w}
  template:
    metadata:
      labels: {app: w}
    spec:
      initContainers:
      - name: wait-for-db
        image: curlimages/curl:8.9.1
        command: [sh, -c, 'until curl -fsS http://db:5432/; do sleep 1; done']
      - name: clone
        image: alpine/git:2.45.2
      containers:
      - name: app
        image: app:1
";
    let order = |out: &str| -> Vec<String> {
        use serde::Deserialize;
        let document = serde_norway::Deserializer::from_str(out).next().unwrap();
        let value = serde_norway::Value::deserialize(document).unwrap();
        let json = serde_json::to_value(value).unwrap();
        json["spec"]["template"]["spec"]["initContainers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    };
    let (legacy, _) = golden(
        input,
        &["--native-sidecar=false"],
        "init-order.legacy.out.yaml",
    );
    assert_eq!(
        order(&legacy),
        ["lameduck-install", "wait-for-db", "clone", "lameduck-init"]
    );
    let (native, _) = golden(input, &[], "init-order.native.out.yaml");
    assert_eq!(
        order(&native),
        [
            "lameduck-init",
            "lameduck-install",
            "lameduck-proxy",
            "wait-for-db",
            "clone"
        ]
    );
}

/// A block scalar at the very end of a file with no final line break keeps the line break
/// kubectl reads in it, in a document inject rewrites and in one it passes through.
#[test]
fn a_block_scalar_at_the_end_of_a_file_keeps_its_line_break() {
    let input = "\
apiVersion: v1
kind: ConfigMap
metadata:
  name: scripts
data:
  run.sh: |
    echo hi
---
apiVersion: v1
kind: Pod
spec:
  containers: [{name: runner, image: runner:1}]
metadata:
  name: runner
  annotations:
    note: |
      echo hi";
    let (out, _) = golden(input, &[], "block-at-end.out.yaml");
    assert!(out.contains("name: lameduck-proxy"), "{out}");
    assert!(out.contains("    note: |\n      echo hi\n"), "{out}");
    let Some(kubectl) = newest_kubectl("a_block_scalar_at_the_end_of_a_file_keeps_its_line_break")
    else {
        return;
    };
    let before = read(&kubectl, input, "the input");
    assert_eq!(before[1]["metadata"]["annotations"]["note"], "echo hi\n");
    assert_eq!(assert_same_to_kubectl(&kubectl, input, &out, "the file"), 1);
}

/// `DeploymentList`, `PodList` and `List` items are injected as their kind (a typed list's
/// items may leave apiVersion and kind to the list), as kubectl applies them.
#[test]
fn list_items_are_injected_as_their_kind() {
    let input = "\
apiVersion: apps/v1
kind: DeploymentList
items:
- metadata: {name: typed}
  spec:
    selector: {matchLabels: {app: t}}
    template:
      metadata: {labels: {app: t}}
      spec: {containers: [{name: t, image: t:1}]}
---
apiVersion: v1
kind: PodList
items:
- metadata: {name: pod}
  spec: {containers: [{name: p, image: p:1}]}
---
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: plain}
- apiVersion: apps/v1
  kind: StatefulSet
  metadata: {name: db}
  spec:
    serviceName: db
    selector: {matchLabels: {app: db}}
    template:
      metadata: {labels: {app: db}}
      spec: {containers: [{name: db, image: db:1}]}
";
    let (out, _) = golden(input, &[], "lists.out.yaml");
    assert_eq!(out.matches("name: lameduck-proxy\n").count(), 3, "{out}");
    let Some(kubectl) = newest_kubectl("list_items_are_injected_as_their_kind") else {
        return;
    };
    assert_eq!(
        assert_same_to_kubectl(&kubectl, input, &out, "the lists"),
        3
    );
}
