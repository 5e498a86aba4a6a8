//! `lameduck inject` on the real binary: golden files over every workload kind in both modes
//! and every annotation, bad annotations, idempotency, and every output document checked
//! against the Kubernetes API types (k8s-openapi), not only against our own expectations.
//!
//! `LAMEDUCK_UPDATE_GOLDEN=1 cargo test --test inject` rewrites the golden files; review the diff.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use support::{BIN, inject, kubectl};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/inject")
}

/// Injects `input` with `args` and compares with the golden file `expected`.
fn golden(input: &Path, args: &[&str], expected: &Path) -> (String, String) {
    let (code, out, err) = inject(&std::fs::read_to_string(input).unwrap(), args);
    assert_eq!(code, 0, "{err}");
    if std::env::var_os("LAMEDUCK_UPDATE_GOLDEN").is_some() {
        std::fs::write(expected, &out).unwrap();
    }
    let want = std::fs::read_to_string(expected).unwrap_or_default();
    assert!(
        out == want,
        "{} differs from {}:\n{out}",
        input.display(),
        expected.display()
    );
    check_schema(&out);
    check_with_kubectl(&out, &kubectl::clients()[..1]);
    assert_idempotent(&out, args);
    (out, err)
}

/// Every document of `yaml` is decoded by each kubectl in `clients` offline, as `kubectl
/// apply` decodes it (YAML 1.1 rules, then the Kubernetes types), and reads back with every
/// value that our own YAML library reads: no string became a boolean, a number or a
/// timestamp, nothing was refused.
///
/// `kubectl set resources --local` decodes each workload into its typed object (and declines
/// other kinds, which is all it may say of them); `kubectl label --local` decodes every kind.
fn check_with_kubectl(yaml: &str, clients: &[PathBuf]) {
    use serde::Deserialize;
    if clients.is_empty() {
        support::skip(
            "kubectl decoding",
            "no kubectl on PATH; the YAML 1.1 reading of inject's output is not checked",
        );
        return;
    }
    let mut ours = Vec::new();
    for document in serde_norway::Deserializer::from_str(yaml) {
        let value =
            serde_json::to_value(serde_norway::Value::deserialize(document).unwrap()).unwrap();
        match value["kind"].as_str() {
            Some("List") => ours.extend(value["items"].as_array().unwrap().iter().cloned()),
            _ => ours.push(value),
        }
    }
    for kubectl in clients {
        let labelled = kubectl::label(kubectl, yaml).unwrap_or_else(|stderr| {
            panic!("{} refused inject's output:\n{stderr}", kubectl.display())
        });
        assert_eq!(labelled.len(), ours.len(), "{}", kubectl.display());
        for (theirs, ours) in labelled.iter().zip(&ours) {
            assert_contains(theirs, ours, kubectl, "", false);
        }
        // Native sidecars (`restartPolicy` on an init container) came in Kubernetes 1.28 (beta
        // and on by default in 1.29, the version the README requires): older typed readings
        // drop the field, as the API server of those versions would.
        if kubectl::minor(kubectl).is_some_and(|minor| minor < 29) {
            continue;
        }
        let (typed, stderr) = kubectl::read(
            kubectl,
            yaml,
            &["set", "resources", "--local", "--limits=cpu=1"],
        )
        .unwrap_or_else(|stderr| panic!("{}: {stderr}", kubectl.display()));
        for line in stderr.lines().filter(|line| !line.is_empty()) {
            assert!(
                line.contains("is not a pod or does not have a pod template"),
                "{} could not decode inject's output into its types:\n{stderr}",
                kubectl.display()
            );
        }
        for theirs in &typed {
            let ours = ours
                .iter()
                .find(|ours| {
                    ours["kind"] == theirs["kind"]
                        && ours["metadata"]["name"] == theirs["metadata"]["name"]
                })
                .unwrap_or_else(|| {
                    panic!(
                        "{} decoded an object we did not write: {theirs}",
                        kubectl.display()
                    )
                });
            assert_contains(theirs, ours, kubectl, "", true);
        }
    }
}

/// Every value in `ours` is in `theirs` at the same place, of the same type; `theirs` may hold
/// more (fields kubectl adds: defaults, the label or limit it was asked to set). A typed
/// reading leaves out empty values (Go's `omitempty`: an env var's `value: ""`); an untyped one
/// leaves out nothing.
fn assert_contains(
    theirs: &serde_json::Value,
    ours: &serde_json::Value,
    kubectl: &Path,
    at: &str,
    typed: bool,
) {
    use serde_json::Value;
    match (theirs, ours) {
        (Value::Object(theirs), Value::Object(ours)) => {
            for (key, value) in ours {
                let missing = !theirs.contains_key(key);
                let empty = matches!(value, Value::Null)
                    || value.as_str() == Some("")
                    || value.as_object().is_some_and(|map| map.is_empty());
                if missing && (*value == Value::Null || (typed && empty)) {
                    continue;
                }
                let theirs = theirs.get(key).unwrap_or(&Value::Null);
                assert_contains(theirs, value, kubectl, &format!("{at}.{key}"), typed);
            }
        }
        (Value::Array(theirs), Value::Array(ours)) => {
            assert_eq!(theirs.len(), ours.len(), "{}: {at}", kubectl.display());
            for (index, (theirs, ours)) in theirs.iter().zip(ours).enumerate() {
                assert_contains(theirs, ours, kubectl, &format!("{at}[{index}]"), typed);
            }
        }
        _ => assert_eq!(
            theirs,
            ours,
            "{} reads {at} differently from our YAML library",
            kubectl.display()
        ),
    }
}

fn assert_idempotent(injected: &str, args: &[&str]) {
    let (code, again, err) = inject(injected, args);
    assert_eq!(code, 0, "{err}");
    assert_eq!(again, injected, "injecting an injected manifest changed it");
}

/// Every document deserializes into its Kubernetes API type and serializes back to the same
/// JSON: no misplaced field (it would be dropped), no wrong type (it would not parse).
fn check_schema(yaml: &str) {
    use serde::Deserialize;
    for document in serde_norway::Deserializer::from_str(yaml) {
        let value = serde_norway::Value::deserialize(document).unwrap();
        check_document(serde_json::to_value(&value).unwrap());
    }
}

fn check_document(json: serde_json::Value) {
    use k8s_openapi::api::{apps::v1 as apps, batch::v1 as batch, core::v1 as core};
    let kind = json["kind"].as_str().unwrap_or_default().to_string();
    match kind.as_str() {
        "List" => json["items"]
            .as_array()
            .unwrap()
            .iter()
            .cloned()
            .for_each(check_document),
        "Pod" => roundtrip::<core::Pod>(&json),
        "Service" => roundtrip::<core::Service>(&json),
        "ConfigMap" => roundtrip::<core::ConfigMap>(&json),
        "ReplicationController" => roundtrip::<core::ReplicationController>(&json),
        "Deployment" => roundtrip::<apps::Deployment>(&json),
        "StatefulSet" => roundtrip::<apps::StatefulSet>(&json),
        "DaemonSet" => roundtrip::<apps::DaemonSet>(&json),
        "ReplicaSet" => roundtrip::<apps::ReplicaSet>(&json),
        "Job" => roundtrip::<batch::Job>(&json),
        "CronJob" => roundtrip::<batch::CronJob>(&json),
        other => panic!("no API type for kind {other:?}"),
    }
}

fn roundtrip<T: DeserializeOwned + Serialize>(json: &serde_json::Value) {
    let typed: T = serde_json::from_value(json.clone())
        .unwrap_or_else(|error| panic!("not a valid {}: {error}\n{json:#}", json["kind"]));
    let mut back = serde_json::to_value(&typed).unwrap();
    drop_added_type_fields(&mut back, json);
    assert_eq!(
        &back, json,
        "fields the Kubernetes API does not know were written"
    );
}

/// k8s-openapi writes `apiVersion` and `kind` on nested resources (such as
/// `volumeClaimTemplates`) where the input has none; only those additions are ignored.
fn drop_added_type_fields(back: &mut serde_json::Value, original: &serde_json::Value) {
    match (back, original) {
        (serde_json::Value::Object(back), serde_json::Value::Object(original)) => {
            for key in ["apiVersion", "kind"] {
                if !original.contains_key(key) {
                    back.remove(key);
                }
            }
            for (key, value) in back.iter_mut() {
                if let Some(original) = original.get(key) {
                    drop_added_type_fields(value, original);
                }
            }
        }
        (serde_json::Value::Array(back), serde_json::Value::Array(original)) => {
            for (value, original) in back.iter_mut().zip(original) {
                drop_added_type_fields(value, original);
            }
        }
        _ => {}
    }
}

fn proxy_env(doc: &str, name: &str) -> Option<String> {
    let at = doc.find(&format!("name: {name}\n"))?;
    let rest = &doc[at..];
    let value = rest.lines().nth(1)?.trim().strip_prefix("value: ")?;
    Some(value.trim_matches('\'').trim_matches('"').to_string())
}

#[test]
fn every_workload_kind_as_native_sidecar() {
    let (out, err) = golden(
        &dir().join("workloads.yaml"),
        &[],
        &dir().join("workloads.native.out.yaml"),
    );
    assert_eq!(
        out.matches("name: lameduck-proxy").count(),
        8,
        "one proxy per pod template, none for the opted-out"
    );
    assert_eq!(out.matches("restartPolicy: Always").count(), 8);
    assert!(
        err.contains("Pod tools/debug: raised terminationGracePeriodSeconds from 60 to 85"),
        "20s of inbound drain, then the app's own 60s, then the margin: {err}"
    );
    assert!(
        err.contains("CronJob default/nightly: raised terminationGracePeriodSeconds from 30 to 80"),
        "{err}"
    );
    assert_eq!(
        out.matches("- prestop\n").count(),
        out.matches("- poststart\n").count() + 8,
        "every app container gets both hooks, and every proxy a preStop hook of its own"
    );
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    assert_eq!(
        lines
            .windows(2)
            .filter(|pair| pair == &["- /usr/local/bin/lameduck", "- prestop"])
            .count(),
        8,
        "the proxy's own preStop hook quiesces the inbound side at the pod's termination"
    );
}

#[test]
fn every_workload_kind_in_legacy_mode() {
    let (out, err) = golden(
        &dir().join("workloads.yaml"),
        &["--native-sidecar=false"],
        &dir().join("workloads.legacy.out.yaml"),
    );
    assert!(!out.contains("restartPolicy: Always"));
    // Jobs: the app is wrapped, the binary handed over, the endpoint enabled.
    assert!(
        out.contains("- /lameduck/lameduck\n") && out.contains("- /migrate\n"),
        "{out}"
    );
    assert_eq!(
        out.matches("name: lameduck-install").count(),
        8,
        "every injected pod gets the binary for its hooks"
    );
    assert_eq!(
        out.matches("- /lameduck/lameduck\n        - await\n")
            .count()
            + out
                .matches("- /lameduck/lameduck\n            - await\n")
                .count(),
        2,
        "only Job and CronJob containers are wrapped:\n{out}"
    );
    assert!(
        err.contains("container uploader has no explicit command"),
        "{err}"
    );
    // The proxy, an ordinary container signalled with the app, waits in its own preStop hook
    // until the app containers have exited; each of them leaves a holder that tells it so.
    assert_eq!(out.matches("- --wait-for-apps\n").count(), 8, "{out}");
    assert_eq!(
        out.matches("- --hold\n").count(),
        out.matches("- poststart\n").count()
    );
}

#[test]
fn every_annotation_takes_effect() {
    let (out, err) = golden(
        &dir().join("annotations.yaml"),
        &[],
        &dir().join("annotations.out.yaml"),
    );
    let docs: Vec<&str> = out.split("\n---\n").collect();
    assert_eq!(
        proxy_env(docs[0], "LAMEDUCK_SHUTDOWN_GRACE_PERIOD").as_deref(),
        Some("90s"),
        "ours wins over Linkerd's"
    );
    assert_eq!(
        proxy_env(docs[0], "LAMEDUCK_LAME_DUCK_PERIOD").as_deref(),
        Some("5s")
    );
    assert_eq!(
        proxy_env(docs[0], "LAMEDUCK_CLOSE_SPREAD_WINDOW").as_deref(),
        Some("30s")
    );
    assert_eq!(
        proxy_env(docs[1], "LAMEDUCK_CLOSE_SPREAD_WINDOW"),
        None,
        "without the annotation, the proxy's default"
    );
    assert!(
        docs[0].contains("terminationGracePeriodSeconds: 395"),
        "300s of the app's own, after 90s of inbound drain, and the margin"
    );
    assert_eq!(
        proxy_env(docs[1], "LAMEDUCK_INBOUND").as_deref(),
        Some("0.0.0.0:4143=127.0.0.1:8080,0.0.0.0:4144=127.0.0.1:9090")
    );
    assert_eq!(
        proxy_env(docs[1], "LAMEDUCK_SHUTDOWN_ENDPOINT").as_deref(),
        Some("true")
    );
    assert!(
        docs[2].contains("containers:\n") && !docs[2].contains("restartPolicy: Always"),
        "native-sidecar: disabled"
    );
    assert_eq!(
        proxy_env(docs[2], "LAMEDUCK_SHUTDOWN_GRACE_PERIOD").as_deref(),
        Some("2s"),
        "4s pod budget minus margin"
    );
    assert_eq!(
        proxy_env(docs[2], "LAMEDUCK_SHUTDOWN_ENDPOINT").as_deref(),
        Some("false")
    );
    assert!(!docs[3].contains("lameduck-proxy"), "inject: disabled");
    // Interception (the default): ours win over Linkerd's, Linkerd's count when ours are absent.
    let init = init_command(docs[4]);
    assert_eq!(
        init,
        [
            "/usr/local/bin/lameduck",
            "iptables",
            "--inbound-port",
            "4143",
            "--outbound-port",
            "4140",
            "--admin-port",
            "4191",
            "--proxy-uid",
            "2110",
            "--skip-inbound-ports",
            "22",
            "--skip-outbound-ports",
            "25,3306",
            "--skip-outbound-cidrs",
            "169.254.169.254/32,fd00::/8",
        ]
    );
    assert_eq!(
        proxy_env(docs[4], "LAMEDUCK_OUTBOUND").as_deref(),
        Some("0.0.0.0:4140=orig-dst,[::]:4140=orig-dst")
    );
    assert_eq!(
        init_command(docs[1]),
        Vec::<String>::new(),
        "intercept: disabled"
    );
    assert_eq!(
        err.lines().count(),
        4,
        "one note per injected workload, each a raised budget: {err}"
    );
    assert!(
        err.lines()
            .all(|line| line.contains("raised terminationGracePeriodSeconds")),
        "{err}"
    );
}

/// The command of the `lameduck-init` container of one injected document (none: empty).
fn init_command(document: &str) -> Vec<String> {
    use serde::Deserialize;
    let value =
        serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(document)).unwrap();
    let init = value["spec"]["template"]["spec"]["initContainers"]
        .as_sequence()
        .cloned()
        .unwrap_or_default();
    init.iter()
        .find(|container| container["name"] == "lameduck-init")
        .map(|container| {
            container["command"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|arg| arg.as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The hooks of docs/pod-lifecycle.md: every app container runs `lameduck prestop` first, then
/// its own exec or sleep preStop action (an httpGet one cannot be chained: kept, with a note),
/// and `lameduck poststart` likewise; the binary comes from the shared volume, mounted
/// read-only.
#[test]
fn app_containers_get_the_drain_hooks_chained_with_their_own() {
    use serde::Deserialize;
    let (out, err) = golden(
        &dir().join("hooks.yaml"),
        &[],
        &dir().join("hooks.out.yaml"),
    );
    let docs: Vec<serde_norway::Value> = serde_norway::Deserializer::from_str(&out)
        .map(|document| serde_norway::Value::deserialize(document).unwrap())
        .collect();
    let spec = &docs[0]["spec"]["template"]["spec"];
    let command = |container: usize, event: &str| -> Vec<String> {
        spec["containers"][container]["lifecycle"][event]["exec"]["command"]
            .as_sequence()
            .map(|args| {
                args.iter()
                    .map(|arg| arg.as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        command(0, "preStop"),
        [
            "/lameduck/lameduck",
            "prestop",
            "--socket",
            "/lameduck/drain.sock",
            "--",
            "/bin/sh",
            "-c",
            "nginx -s quit; sleep 1"
        ]
    );
    assert_eq!(
        command(0, "postStart"),
        [
            "/lameduck/lameduck",
            "poststart",
            "--socket",
            "/lameduck/drain.sock",
            "--",
            "/bin/sh",
            "-c",
            "echo started > /tmp/started"
        ]
    );
    assert_eq!(
        command(1, "preStop"),
        [
            "/lameduck/lameduck",
            "prestop",
            "--socket",
            "/lameduck/drain.sock",
            "--sleep",
            "10s"
        ]
    );
    let ours = |hook: &str| {
        [
            "/lameduck/lameduck".to_string(),
            hook.to_string(),
            "--socket".to_string(),
            "/lameduck/drain.sock".to_string(),
        ]
    };
    assert_eq!(command(1, "postStart"), ours("poststart"));
    assert_eq!(
        spec["containers"][2]["lifecycle"]["preStop"]["httpGet"]["path"],
        "/drain"
    );
    assert!(command(2, "preStop").is_empty());
    assert_eq!(command(2, "postStart"), ours("poststart"));
    assert!(
        err.contains("container http-hook has a httpGet preStop hook")
            && err.contains("make it an exec hook"),
        "{err}"
    );
    for index in 0..3 {
        let mounts = spec["containers"][index]["volumeMounts"]
            .as_sequence()
            .unwrap();
        assert!(
            mounts.iter().any(|mount| mount["name"] == "lameduck-bin"
                && mount["mountPath"] == "/lameduck"
                && mount["readOnly"] == true),
            "container {index}: {mounts:?}"
        );
    }
    let init = spec["initContainers"].as_sequence().unwrap();
    assert_eq!(
        init[0]["name"], "lameduck-init",
        "the NAT rules before anything runs"
    );
    assert_eq!(init[1]["name"], "lameduck-install", "then the binary");
    assert_eq!(init[2]["name"], "lameduck-proxy");
    assert_eq!(
        proxy_env(&out, "LAMEDUCK_DRAIN_SOCKET").as_deref(),
        Some("/lameduck/drain.sock")
    );
    // A Job serves no inbound traffic: no lame duck that would hold up its completion.
    let job = out.split("\n---\n").nth(1).unwrap();
    assert_eq!(proxy_env(job, "LAMEDUCK_LAME_DUCK_PERIOD"), None);
    assert_eq!(proxy_env(job, "LAMEDUCK_LAME_DUCK_MAX"), None);
    assert_eq!(
        proxy_env(&out, "LAMEDUCK_LAME_DUCK_MAX").as_deref(),
        Some("28s"),
        "by default an adaptive lame duck, up to four fifths of the grace period (35 s here)"
    );
    assert!(
        out.contains("name: LAMEDUCK_LAME_DUCK_IGNORE_SOURCES\n          valueFrom:\n            fieldRef:\n              fieldPath: status.hostIP\n"),
        "the kubelet's probes come from the node: {out}"
    );
}

/// `terminationGracePeriodSeconds` covers the inbound drain (the proxy's grace period, lame
/// duck included), then the app's own budget from before injection, then the margin; it is
/// never lowered, and inject says on stderr when it raised it.
#[test]
fn the_pod_budget_covers_the_drain_then_the_apps_own_shutdown() {
    use lameduck::commands::inject::{GRACE_MARGIN_SECONDS, pod_budget};
    assert_eq!(pod_budget(Duration::from_secs(25), 30), 60);
    assert_eq!(
        pod_budget(Duration::from_millis(1500), 10),
        2 + 10 + GRACE_MARGIN_SECONDS
    );
    let cases = [
        // (pod budget before, grace annotation, budget after, proxy grace period)
        (None, None, 60, "25s"),
        (Some(30), Some("90s"), 125, "90s"),
        (Some(600), Some("10s"), 615, "10s"),
        (Some(4), None, 11, "2s"),
        (Some(0), None, 5, "0s"),
    ];
    for (before, annotation, after, grace) in cases {
        let mut pod = String::from("apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n");
        if let Some(annotation) = annotation {
            pod.push_str(&format!(
                "  annotations:\n    lameduck.io/shutdown-grace-period: {annotation}\n"
            ));
        }
        pod.push_str("spec:\n");
        if let Some(before) = before {
            pod.push_str(&format!("  terminationGracePeriodSeconds: {before}\n"));
        }
        pod.push_str("  containers:\n  - name: app\n    image: app:1\n");
        let (code, out, err) = inject(&pod, &[]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains(&format!("terminationGracePeriodSeconds: {after}\n")),
            "{before:?} {annotation:?}: {out}"
        );
        assert_eq!(
            proxy_env(&out, "LAMEDUCK_SHUTDOWN_GRACE_PERIOD").as_deref(),
            Some(grace)
        );
        let grace = humantime::parse_duration(grace).unwrap();
        match proxy_env(&out, "LAMEDUCK_LAME_DUCK_MAX") {
            Some(max) => {
                let max = humantime::parse_duration(&max).unwrap();
                assert!(
                    max <= grace.mul_f64(0.8) && max <= Duration::from_secs(60),
                    "{max:?} of {grace:?}: the drain after the lame duck gets a fifth at least"
                );
                assert!(
                    max >= grace.mul_f64(0.8).min(Duration::from_secs(60))
                        - Duration::from_millis(1),
                    "{max:?} of {grace:?}: the lame duck may take four fifths (to 60 s)"
                );
            }
            None => assert!(grace.is_zero(), "no lame duck for a {grace:?} grace period"),
        }
        assert!(
            err.contains(&format!(
                "raised terminationGracePeriodSeconds from {} to {after}",
                before.unwrap_or(30)
            )),
            "{err}"
        );
    }
}

#[test]
fn derived_grace_period_stays_inside_the_pod_budget() {
    let (_, out, _) = inject(
        &std::fs::read_to_string(dir().join("workloads.yaml")).unwrap(),
        &[],
    );
    let docs: Vec<&str> = out.split("\n---\n").collect();
    // Deployment shop/web: default 30s budget → 25s; StatefulSet db: 120s → 115s.
    assert_eq!(
        proxy_env(docs[1], "LAMEDUCK_SHUTDOWN_GRACE_PERIOD").as_deref(),
        Some("25s")
    );
    assert_eq!(
        proxy_env(docs[2], "LAMEDUCK_SHUTDOWN_GRACE_PERIOD").as_deref(),
        Some("115s")
    );
}

#[test]
fn bad_annotations_exit_2_naming_object_annotation_and_value() {
    let cases = [
        ("lameduck.io/shutdown-grace-period", "10", "needs a unit"),
        ("lameduck.io/shutdown-grace-period", "-5s", "negative"),
        ("lameduck.io/shutdown-grace-period", "3d", "maximum"),
        ("config.linkerd.io/shutdown-grace-period", "soon", "soon"),
        (
            "lameduck.io/lame-duck-period",
            "10m",
            "longer than the shutdown grace period",
        ),
        (
            "lameduck.io/close-spread-window",
            "10m",
            "longer than the shutdown grace period",
        ),
        ("lameduck.io/close-spread-window", "soon", "soon"),
        (
            "lameduck.io/shutdown-endpoint",
            "maybe",
            "enabled or disabled",
        ),
        ("lameduck.io/inject", "yes please", "enabled or disabled"),
        (
            "lameduck.io/native-sidecar",
            "sometimes",
            "enabled or disabled",
        ),
        ("lameduck.io/inbound-ports", "http", "8080,9090"),
        ("lameduck.io/inbound-ports", "0", "8080,9090"),
        ("lameduck.io/intercept", "perhaps", "enabled or disabled"),
        ("lameduck.io/skip-outbound-ports", "smtp", "25,443"),
        (
            "config.linkerd.io/skip-inbound-ports",
            "8000-9000",
            "25,443",
        ),
        (
            "lameduck.io/skip-outbound-cidrs",
            "10.0.0.0/33",
            "10.0.0.0/8",
        ),
        (
            "lameduck.io/shutdown-grace-perod",
            "90s",
            "unknown annotation",
        ),
    ];
    for (annotation, value, reason) in cases {
        let input = format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: broken, namespace: team}}\nspec:\n  selector: {{matchLabels: {{app: x}}}}\n  template:\n    metadata:\n      annotations:\n        {annotation}: \"{value}\"\n    spec:\n      containers: [{{name: app, image: app:1}}]\n"
        );
        let (code, out, err) = inject(&input, &[]);
        assert_eq!(code, 2, "{annotation}={value}: {err}");
        assert!(out.is_empty(), "nothing is written on error");
        assert!(err.contains("Deployment team/broken"), "{err}");
        assert!(err.contains(annotation), "{err}");
        assert!(err.contains(reason), "{annotation}={value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let (code, _, err) = inject("kind: Deployment\nspec: [not, a, map\n", &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid YAML"), "{err}");
    let (code, _, err) = inject("", &["--native-sidecar=perhaps"]);
    assert_eq!(code, 2, "{err}");
}

/// Issue: strings such as `"yes"`, `"1:30"` or `"2001-12-14"` lost their quotes, and kubectl
/// then read a boolean, a number or a timestamp (and refused the file). Every string of the
/// input, in annotations, labels, command, args, env values and a ConfigMap's data, comes back
/// as the same string from our YAML 1.2 library and from every kubectl on the machine (YAML
/// 1.1); numbers and booleans stay numbers and booleans.
#[test]
fn strings_come_back_as_the_same_strings_in_yaml_1_1_and_1_2() {
    use serde::Deserialize;
    let input = dir().join("strings.yaml");
    let (out, _) = golden(&input, &[], &dir().join("strings.out.yaml"));
    let read = |yaml: &str| -> Vec<serde_json::Value> {
        serde_norway::Deserializer::from_str(yaml)
            .map(|document| {
                serde_json::to_value(serde_norway::Value::deserialize(document).unwrap()).unwrap()
            })
            .collect()
    };
    let written = read(&out);
    let original = read(&std::fs::read_to_string(&input).unwrap());
    assert_eq!(written.len(), original.len());
    let ours = Path::new("serde_norway");
    for (written, original) in written.iter().zip(&original) {
        assert_contains(written, original, ours, "", false);
    }
    let template = &original[0]["spec"]["template"];
    assert_eq!(template["metadata"]["annotations"]["example.com/a0"], "yes");
    assert_eq!(original[0]["spec"]["replicas"], 2);
    assert_eq!(template["spec"]["containers"][0]["tty"], true);
    assert_eq!(
        original[1]["data"]["yes"],
        "a key that YAML 1.1 reads as a boolean"
    );
    check_with_kubectl(&out, &kubectl::clients());
    // Plain where no reader can take them for anything else, so the output stays readable.
    for plain in [
        "60s",
        "nginx:1.27",
        "--port=8080",
        "0 3 * * *",
        "a yes b",
        "yes-please",
    ] {
        assert!(
            out.contains(&format!(": {plain}\n")),
            "{plain} quoted:\n{out}"
        );
    }
}

#[test]
fn examples_are_kept_in_sync_with_their_injected_forms() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/examples");
    for (name, args) in [
        ("deployment", &[][..]),
        ("job", &[][..]),
        ("cronjob", &[][..]),
        ("job", &["--native-sidecar=false"][..]),
    ] {
        let suffix = if args.is_empty() {
            "injected"
        } else {
            "legacy.injected"
        };
        golden(
            &examples.join(format!("{name}.yaml")),
            args,
            &examples.join(format!("{name}.{suffix}.yaml")),
        );
    }
}

#[test]
fn the_image_matches_what_inject_expects() {
    let dockerfile =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/Dockerfile"))
            .unwrap();
    assert!(
        dockerfile.contains("cargo build --release --locked --bin lameduck --target")
            && dockerfile.contains("COPY .cargo ./.cargo"),
        "the image builds the tested release binary, static as the tests' (.cargo/config.toml)"
    );
    assert!(
        dockerfile.contains("FROM gcr.io/distroless/static"),
        "a static binary needs no libc in the image"
    );
    assert!(
        dockerfile.contains("ENTRYPOINT [\"/usr/local/bin/lameduck\"]"),
        "legacy injection runs /usr/local/bin/lameduck copy-binary"
    );
    assert!(dockerfile.contains("STOPSIGNAL SIGTERM"));
    assert!(
        dockerfile.contains("USER 2110:2110"),
        "inject sets runAsUser 2110, the uid the NAT rules exempt"
    );
    let (init, proxy) = dockerfile
        .split_once("FROM gcr.io/distroless")
        .expect("the proxy's stage comes last, the default target");
    assert!(
        init.contains(" AS init") && init.contains("install -y --no-install-recommends iptables"),
        "the init target has iptables for `lameduck iptables`"
    );
    assert!(!proxy.contains(" AS "), "the proxy's stage is the last one");
    assert!(dockerfile.contains("EXPOSE 4143 4140 4191"));
    for line in dockerfile
        .lines()
        .filter(|line| line.starts_with("COPY ") && !line.contains("--from"))
    {
        for path in line
            .split_whitespace()
            .skip(1)
            .take_while(|part| !part.ends_with('/'))
        {
            assert!(
                Path::new(env!("CARGO_MANIFEST_DIR")).join(path).exists(),
                "the Dockerfile copies missing {path}"
            );
        }
    }
}

#[test]
fn copy_binary_hands_over_a_working_executable() {
    let dir = std::env::temp_dir().join(format!("lameduck-copy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let target = dir.join("lameduck");
    let status = Command::new(BIN)
        .arg("copy-binary")
        .arg(&target)
        .status()
        .unwrap();
    assert!(status.success());
    let help = Command::new(&target)
        .arg("await")
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).contains("--shutdown"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The lame duck is adaptive unless the workload fixes a period; its bounds come from the
/// annotations; a fixed period with adaptive bounds, or a minimum above the maximum, is refused.
#[test]
fn lame_duck_annotations_choose_fixed_or_adaptive() {
    let pod = |annotations: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  annotations: {{{annotations}}}\n\
             spec:\n  containers:\n  - name: app\n    image: app:1\n"
        )
    };
    let (code, out, err) = inject(
        &pod(
            "lameduck.io/lame-duck-max: 20s, lameduck.io/lame-duck-quiet-window: 3s, lameduck.io/lame-duck-min: 4s, lameduck.io/shutdown-grace-period: 60s",
        ),
        &[],
    );
    assert_eq!(code, 0, "{err}");
    for (name, value) in [
        ("LAMEDUCK_LAME_DUCK_MAX", "20s"),
        ("LAMEDUCK_LAME_DUCK_QUIET_WINDOW", "3s"),
        ("LAMEDUCK_LAME_DUCK_MIN", "4s"),
    ] {
        assert_eq!(proxy_env(&out, name).as_deref(), Some(value), "{name}");
    }
    assert_eq!(proxy_env(&out, "LAMEDUCK_LAME_DUCK_PERIOD"), None);
    let (code, out, err) = inject(&pod("lameduck.io/lame-duck-period: 5s"), &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        proxy_env(&out, "LAMEDUCK_LAME_DUCK_PERIOD").as_deref(),
        Some("5s")
    );
    assert_eq!(proxy_env(&out, "LAMEDUCK_LAME_DUCK_MAX"), None);
    assert!(!out.contains("LAMEDUCK_LAME_DUCK_IGNORE_SOURCES"), "{out}");
    for (annotations, named) in [
        (
            "lameduck.io/lame-duck-period: 5s, lameduck.io/lame-duck-max: 10s",
            "lameduck.io/lame-duck-max",
        ),
        (
            "lameduck.io/lame-duck-max: 10s, lameduck.io/lame-duck-min: 11s",
            "lameduck.io/lame-duck-min",
        ),
        (
            "lameduck.io/lame-duck-quiet-window: 0s",
            "lameduck.io/lame-duck-quiet-window",
        ),
        ("lameduck.io/lame-duck-max: 1h", "lameduck.io/lame-duck-max"),
    ] {
        let (code, out, err) = inject(&pod(annotations), &[]);
        assert_eq!(code, 2, "{annotations}: {out}");
        assert!(err.contains(named), "{annotations}: {err}");
    }
}

/// The app containers' network probes go to the proxy's admin port, which never counts as
/// traffic for the lame duck (the kubelet's probes come from the bridge's address on most
/// network plugins); the proxy gets the originals, ports resolved, and accepts them as they
/// are written; what cannot be rewritten, and what the annotation keeps, stays as it was.
#[test]
fn network_probes_are_pointed_at_the_admin_port_and_kept_for_the_proxy() {
    let (out, err) = golden(
        &dir().join("probes.yaml"),
        &[],
        &dir().join("probes.out.yaml"),
    );
    let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&out)
        .map(|doc| {
            use serde::Deserialize;
            serde_json::to_value(serde_norway::Value::deserialize(doc).unwrap()).unwrap()
        })
        .collect();
    let spec = &docs[0]["spec"]["template"]["spec"];
    let web = &spec["containers"][0];
    for (field, kind, kept) in [
        ("readinessProbe", "readyz", "periodSeconds"),
        ("livenessProbe", "livez", "initialDelaySeconds"),
        ("startupProbe", "startupz", "failureThreshold"),
    ] {
        let probe = &web[field];
        assert_eq!(
            probe["httpGet"],
            serde_json::json!({"path": format!("/app-health/web/{kind}"), "port": 4191, "scheme": "HTTP"}),
            "{field}"
        );
        assert!(probe[kept].is_u64(), "{field} keeps {kept}: {probe}");
        assert!(probe.get("tcpSocket").is_none() && probe.get("grpc").is_none());
    }
    let admin = &spec["containers"][1];
    assert_eq!(admin["readinessProbe"]["httpGet"]["port"], 4191);
    assert_eq!(admin["livenessProbe"]["exec"]["command"][0], "cat");
    assert_eq!(admin["startupProbe"]["httpGet"]["port"], "metrics");
    assert!(
        err.contains("the startupProbe of container admin is kept as it is")
            && err.contains("no port named \"metrics\""),
        "{err}"
    );
    let proxy = &spec["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "lameduck-proxy")
        .unwrap()["env"];
    let env = |name: &str| {
        proxy
            .as_array()
            .unwrap()
            .iter()
            .find(|var| var["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {proxy}"))
    };
    let originals: serde_json::Value =
        serde_json::from_str(env("LAMEDUCK_APP_PROBES")["value"].as_str().unwrap()).unwrap();
    assert_eq!(
        originals,
        serde_json::json!({
            "/app-health/web/readyz": {"httpGet": {"path": "/healthz", "port": 8080,
                "httpHeaders": [{"name": "X-Probe", "value": "ready"}]}, "timeoutSeconds": 2},
            "/app-health/web/livez": {"tcpSocket": {"port": 8080}},
            "/app-health/web/startupz": {"grpc": {"port": 9090, "service": "shop"}},
            "/app-health/admin/readyz": {"httpGet": {"path": "/ready?full=1", "port": 8443,
                "scheme": "HTTPS"}},
        })
    );
    assert_eq!(
        env("LAMEDUCK_POD_IP")["valueFrom"]["fieldRef"]["fieldPath"],
        "status.podIP"
    );
    // The proxy takes the setting as inject wrote it, and answers the kubelet on each path.
    let value = env("LAMEDUCK_APP_PROBES")["value"]
        .as_str()
        .unwrap()
        .to_string();
    let mut command = support::command();
    command.env("LAMEDUCK_APP_PROBES", &value);
    // The pod's address: TEST-NET-1, where no app answers on this machine.
    let proxy = support::Proxy::start_command(
        &mut command,
        &[
            "--inbound",
            "127.0.0.1:0=127.0.0.1:9",
            "--pod-ip",
            "192.0.2.1",
        ],
    );
    assert_eq!(
        proxy
            .logs
            .wait_event("running the app's probes for the kubelet on /app-health/")["fields"]["probes"],
        4
    );
    // No app answers there: every probe fails (within its timeout), none is unknown.
    std::thread::scope(|scope| {
        for path in originals.as_object().unwrap().keys() {
            let proxy = &proxy;
            scope.spawn(move || assert_eq!(proxy.get(path).status, 503, "{path}"));
        }
    });
    assert_eq!(proxy.get("/app-health/web/other").status, 404);
    // Opted out: the probe stays, and the proxy gets none.
    let legacy = &docs[1]["spec"]["template"]["spec"];
    assert_eq!(
        legacy["containers"][0]["readinessProbe"]["httpGet"]["port"],
        8080
    );
    assert!(!docs[1].to_string().contains("LAMEDUCK_APP_PROBES"));
}

/// A Deployment and its Service in one stream: the proxy hands the pod's late connections to
/// the Service (docs/pod-lifecycle.md, "Hand-off"), each pod port that a TCP port of a Service
/// selecting the pod names (a named `targetPort` through the container's ports), in the
/// namespace the manifests name; the proxy takes the value as inject wrote it. A Service of
/// another namespace or selector, or without selector, hands nothing off; the annotation turns
/// it off, or names the Services itself; a fixed lame duck cannot hand off, and says so.
#[test]
fn services_in_the_stream_give_the_pod_its_handoff() {
    let deployment = |name: &str, annotations: &str| {
        format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  selector: {{matchLabels: {{app: web}}}}\n  template:\n    metadata:\n      labels: {{app: web, tier: front}}\n      annotations: {{{annotations}}}\n    spec:\n      containers:\n      - name: web\n        image: web:1\n        ports: [{{name: http, containerPort: 8080}}, {{containerPort: 9090}}]\n"
        )
    };
    let services = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  selector: {app: web}\n  ports:\n  - {name: http, port: 80, targetPort: http}\n  - {name: grpc, port: 9090}\n  - {name: dns, port: 53, targetPort: 8053, protocol: UDP}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: staging}\nspec: {selector: {app: web}, ports: [{port: 81, targetPort: 8081}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: shop}\nspec: {selector: {app: api}, ports: [{port: 82, targetPort: 8082}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: manual, namespace: shop}\nspec: {ports: [{port: 83, targetPort: 8083}]}\n";
    let input = [
        deployment("web", ""),
        deployment("quiet", "lameduck.io/handoff: disabled"),
        deployment("named", "lameduck.io/handoff: \"8080=front.shop.svc:80\""),
        deployment("fixed", "lameduck.io/lame-duck-period: 5s"),
        services.to_string(),
    ]
    .join("---\n");
    let (code, out, err) = support::inject(&input, &[]);
    assert_eq!(code, 0, "{err}");
    let docs: Vec<&str> = out.split("\n---\n").collect();
    let handoff = proxy_env(docs[0], "LAMEDUCK_HANDOFF");
    assert_eq!(
        handoff.as_deref(),
        Some("8080=web.shop.svc:80,9090=web.shop.svc:9090")
    );
    // With a hand-off the lame duck need not wait for the slowest load balancer: 10 s at
    // most by default (four fifths of the grace period otherwise).
    assert_eq!(
        proxy_env(docs[0], "LAMEDUCK_LAME_DUCK_MAX").as_deref(),
        Some("10s")
    );
    assert_eq!(proxy_env(docs[1], "LAMEDUCK_HANDOFF"), None);
    assert_eq!(
        proxy_env(docs[1], "LAMEDUCK_LAME_DUCK_MAX").as_deref(),
        Some("20s")
    );
    assert_eq!(
        proxy_env(docs[2], "LAMEDUCK_HANDOFF").as_deref(),
        Some("8080=front.shop.svc:80")
    );
    assert_eq!(proxy_env(docs[3], "LAMEDUCK_HANDOFF"), None);
    assert!(
        err.contains("Deployment shop/fixed: no hand-off")
            && err.contains("a fixed lame duck closes the listeners"),
        "{err}"
    );
    check_with_kubectl(&out, &kubectl::clients()[..1]);

    // The proxy takes it as written.
    let mut command = support::command();
    command.env("LAMEDUCK_HANDOFF", handoff.unwrap());
    let mut proxy =
        support::Proxy::start_command(&mut command, &["--inbound", "127.0.0.1:0=127.0.0.1:9"]);
    proxy.signal(libc::SIGTERM);
    assert_eq!(proxy.wait_exit(support::PATIENCE).code(), Some(0));

    // A bad value is refused, naming the object, the annotation and the value.
    let (code, _, err) =
        support::inject(&deployment("bad", "lameduck.io/handoff: \"8080=web\""), &[]);
    assert_eq!(code, 2);
    assert!(
        err.contains("Deployment shop/bad")
            && err.contains("lameduck.io/handoff")
            && err.contains("\"8080=web\""),
        "{err}"
    );
}

/// A workload under an API version Kubernetes no longer serves (a `batch/v1beta1` CronJob,
/// removed in 1.25) is passed through as it is, with a note saying why it has no proxy; a kind
/// of the same name in another API group is someone else's, and passes without one.
#[test]
fn a_workload_of_a_removed_api_version_is_left_with_a_note() {
    let input = "apiVersion: batch/v1beta1\nkind: CronJob\nmetadata: {name: nightly}\nspec:\n  schedule: \"0 1 * * *\"\n  jobTemplate:\n    spec:\n      template:\n        spec:\n          containers: [{name: job, image: job:1}]\n          restartPolicy: Never\n---\napiVersion: extensions/v1beta1\nkind: Deployment\nmetadata: {name: old, namespace: shop}\nspec:\n  template:\n    spec:\n      containers: [{name: web, image: web:1}]\n---\napiVersion: example.com/v1\nkind: Job\nmetadata: {name: custom}\nspec: {}\n";
    let (code, out, err) = support::inject(input, &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, input, "passed through byte for byte");
    assert!(
        err.contains("CronJob default/nightly: not injected: batch/v1beta1 CronJob is no longer served by Kubernetes (batch/v1 since Kubernetes 1.25)"),
        "{err}"
    );
    assert!(
        err.contains("Deployment shop/old: not injected: extensions/v1beta1 Deployment is no longer served by Kubernetes (apps/v1 since Kubernetes 1.16)"),
        "{err}"
    );
    assert!(!err.contains("custom"), "{err}");
}

/// A flow collection closed on a line of its own, no deeper than its key (Elastic's filebeat
/// DaemonSet writes `args: [` ... `]` so): kubectl reads it, and so does inject, every document
/// of the stream, the bytes of those it leaves alone unchanged.
#[test]
fn flow_collections_closed_at_their_keys_indentation_read_as_kubectl_reads_them() {
    let input = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\ndata: {\n  level: debug\n}\n---\napiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: shipper}\nspec:\n  selector: {matchLabels: {app: shipper}}\n  template:\n    metadata: {labels: {app: shipper}}\n    spec:\n      containers:\n      - name: shipper\n        image: shipper:1\n        args: [\n          \"-c\", \"/etc/shipper.yml\",\n          \"-e\",\n        ]\n        resources: {\n          limits: {memory: 200Mi}\n        }\n";
    let (code, out, err) = support::inject(input, &[]);
    assert_eq!(code, 0, "{err}");
    let first = input.split("---\n").next().unwrap();
    assert!(
        out.starts_with(first),
        "the ConfigMap came out changed:\n{out}"
    );
    let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&out)
        .map(|doc| {
            use serde::Deserialize;
            serde_json::to_value(serde_norway::Value::deserialize(doc).unwrap()).unwrap()
        })
        .collect();
    let shipper = &docs[1]["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        shipper["args"],
        serde_json::json!(["-c", "/etc/shipper.yml", "-e"])
    );
    assert_eq!(shipper["resources"]["limits"]["memory"], "200Mi");
    assert!(out.contains("name: lameduck-proxy"), "{out}");
    check_with_kubectl(&out, &kubectl::clients()[..1]);
    // And kubectl reads the input the same way.
    if let Some(kubectl) = kubectl::newest() {
        let (typed, _) = kubectl::read(
            &kubectl,
            input,
            &["set", "resources", "--local", "--limits=cpu=1"],
        )
        .unwrap();
        let theirs = &typed[0]["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(theirs["args"], shipper["args"]);
    }
}
