//! `lameduck webhook` on the real binary, over real TLS: reviews shaped like the API server's
//! get the patch that makes each pod what `lameduck inject` writes for it (the patch is applied
//! and compared), everything else is allowed unchanged, and a rotated certificate is served
//! without a restart.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use rustls::client::danger::ServerCertVerifier as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use support::{BIN, PATIENCE};

const SERVICE_NAME: &str = "lameduck-webhook.lameduck.svc";

/// A CA, and a serving certificate for the webhook's Service signed by it.
struct Certs {
    ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
}

impl Certs {
    fn new() -> Certs {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test CA");
        let ca = params.self_signed(&ca_key).unwrap();
        Certs { ca, ca_key }
    }

    /// A serving certificate and its key, PEM, with `serial` to tell two apart.
    fn serving(&self, serial: u64) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec![SERVICE_NAME.to_string()]).unwrap();
        params.serial_number = Some(serial.into());
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

struct Webhook {
    child: Child,
    reviews: SocketAddr,
    admin: SocketAddr,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, extra: &[&str]) -> Webhook {
    let mut child = Command::new(BIN)
        .args([
            "webhook",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ])
        .arg("--tls-cert")
        .arg(dir.join("tls.crt"))
        .arg("--tls-key")
        .arg(dir.join("tls.key"))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|line| line.contains("webhook serving"))
        .expect("the webhook says where it serves");
    std::thread::spawn(move || lines.for_each(drop));
    let field = |name: &str| -> SocketAddr {
        let start = line.find(&format!("{name}=")).unwrap() + name.len() + 1;
        line[start..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    Webhook {
        reviews: field("listen"),
        admin: field("admin"),
        child,
    }
}

/// A TLS client that trusts `ca` and names the Service (SNI).
fn client_config(ca: &rcgen::Certificate) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    // Full handshakes only: a resumed session shows the certificate of the session it resumes.
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// POSTs `body` to `path` over TLS; the status, the body, and the certificate served.
fn post(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, Vec<u8>, CertificateDer<'static>)> {
    let name = ServerName::try_from(SERVICE_NAME).unwrap();
    let mut tls = rustls::ClientConnection::new(config.clone(), name).unwrap();
    let mut tcp = TcpStream::connect(addr)?;
    tcp.set_read_timeout(Some(PATIENCE))?;
    let mut stream = rustls::Stream::new(&mut tls, &mut tcp);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {SERVICE_NAME}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    let mut raw = Vec::new();
    match stream.read_to_end(&mut raw) {
        Ok(_) => {}
        // The server closes without close_notify after `Connection: close`; the bytes are in.
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(error) => return Err(error),
    }
    let served = tls.peer_certificates().unwrap()[0].clone().into_owned();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    Ok((status, raw[split + 4..].to_vec(), served))
}

/// A review of `operation` on `object` (kind from the object), as the API server sends it.
fn review(uid: &str, operation: &str, object: &Value, namespace: &str) -> Vec<u8> {
    let kind = object["kind"].as_str().unwrap_or("Pod");
    let group = if kind == "Pod" || kind == "ConfigMap" {
        ""
    } else {
        "apps"
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": "v1", "kind": kind},
            "resource": {"group": group, "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": object,
            "dryRun": false,
        }
    })
    .to_string()
    .into_bytes()
}

/// `lameduck inject`'s output for one pod, as JSON.
fn inject(pod: &Value) -> Value {
    use serde::Deserialize;
    let (code, yaml, err) = support::inject(&serde_json::to_string(pod).unwrap(), &[]);
    assert_eq!(code, 0, "{err}");
    let value =
        serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(&yaml)).unwrap();
    serde_json::to_value(value).unwrap()
}

fn pod(name: &str, annotations: Value, owner: Option<&str>) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": format!("{name}-"),
            "labels": {"app": name},
            "annotations": annotations,
        },
        "spec": {
            "containers": [{
                "name": "app",
                "image": "registry.example/app:1",
                "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
                "resources": {},
            }],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
        }
    });
    if let Some(kind) = owner {
        pod["metadata"]["ownerReferences"] = json!([{
            "apiVersion": if kind == "Job" { "batch/v1" } else { "apps/v1" },
            "kind": kind,
            "name": name,
            "uid": "0f0e0d0c-0000-4000-8000-000000000001",
            "controller": true,
        }]);
        if kind == "Job" {
            pod["spec"]["restartPolicy"] = "Never".into();
        }
    }
    pod
}

fn setup() -> (tempdir::Dir, Certs) {
    let dir = tempdir::Dir::new("webhook");
    let certs = Certs::new();
    let (cert, key) = certs.serving(1);
    std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
    std::fs::write(dir.path().join("tls.key"), key).unwrap();
    (dir, certs)
}

/// A folder of the test's own, removed on drop.
mod tempdir {
    pub struct Dir(std::path::PathBuf);

    impl Dir {
        pub fn new(tag: &str) -> Dir {
            let path = std::env::temp_dir().join(format!(
                "lameduck-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }

        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn pods_get_exactly_what_inject_writes_and_everything_else_is_allowed_unchanged() {
    let (dir, certs) = setup();
    let webhook = start(dir.path(), &[]);
    let config = client_config(&certs.ca);

    let deployment_pod = pod("web", json!({}), Some("ReplicaSet"));
    let job_pod = pod("batch", json!({}), Some("Job"));
    let bare_pod = pod(
        "debug",
        json!({"lameduck.io/shutdown-grace-period": "20s"}),
        None,
    );
    for (name, object) in [
        ("a Deployment's pod", &deployment_pod),
        ("a Job's pod", &job_pod),
        ("a bare pod", &bare_pod),
    ] {
        let uid = format!("uid-{}", name.len());
        let (status, body, _) = post(
            webhook.reviews,
            &config,
            "/mutate",
            &review(&uid, "CREATE", object, "shop"),
        )
        .unwrap();
        assert_eq!(status, 200, "{name}");
        let answer: Value = serde_json::from_slice(&body).unwrap();
        let response = &answer["response"];
        assert_eq!(answer["kind"], "AdmissionReview", "{name}");
        assert_eq!(
            response["uid"],
            uid.as_str(),
            "{name}: the request's uid, echoed"
        );
        assert_eq!(response["allowed"], true, "{name}");
        assert_eq!(response["patchType"], "JSONPatch", "{name}");
        let patch = base64::engine::general_purpose::STANDARD
            .decode(response["patch"].as_str().unwrap())
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
        let mut patched = object.clone();
        json_patch::patch(&mut patched, &patch).unwrap();
        assert_eq!(
            patched,
            inject(object),
            "{name}: the patch applied is inject's output"
        );
    }
    // The app's probe goes to the proxy's admin port, as inject does it.
    assert_eq!(
        inject(&deployment_pod)["spec"]["containers"][0]["readinessProbe"]["httpGet"],
        json!({"path": "/app-health/app/readyz", "port": 4191, "scheme": "HTTP"})
    );
    // A Job's pod completes at once: no lame duck (the pod says whose it is).
    let injected = inject(&job_pod);
    let proxy = &injected["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "lameduck-proxy")
        .unwrap()["env"];
    assert!(
        !proxy.to_string().contains("LAMEDUCK_LAME_DUCK_PERIOD"),
        "{proxy}"
    );

    // Allowed, no patch: injected already, opted out, not a pod, not a creation, a system
    // namespace.
    let opted_out = pod("legacy", json!({"lameduck.io/inject": "disabled"}), None);
    let configmap = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
    for (name, body) in [
        (
            "injected already",
            review("u1", "CREATE", &inject(&deployment_pod), "shop"),
        ),
        ("opted out", review("u2", "CREATE", &opted_out, "shop")),
        ("not a pod", review("u3", "CREATE", &configmap, "shop")),
        ("an update", review("u4", "UPDATE", &deployment_pod, "shop")),
        (
            "a system namespace",
            review("u5", "CREATE", &deployment_pod, "kube-system"),
        ),
    ] {
        let (status, body, _) = post(webhook.reviews, &config, "/mutate", &body).unwrap();
        assert_eq!(status, 200, "{name}");
        let response = &serde_json::from_slice::<Value>(&body).unwrap()["response"];
        assert_eq!(response["allowed"], true, "{name}: {response}");
        assert!(response.get("patch").is_none(), "{name}: {response}");
    }

    // An invalid annotation: allowed unmeshed, with a warning that says why.
    let typo = pod(
        "typo",
        json!({"lameduck.io/shutdown-grace-period": "10"}),
        None,
    );
    let (_, body, _) = post(
        webhook.reviews,
        &config,
        "/mutate",
        &review("u6", "CREATE", &typo, "shop"),
    )
    .unwrap();
    let response = &serde_json::from_slice::<Value>(&body).unwrap()["response"];
    assert_eq!(response["allowed"], true, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    assert!(
        response["warnings"][0]
            .as_str()
            .unwrap()
            .contains("needs a unit"),
        "{response}"
    );

    // Not reviews: 400, and the webhook goes on.
    for garbage in [
        &b"{"[..],
        b"[]",
        b"{\"kind\": \"AdmissionReview\"}",
        &[0xff; 64],
    ] {
        let (status, _, _) = post(webhook.reviews, &config, "/mutate", garbage).unwrap();
        assert_eq!(status, 400, "{garbage:?}");
    }
    let metrics = support::http(webhook.admin, "GET", "/metrics", &[]).body;
    for sample in [
        "lameduck_webhook_reviews_total{outcome=\"injected\"} 3",
        "lameduck_webhook_reviews_total{outcome=\"skipped\"} 5",
        "lameduck_webhook_reviews_total{outcome=\"invalid\"} 1",
        "lameduck_webhook_bad_requests_total 4",
    ] {
        assert!(metrics.contains(sample), "{sample} in:\n{metrics}");
    }
    assert_eq!(
        support::http(webhook.admin, "GET", "/ready", &[]).status,
        200
    );
}

/// What inject leaves alone, the webhook leaves alone too, and says why: a pod on its node's
/// network, a pod another mesh has meshed. Allowed, no patch, a warning for whoever created it.
#[test]
fn host_network_and_other_mesh_pods_are_allowed_unchanged_with_a_warning() {
    let (dir, certs) = setup();
    let webhook = start(dir.path(), &[]);
    let config = client_config(&certs.ca);
    let mut node_agent = pod("agent", json!({}), Some("DaemonSet"));
    node_agent["spec"]["hostNetwork"] = true.into();
    let mut linkerd = pod("meshed", json!({"linkerd.io/inject": "enabled"}), None);
    linkerd["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "linkerd-proxy", "image": "cr.l5d.io/linkerd/proxy:stable"}));
    for (name, object, why) in [
        ("hostNetwork", &node_agent, "hostNetwork"),
        (
            "Linkerd",
            &linkerd,
            "meshed by Linkerd (container linkerd-proxy)",
        ),
    ] {
        let (status, body, _) = post(
            webhook.reviews,
            &config,
            "/mutate",
            &review("uid-left-alone", "CREATE", object, "shop"),
        )
        .unwrap();
        assert_eq!(status, 200, "{name}");
        let response = &serde_json::from_slice::<Value>(&body).unwrap()["response"];
        assert_eq!(response["allowed"], true, "{name}: {response}");
        assert!(response.get("patch").is_none(), "{name}: {response}");
        let warning = response["warnings"][0].as_str().unwrap_or_default();
        assert!(
            warning.contains("not injected") && warning.contains(why),
            "{name}: {response}"
        );
    }
}

#[test]
fn invalid_annotations_deny_the_pod_when_asked_to() {
    let (dir, certs) = setup();
    let webhook = start(dir.path(), &["--deny-invalid"]);
    let config = client_config(&certs.ca);
    let typo = pod("typo", json!({"lameduck.io/intercept": "perhaps"}), None);
    let (_, body, _) = post(
        webhook.reviews,
        &config,
        "/mutate",
        &review("u7", "CREATE", &typo, "shop"),
    )
    .unwrap();
    let response = &serde_json::from_slice::<Value>(&body).unwrap()["response"];
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(response["status"]["code"], 400, "{response}");
    assert!(
        response["status"]["message"]
            .as_str()
            .unwrap()
            .contains("lameduck.io/intercept"),
        "{response}"
    );
}

#[test]
fn only_clients_that_trust_its_ca_talk_to_it_and_a_rotated_certificate_is_served_at_once() {
    let (dir, certs) = setup();
    let webhook = start(dir.path(), &[]);
    let config = client_config(&certs.ca);
    let body = review("u8", "CREATE", &pod("web", json!({}), None), "shop");
    let (status, _, first) = post(webhook.reviews, &config, "/mutate", &body).unwrap();
    assert_eq!(status, 200);

    // A client that trusts another CA does not get through.
    let stranger = client_config(&Certs::new().ca);
    assert!(post(webhook.reviews, &stranger, "/mutate", &body).is_err());

    // The files are replaced (a renewed Secret): the next handshakes show the new certificate.
    let (cert, key) = certs.serving(2);
    std::fs::write(dir.path().join("tls.key"), key).unwrap();
    std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
    support::wait_until("the new certificate is served", PATIENCE, || {
        std::thread::sleep(Duration::from_millis(200));
        let (_, _, served) = post(webhook.reviews, &config, "/mutate", &body).unwrap();
        served != first
    });
    let (status, _, _) = post(webhook.reviews, &config, "/mutate", &body).unwrap();
    assert_eq!(status, 200);
}

/// `lameduck webhook manifests ARGS`, split into documents (as JSON values).
fn manifests(args: &[&str]) -> (String, Vec<Value>) {
    use serde::Deserialize;
    let out = Command::new(BIN)
        .args(["webhook", "manifests"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8(out.stdout).unwrap();
    let documents = serde_norway::Deserializer::from_str(&yaml)
        .map(|document| {
            serde_json::to_value(serde_norway::Value::deserialize(document).unwrap()).unwrap()
        })
        .collect();
    (yaml, documents)
}

fn of_kind<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents
        .iter()
        .find(|document| document["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// Whether a Kubernetes label selector (`matchLabels`, `matchExpressions`) selects `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let label = |key: &str| labels[key].as_str();
    let by_labels = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(key, value)| label(key) == value.as_str());
    let by_expressions = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|expression| {
            let value = label(expression["key"].as_str().unwrap());
            let values: Vec<&str> = expression["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            match expression["operator"].as_str().unwrap() {
                "In" => value.is_some_and(|v| values.contains(&v)),
                "NotIn" => value.is_none_or(|v| !values.contains(&v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                other => panic!("operator {other}"),
            }
        });
    by_labels && by_expressions
}

#[test]
fn the_manifests_decode_as_kubernetes_objects_and_select_only_what_they_should() {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{Namespace, Secret, Service, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let (yaml, documents) = manifests(&[]);
    // Decoded into the Kubernetes types (a field of the wrong type fails).
    for document in &documents {
        let decoded = match document["kind"].as_str().unwrap() {
            "Namespace" => serde_json::from_value::<Namespace>(document.clone()).map(drop),
            "ServiceAccount" => {
                serde_json::from_value::<ServiceAccount>(document.clone()).map(drop)
            }
            "Secret" => serde_json::from_value::<Secret>(document.clone()).map(drop),
            "Deployment" => serde_json::from_value::<Deployment>(document.clone()).map(drop),
            "Service" => serde_json::from_value::<Service>(document.clone()).map(drop),
            "MutatingWebhookConfiguration" => {
                serde_json::from_value::<MutatingWebhookConfiguration>(document.clone()).map(drop)
            }
            "ClusterRole" => serde_json::from_value::<ClusterRole>(document.clone()).map(drop),
            "ClusterRoleBinding" => {
                serde_json::from_value::<ClusterRoleBinding>(document.clone()).map(drop)
            }
            other => panic!("unexpected {other}"),
        };
        decoded.unwrap_or_else(|error| panic!("{}: {error}", document["kind"]));
    }
    assert_eq!(documents.len(), 8);
    // The webhook's ServiceAccount may list Services (the hand-off of the pods it injects),
    // nothing more; its token is mounted for it.
    assert_eq!(
        of_kind(&documents, "ClusterRole")["rules"],
        json!([{"apiGroups": [""], "resources": ["services"], "verbs": ["list"]}])
    );
    assert_eq!(
        of_kind(&documents, "ClusterRoleBinding")["subjects"],
        json!([{"kind": "ServiceAccount", "name": "lameduck-webhook", "namespace": "lameduck"}])
    );
    assert!(
        of_kind(&documents, "Deployment")["spec"]["template"]["spec"]
            ["automountServiceAccountToken"]
            .is_null()
    );
    // And by kubectl, offline, as `kubectl apply` decodes them (YAML 1.1 rules).
    kubectl_decodes(&yaml, documents.len());

    // The caBundle verifies the serving certificate, for the Service's DNS names.
    let b64 = |value: &Value| {
        base64::engine::general_purpose::STANDARD
            .decode(value.as_str().unwrap())
            .unwrap()
    };
    let config = of_kind(&documents, "MutatingWebhookConfiguration");
    let hooks = config["webhooks"].as_array().unwrap();
    let ca_pem = b64(&hooks[0]["clientConfig"]["caBundle"]);
    let secret = of_kind(&documents, "Secret");
    let cert_pem = b64(&secret["data"]["tls.crt"]);
    let ca = CertificateDer::pem_slice_iter(&ca_pem)
        .next()
        .unwrap()
        .unwrap();
    let cert = CertificateDer::pem_slice_iter(&cert_pem)
        .next()
        .unwrap()
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    let now = rustls::pki_types::UnixTime::now();
    for name in [SERVICE_NAME, "lameduck-webhook.lameduck.svc.cluster.local"] {
        let name = ServerName::try_from(name).unwrap();
        verifier
            .verify_server_cert(&cert, &[], &name, &[], now)
            .unwrap_or_else(|error| panic!("{name:?}: {error}"));
    }
    let other = ServerName::try_from("elsewhere.lameduck.svc").unwrap();
    assert!(
        verifier
            .verify_server_cert(&cert, &[], &other, &[], now)
            .is_err()
    );
    for hook in hooks {
        assert_eq!(hook["failurePolicy"], "Ignore");
        assert_eq!(hook["sideEffects"], "None");
        assert!(hook["timeoutSeconds"].as_u64().unwrap() <= 10);
        assert_eq!(hook["clientConfig"]["service"]["path"], "/mutate");
    }

    // Who gets injected: pods of labelled namespaces unless they opt out, labelled pods
    // elsewhere; never the system namespaces, never the webhook's own pods, never twice.
    let namespace = |name: &str, enabled: bool| {
        let mut labels = json!({"kubernetes.io/metadata.name": name});
        if enabled {
            labels["lameduck.io/inject"] = "enabled".into();
        }
        labels
    };
    let webhook_pod = &of_kind(&documents, "Deployment")["spec"]["template"]["metadata"]["labels"];
    let pod_labels = |label: Option<&str>| match label {
        Some(value) => json!({"app": "a", "lameduck.io/inject": value}),
        None => json!({"app": "a"}),
    };
    let injected_by = |ns: &Value, pod: &Value| -> usize {
        hooks
            .iter()
            .filter(|hook| {
                selects(&hook["namespaceSelector"], ns) && selects(&hook["objectSelector"], pod)
            })
            .count()
    };
    for (ns, pod, expected, what) in [
        (
            namespace("shop", true),
            pod_labels(None),
            1,
            "a labelled namespace's pod",
        ),
        (
            namespace("shop", true),
            pod_labels(Some("disabled")),
            0,
            "a pod that opts out",
        ),
        (
            namespace("shop", true),
            pod_labels(Some("enabled")),
            1,
            "both labelled: once",
        ),
        (
            namespace("shop", false),
            pod_labels(Some("enabled")),
            1,
            "a labelled pod elsewhere",
        ),
        (
            namespace("shop", false),
            pod_labels(None),
            0,
            "an unlabelled pod elsewhere",
        ),
        (
            namespace("kube-system", true),
            pod_labels(Some("enabled")),
            0,
            "kube-system",
        ),
        (
            namespace("kube-public", true),
            pod_labels(None),
            0,
            "kube-public",
        ),
        (
            namespace("kube-node-lease", true),
            pod_labels(None),
            0,
            "kube-node-lease",
        ),
        (
            namespace("lameduck", true),
            webhook_pod.clone(),
            0,
            "the webhook itself",
        ),
    ] {
        assert_eq!(injected_by(&ns, &pod), expected, "{what}");
    }

    // With cert-manager: an Issuer and a Certificate for the Service's names, and the CA
    // injected by cert-manager instead of a caBundle of ours.
    let (yaml, documents) = manifests(&["--cert-manager", "--namespace", "mesh"]);
    kubectl_decodes(&yaml, documents.len());
    assert!(
        documents
            .iter()
            .all(|document| document["kind"] != "Secret")
    );
    let certificate = of_kind(&documents, "Certificate");
    assert_eq!(
        certificate["spec"]["dnsNames"],
        json!([
            "lameduck-webhook.mesh.svc",
            "lameduck-webhook.mesh.svc.cluster.local"
        ])
    );
    let config = of_kind(&documents, "MutatingWebhookConfiguration");
    assert_eq!(
        config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "mesh/lameduck-webhook"
    );
    assert!(
        config["webhooks"][0]["clientConfig"]
            .get("caBundle")
            .is_none()
    );

    // A namespace YAML would read as something else is quoted; an invalid one is refused.
    let (_, documents) = manifests(&["--namespace", "no"]);
    assert_eq!(of_kind(&documents, "Namespace")["metadata"]["name"], "no");
    let refused = Command::new(BIN)
        .args(["webhook", "manifests", "--namespace", "Not_A_Label"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
}

/// The generated Secret is what the webhook serves with: a client trusting the caBundle and
/// naming the Service gets its reviews answered.
#[test]
fn the_webhook_serves_with_the_certificate_the_manifests_generate() {
    let (_, documents) = manifests(&[]);
    let b64 = |value: &Value| {
        base64::engine::general_purpose::STANDARD
            .decode(value.as_str().unwrap())
            .unwrap()
    };
    let secret = of_kind(&documents, "Secret");
    let dir = tempdir::Dir::new("webhook-manifests");
    std::fs::write(dir.path().join("tls.crt"), b64(&secret["data"]["tls.crt"])).unwrap();
    std::fs::write(dir.path().join("tls.key"), b64(&secret["data"]["tls.key"])).unwrap();
    let ca_pem = b64(
        &of_kind(&documents, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"],
    );
    let webhook = start(dir.path(), &[]);
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&ca_pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.resumption = rustls::client::Resumption::disabled();
    let body = review("u9", "CREATE", &pod("web", json!({}), None), "shop");
    let (status, answer, _) = post(webhook.reviews, &Arc::new(config), "/mutate", &body).unwrap();
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
}

/// `kubectl label --local` decodes every document offline, as `kubectl apply` would.
fn kubectl_decodes(yaml: &str, count: usize) {
    let Some(kubectl) = support::kubectl::clients().into_iter().next() else {
        return support::skip("kubectl decoding of the manifests", "no kubectl on PATH");
    };
    let objects =
        support::kubectl::label(&kubectl, yaml).unwrap_or_else(|stderr| panic!("{stderr}"));
    assert_eq!(objects.len(), count);
}

/// Pods the API server would refuse anyway, shaped every wrong way: each gets an answer (a
/// review's, or a 400), and the webhook goes on serving.
#[test]
fn no_pod_however_malformed_brings_it_down() {
    let (dir, certs) = setup();
    let mut webhook = start(dir.path(), &[]);
    let config = client_config(&certs.ca);
    let weird = [
        json!({"kind": "Pod", "metadata": 5}),
        json!({"kind": "Pod", "metadata": {"annotations": [1, 2]}}),
        json!({"kind": "Pod", "metadata": {"annotations": {"lameduck.io/inject": {"a": 1}}}}),
        json!({"kind": "Pod", "spec": "x"}),
        json!({"kind": "Pod", "spec": {"containers": "x"}}),
        json!({"kind": "Pod", "spec": {"containers": [5, null, []]}}),
        json!({"kind": "Pod", "spec": {"containers": [{"name": 5, "lifecycle": 7}]}}),
        json!({"kind": "Pod", "spec": {"containers": [{"lifecycle": {"preStop": [1]}}]}}),
        json!({"kind": "Pod", "spec": {"initContainers": {}, "volumes": "v"}}),
        json!({"kind": "Pod", "spec": {"terminationGracePeriodSeconds": -5}}),
        json!({"kind": "Pod", "spec": {"containers": [{"ports": [{"containerPort": "x"}]}]}}),
        json!(null),
        serde_json::from_str(&format!("{}{{}}{}", "[".repeat(100), "]".repeat(100))).unwrap(),
    ];
    for (index, object) in weird.iter().enumerate() {
        let body = review(&format!("w{index}"), "CREATE", object, "shop");
        let (status, body, _) = post(webhook.reviews, &config, "/mutate", &body)
            .unwrap_or_else(|error| panic!("{object}: {error}"));
        assert!(status == 200 || status == 400, "{object}: {status}");
        if status == 200 {
            let answer: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(answer["response"]["uid"], format!("w{index}"), "{object}");
        }
    }
    assert!(
        webhook.child.try_wait().unwrap().is_none(),
        "the webhook exited"
    );
    assert_eq!(
        support::http(webhook.admin, "GET", "/live", &[]).status,
        200
    );
}

/// The requests a stand-in API server got: path, authorization.
type Requests = Arc<std::sync::Mutex<Vec<(String, String)>>>;

/// A stand-in for the API server over TLS (a certificate for 127.0.0.1 signed by `certs`' CA):
/// `GET /api/v1/namespaces/shop/services` with the right token answers a ServiceList; anything
/// else 403. Returns its address and the requests it got (path, authorization).
fn api_server(certs: &Certs) -> (SocketAddr, Requests) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let cert = params.signed_by(&key, &certs.ca, &certs.ca_key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
    )
    .unwrap();
    let config = Arc::new(config);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = seen.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming() {
            let Ok(tcp) = tcp else { continue };
            let tls = rustls::ServerConnection::new(config.clone()).unwrap();
            let mut stream = rustls::StreamOwned::new(tls, tcp);
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                match stream.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            let head = String::from_utf8_lossy(&head).to_string();
            let path = head.split(' ').nth(1).unwrap_or_default().to_string();
            let authorization = head
                .lines()
                .find_map(|line| line.strip_prefix("authorization: "))
                .unwrap_or_default()
                .to_string();
            let allowed =
                path == "/api/v1/namespaces/shop/services" && authorization == "Bearer test-token";
            recorded.lock().unwrap().push((path, authorization));
            let (status, body) = match allowed {
                true => ("200 OK", json!({"kind": "ServiceList", "apiVersion": "v1", "items": [
                    {"metadata": {"name": "web", "namespace": "shop"},
                     "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]}},
                    {"metadata": {"name": "api", "namespace": "shop"},
                     "spec": {"selector": {"app": "api"}, "ports": [{"port": 80, "targetPort": 9090, "protocol": "TCP"}]}}
                ]}).to_string()),
                false => ("403 Forbidden", json!({"kind": "Status", "code": 403}).to_string()),
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            stream.conn.send_close_notify();
            let _ = stream.flush();
        }
    });
    (addr, seen)
}

/// The webhook sees one pod at a time: it asks the API (with its own ServiceAccount's token)
/// for the Services of the pod's namespace, and the pod hands its late connections to those
/// that select it, as inject's output does; one list serves a burst of pods. Where the API
/// refuses, the pod is injected without a hand-off.
#[test]
fn pods_hand_off_to_the_services_the_api_lists_for_their_namespace() {
    let (dir, certs) = setup();
    let (api, seen) = api_server(&certs);
    std::fs::write(dir.path().join("token"), "test-token\n").unwrap();
    std::fs::write(dir.path().join("ca.crt"), certs.ca.pem()).unwrap();
    let api_url = format!("https://{api}");
    let token = dir.path().join("token").display().to_string();
    let ca = dir.path().join("ca.crt").display().to_string();
    let webhook = start(
        dir.path(),
        &[
            "--kube-api",
            &api_url,
            "--kube-token",
            &token,
            "--kube-ca",
            &ca,
        ],
    );
    let config = client_config(&certs.ca);
    let handoff_of = |namespace: &str, uid: &str| -> Option<String> {
        let (status, body, _) = post(
            webhook.reviews,
            &config,
            "/mutate",
            &review(
                uid,
                "CREATE",
                &pod("web", json!({}), Some("ReplicaSet")),
                namespace,
            ),
        )
        .unwrap();
        assert_eq!(status, 200);
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["response"]["allowed"], true);
        let patch = base64::engine::general_purpose::STANDARD
            .decode(answer["response"]["patch"].as_str().unwrap())
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
        let mut patched = pod("web", json!({}), Some("ReplicaSet"));
        json_patch::patch(&mut patched, &patch).unwrap();
        let proxy = patched["spec"]["initContainers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|container| container["name"] == "lameduck-proxy")
            .unwrap()
            .clone();
        proxy["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|var| var["name"] == "LAMEDUCK_HANDOFF")
            .map(|var| var["value"].as_str().unwrap().to_string())
    };
    assert_eq!(
        handoff_of("shop", "a").as_deref(),
        Some("8080=web.shop.svc:80")
    );
    assert_eq!(
        handoff_of("shop", "b").as_deref(),
        Some("8080=web.shop.svc:80")
    );
    assert_eq!(handoff_of("locked", "c"), None);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            (
                "/api/v1/namespaces/shop/services".to_string(),
                "Bearer test-token".to_string()
            ),
            (
                "/api/v1/namespaces/locked/services".to_string(),
                "Bearer test-token".to_string()
            ),
        ],
        "one list for the burst of two pods, the token each time"
    );
}
