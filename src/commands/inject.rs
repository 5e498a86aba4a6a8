//! `lameduck inject`: read Kubernetes YAML, write it back with the proxy injected into every
//! pod template (docs/kubernetes.md).
//!
//! The built-in Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet, ReplicationController, Job
//! and CronJob (by `apiVersion` and `kind`) are injected; the items of `List` and of typed lists
//! are visited; anything else passes through. Documents are read as kubectl reads them
//! ([`read`]: YAML 1.1) into generic values, so fields this tool does not know are kept; a
//! document left as it was is written back byte for byte, a changed one by [`write`].
//! A pod template's annotations are read, and checked against each other and its budget, by
//! [`settings`].
//! - Left alone, with a note: pods on the node's network (`hostNetwork`: the NAT rules would
//!   be the node's) and pods another mesh (Linkerd, Istio) has meshed or is asked to mesh.
//!
//! - Native sidecar (default): an init container `lameduck-proxy` with `restartPolicy: Always`.
//! - Legacy (`--native-sidecar=false`, or `lameduck.io/native-sidecar: disabled`): an ordinary
//!   container; in Job and CronJob pods every app container with an explicit `command` is
//!   wrapped as `lameduck await --shutdown -- <command…>`, and the shutdown endpoint enabled.
//! - In both: an init container `lameduck-install` copies the binary into a shared `emptyDir`
//!   mounted at `/lameduck`, where the proxy also keeps its control socket; every app container
//!   gets a `preStop` hook (`lameduck prestop`: quiesce the proxy's inbound side and wait for
//!   its drain, before the kubelet signals the app) and a `postStart` hook (`lameduck
//!   poststart`: serve inbound again after a restart), chained with the container's own exec
//!   or sleep hooks (docs/pod-lifecycle.md).
//! - The grace budget: the proxy's grace period comes from the annotation (ours, else
//!   Linkerd's), else it is the pod's budget minus [`GRACE_MARGIN_SECONDS`]; it bounds the
//!   inbound drain. `terminationGracePeriodSeconds` is raised to that grace period, plus the
//!   budget the app had before injection (for its own shutdown, which now starts after the
//!   drain), plus the margin; never lowered.
//! - Every added container passes Pod Security "restricted" but `lameduck-init`, which needs
//!   root with NET_ADMIN and NET_RAW; in legacy mode it runs after the app's init containers,
//!   since no proxy serves them yet.
//! - Idempotent: a pod template that already has `lameduck-proxy` is left alone.

use serde_norway::{Mapping, Value};

use super::iptables::PROXY_UID;

mod probes;
mod read;
mod services;
mod settings;
mod skip;
mod spec;
mod write;

pub use services::{Service, collect as services_of};
use settings::{
    ANNOTATION_INBOUND_PORTS, ANNOTATION_INJECT, ANNOTATION_INTERCEPT, ANNOTATION_LAME_DUCK_MAX,
    HANDOFF_LAME_DUCK_MAX, Handoff, Intercept, KNOWN, LameDuck, Settings, format_duration,
};
pub use settings::{GRACE_MARGIN_SECONDS, pod_budget};
pub use spec::{InjectError, PROXY_NAME};
use spec::{Object, app_containers, container_name, has_container, map, sequence, yaml};

/// The image the proxy container runs when `--image` is not given.
pub const DEFAULT_IMAGE: &str = concat!("lameduck:", env!("CARGO_PKG_VERSION"));
/// The image of the init container that installs the NAT rules (`docker/Dockerfile`'s `init`
/// target: the binary and iptables) when `--init-image` is not given.
pub const DEFAULT_INIT_IMAGE: &str = concat!("lameduck-init:", env!("CARGO_PKG_VERSION"));
const INIT_NAME: &str = "lameduck-init";
const OUTBOUND_PORT: u16 = 4140;
/// Where the image keeps the binary, and where legacy injection puts a copy for app containers.
const IMAGE_BINARY: &str = "/usr/local/bin/lameduck";
const SHARED_DIR: &str = "/lameduck";
const SHARED_BINARY: &str = "/lameduck/lameduck";
const SHARED_SOCKET: &str = "/lameduck/drain.sock";
/// The container's termination message, as the kubelet mounts it (`terminationMessagePath`).
const TERMINATION_LOG: &str = "/dev/termination-log";
const SHARED_VOLUME: &str = "lameduck-bin";
const INSTALL_NAME: &str = "lameduck-install";
const FIRST_INBOUND_PORT: u16 = 4143;
const ADMIN_PORT: u16 = 4191;

/// What `inject` was asked to do.
#[derive(Clone, Debug)]
pub struct InjectOptions {
    pub image: String,
    pub init_image: String,
    pub native_sidecar: bool,
    /// The Services that may select the pods injected: a pod's late connections are handed
    /// off to them (`services.rs`). `inject` adds those of its own stream.
    pub services: Vec<Service>,
}

/// The injected YAML, and what the operator should know about it (written to stderr).
#[derive(Debug, Default)]
pub struct Injected {
    pub yaml: String,
    pub notes: Vec<String>,
}

/// Injects every pod template in a stream of YAML documents.
///
/// Each document is read as kubectl reads it ([`read`]); one that inject leaves as it was is
/// written back byte for byte (comments, quoting and all), one that it changes is written by
/// [`write`], which kubectl reads back as the same data plus the injection.
pub fn inject(input: &str, options: &InjectOptions) -> Result<Injected, InjectError> {
    let mut injected = Injected::default();
    let stream =
        read::stream(input).map_err(|error| InjectError(format!("invalid YAML: {error}")))?;
    let mut options = options.clone();
    options.services.extend(services::collect(
        stream.documents.iter().map(|document| &document.value),
    ));
    for (index, document) in stream.documents.iter().enumerate() {
        let mut value = document.value.clone();
        inject_document(&mut value, &options, &mut injected.notes)?;
        let source = &stream.text[document.source.clone()];
        let text = if value == document.value {
            source.to_string()
        } else {
            let written = write::to_string(&value).map_err(|error| {
                InjectError(format!(
                    "document {}: cannot write YAML: {}",
                    index + 1,
                    error.0
                ))
            })?;
            format!("{}{written}", header(source))
        };
        if !injected.yaml.is_empty() && !starts_a_document(&text) {
            injected.yaml.push_str("---\n");
        }
        injected.yaml.push_str(&text);
    }
    Ok(injected)
}

/// The lines before a document's content: comments (such as Helm's `# Source:`), blank lines
/// and its `---`, kept when the rest is written anew.
fn header(source: &str) -> &str {
    let mut end = 0;
    for line in source.split_inclusive('\n') {
        let trimmed = line.trim_end();
        if !(trimmed.is_empty() || trimmed.starts_with('#') || trimmed == "---") {
            break;
        }
        end += line.len();
    }
    &source[..end]
}

/// Whether `text` opens with its own `---` (after any comments and blank lines).
fn starts_a_document(text: &str) -> bool {
    text.lines()
        .map(str::trim_end)
        .find(|line| !line.is_empty() && !line.starts_with('#'))
        .is_some_and(|line| line == "---" || line.starts_with("--- ") || line.starts_with("---\t"))
}

/// The built-in kinds whose pods inject meshes, by `apiVersion` and `kind` (a `Job` of another
/// API group is another kind of object, and passes through).
const WORKLOADS: [(&str, &str); 8] = [
    ("v1", "Pod"),
    ("v1", "ReplicationController"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "DaemonSet"),
    ("apps/v1", "ReplicaSet"),
    ("batch/v1", "Job"),
    ("batch/v1", "CronJob"),
];

/// For a workload kind under an API version Kubernetes removed, the version that serves it
/// now and the release that removed the old one (`None`: not one of those).
fn removed_version(api_version: &str, kind: &str) -> Option<&'static str> {
    let removed_in = match (api_version, kind) {
        ("batch/v1beta1" | "batch/v2alpha1", "CronJob") => "batch/v1 since Kubernetes 1.25",
        ("extensions/v1beta1", "Deployment" | "DaemonSet" | "ReplicaSet")
        | (
            "apps/v1beta1" | "apps/v1beta2",
            "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet",
        ) => "apps/v1 since Kubernetes 1.16",
        _ => return None,
    };
    Some(removed_in)
}

/// Injects one document (a workload, a pod, or a list of them) in place; others are left as
/// they are. The admission webhook injects the pods it is sent with this too.
pub fn inject_document(
    document: &mut Value,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) -> Result<(), InjectError> {
    let field = |key: &str| {
        document
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    inject_object(document, &api_version, &kind, options, notes)
}

fn inject_object(
    document: &mut Value,
    api_version: &str,
    kind: &str,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) -> Result<(), InjectError> {
    // `List`, and typed lists such as `DeploymentList`: kubectl applies their items, and
    // gives an item without apiVersion and kind the list's, less `List`.
    if let Some(item_kind) = kind.strip_suffix("List")
        && let Some(items) = document.get_mut("items").and_then(Value::as_sequence_mut)
    {
        for item in items {
            let field = |key: &str| item.get(key).and_then(Value::as_str).map(str::to_string);
            let (item_api, item_kind) = match (field("apiVersion"), field("kind")) {
                (None, None) => (api_version.to_string(), item_kind.to_string()),
                (api, kind) => (api.unwrap_or_default(), kind.unwrap_or_default()),
            };
            inject_object(item, &item_api, &item_kind, options, notes)?;
        }
        return Ok(());
    }
    if !WORKLOADS.contains(&(api_version, kind)) {
        if let Some(served) = removed_version(api_version, kind) {
            notes.push(Object::of(kind, document).note(format!(
                "not injected: {api_version} {kind} is no longer served by Kubernetes \
                 ({served}); kubectl apply will refuse it as it is"
            )));
        }
        return Ok(());
    }
    let object = Object::of(kind, document);
    // A Job's pod (made by the Job controller, as the admission webhook sees it) is a Job's.
    let owned_by_job = document
        .get("metadata")
        .and_then(|metadata| metadata.get("ownerReferences"))
        .and_then(Value::as_sequence)
        .is_some_and(|owners| owners.iter().any(|owner| owner["kind"] == "Job"));
    let template = match kind {
        "Pod" => Some(document),
        "CronJob" => document
            .get_mut("spec")
            .and_then(|spec| spec.get_mut("jobTemplate"))
            .and_then(|job| job.get_mut("spec"))
            .and_then(|spec| spec.get_mut("template")),
        _ => document
            .get_mut("spec")
            .and_then(|spec| spec.get_mut("template")),
    };
    match template {
        Some(template) if template.is_mapping() => {
            let is_job = matches!(kind, "Job" | "CronJob") || owned_by_job;
            inject_template(template, &object, is_job, options, notes)
        }
        _ => Err(object.error(format!(
            "has no pod template ({api_version} {kind} without spec.template)"
        ))),
    }
}

fn inject_template(
    template: &mut Value,
    object: &Object,
    is_job: bool,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) -> Result<(), InjectError> {
    let annotations = settings::annotations(template, object)?;
    let get = |key: &str| {
        annotations
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    for (key, _) in &annotations {
        if key.starts_with("lameduck.io/") && !KNOWN.contains(&key.as_str()) {
            return Err(object.error(format!(
                "unknown annotation {key}; known: {}",
                KNOWN.join(", ")
            )));
        }
    }
    match get(ANNOTATION_INJECT) {
        Some("disabled") => return Ok(()),
        None | Some("enabled") => {}
        Some(other) => {
            return Err(object.annotation_error(
                ANNOTATION_INJECT,
                other,
                "expected enabled or disabled",
            ));
        }
    }
    let spec = template
        .get("spec")
        .filter(|spec| spec.is_mapping())
        .ok_or_else(|| object.error("the pod template has no spec"))?;
    if has_container(spec, "initContainers", PROXY_NAME)
        || has_container(spec, "containers", PROXY_NAME)
    {
        return Ok(());
    }
    if let Some(why) = skip::why_not(template) {
        notes.push(object.note(format!("not injected: {why}")));
        return Ok(());
    }
    let template_labels = labels(template);
    let spec = template
        .get_mut("spec")
        .expect("checked above to be a mapping");
    let mut settings = settings::read(spec, object, &get, is_job, options.native_sidecar)?;
    if settings.intercept.is_some() && get(ANNOTATION_INBOUND_PORTS).is_some() {
        notes.push(object.note(format!(
            "{ANNOTATION_INBOUND_PORTS} is for the explicit mode ({ANNOTATION_INTERCEPT}: \
             disabled); with interception every inbound port goes through the proxy"
        )));
    }
    if let Some((from, to)) = settings.raise_pod_grace_to {
        let message = object.note(format!(
            "raised terminationGracePeriodSeconds from {from} to {to}: the inbound drain \
             (at most the proxy's grace period, {}) comes before the app's own {from} s, plus \
             {GRACE_MARGIN_SECONDS} s for the proxy to exit",
            format_duration(settings.grace)
        ));
        notes.push(message);
        map(spec).insert("terminationGracePeriodSeconds".into(), to.into());
    }
    let legacy_job = is_job && !settings.native;
    let mut endpoint = settings.shutdown_endpoint;
    if legacy_job {
        if endpoint == Some(false) {
            notes.push(object.note(
                "the shutdown endpoint is enabled anyway: the wrapped Job needs it to stop the proxy",
            ));
        }
        endpoint = Some(true);
    }
    let app_probes = match settings.rewrite_probes {
        true => probes::rewrite(spec, object, ADMIN_PORT, notes),
        false => None,
    };
    let handoff = handoff(template_labels, spec, &settings, object, options, notes);
    if handoff.is_some()
        && get(ANNOTATION_LAME_DUCK_MAX).is_none()
        && let Some(LameDuck::Adaptive { max, min, .. }) = &mut settings.lame_duck
    {
        // Never below a minimum the workload asked for.
        *max = (*max)
            .min(HANDOFF_LAME_DUCK_MAX)
            .max(min.unwrap_or_default());
    }
    let proxy = proxy_container(
        &settings,
        endpoint,
        app_probes.as_deref(),
        handoff.as_deref(),
        options,
    );
    hook_app_containers(spec, object, !settings.native, notes);
    if settings.native {
        sequence(spec, "initContainers").insert(0, proxy);
    } else {
        sequence(spec, "containers").push(proxy);
    }
    if legacy_job {
        wrap_job_containers(spec, object, notes);
    }
    install_binary(spec, options);
    if let Some(intercept) = &settings.intercept {
        let init = init_container(intercept, options);
        let inits = sequence(spec, "initContainers");
        if settings.native {
            inits.insert(0, init);
        } else {
            // No proxy runs before the app containers in legacy mode: NAT rules installed
            // first would send the app's init containers' connections to a port nobody
            // listens on. They run on the pod's network as it is, and the rules come last.
            inits.push(init);
        }
    }
    Ok(())
}

/// The pod template's labels (string values: kubectl refuses others).
fn labels(template: &Value) -> Vec<(String, String)> {
    template
        .get("metadata")
        .and_then(|metadata| metadata.get("labels"))
        .and_then(Value::as_mapping)
        .map(|labels| {
            labels
                .iter()
                .filter_map(|(key, value)| {
                    Some((key.as_str()?.to_string(), value.as_str()?.to_string()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The pod's hand-offs for `LAMEDUCK_HANDOFF`, if any: as the annotation names them, or from
/// the Services that select the pod. A hand-off needs the adaptive lame duck (its listeners
/// stay for late connections); a fixed one closes them, and the hand-off is noted unused.
fn handoff(
    labels: Vec<(String, String)>,
    spec: &Value,
    settings: &Settings,
    object: &Object,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) -> Option<String> {
    let handoff = match &settings.handoff {
        Handoff::Disabled => return None,
        Handoff::Named(handoffs) => handoffs.clone(),
        Handoff::Discovered => {
            let named_port = |name: &str| named_port(spec, settings, name);
            let (found, unused) =
                services::handoffs(&options.services, object.namespace(), &labels, named_port);
            notes.extend(unused.into_iter().map(|note| object.note(note)));
            if found.is_empty() {
                return None;
            }
            found
                .iter()
                .map(|(port, service)| format!("{port}={service}"))
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    if let Some(LameDuck::Fixed(_)) = settings.lame_duck {
        notes.push(object.note(format!(
            "no hand-off ({handoff}): a fixed lame duck closes the listeners, so late connections are refused by the closed port; the adaptive one (the default) keeps them"
        )));
        return None;
    }
    Some(handoff)
}

/// The pod port a Service's named `targetPort` means: an app container's port of that name,
/// or in the explicit mode one of the proxy's inbound ports (`lameduck-in`, `lameduck-in-2`...).
fn named_port(spec: &Value, settings: &Settings, name: &str) -> Option<u16> {
    let containers = spec
        .get("containers")
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let declared = containers
        .iter()
        .filter_map(|container| container.get("ports").and_then(Value::as_sequence))
        .flatten()
        .find(|port| port.get("name").and_then(Value::as_str) == Some(name))
        .and_then(|port| port.get("containerPort"))
        .and_then(Value::as_u64)
        .and_then(|number| u16::try_from(number).ok());
    if declared.is_some() || settings.intercept.is_some() {
        return declared;
    }
    let index = match name {
        "lameduck-in" => 0,
        _ => name
            .strip_prefix("lameduck-in-")?
            .parse::<u16>()
            .ok()?
            .checked_sub(1)?,
    };
    Some(FIRST_INBOUND_PORT + index)
}

/// The init container that installs the pod's NAT rules (`lameduck iptables`), before
/// anything else runs: the capabilities it needs and nothing more.
fn init_container(intercept: &Intercept, options: &InjectOptions) -> Value {
    let mut command: Vec<Value> = [
        IMAGE_BINARY,
        "iptables",
        "--inbound-port",
        &FIRST_INBOUND_PORT.to_string(),
        "--outbound-port",
        &OUTBOUND_PORT.to_string(),
        "--admin-port",
        &ADMIN_PORT.to_string(),
        "--proxy-uid",
        &PROXY_UID.to_string(),
    ]
    .into_iter()
    .map(Value::from)
    .collect();
    let join = |items: Vec<String>| items.join(",");
    let ports = |ports: &[u16]| join(ports.iter().map(u16::to_string).collect());
    for (flag, value) in [
        ("--skip-inbound-ports", ports(&intercept.skip_inbound_ports)),
        (
            "--skip-outbound-ports",
            ports(&intercept.skip_outbound_ports),
        ),
        (
            "--skip-outbound-cidrs",
            join(intercept.skip_outbound_cidrs.clone()),
        ),
    ] {
        if !value.is_empty() {
            command.push(flag.into());
            command.push(value.into());
        }
    }
    let mut init = Mapping::new();
    init.insert("name".into(), INIT_NAME.into());
    init.insert("image".into(), options.init_image.clone().into());
    init.insert("command".into(), Value::Sequence(command));
    init.insert(
        "resources".into(),
        yaml("requests: {cpu: 10m, memory: 10Mi}"),
    );
    // Root with NET_ADMIN and NET_RAW for the nat table of the pod's own network namespace.
    init.insert(
        "securityContext".into(),
        yaml(
            "{runAsUser: 0, runAsNonRoot: false, readOnlyRootFilesystem: true, \
             allowPrivilegeEscalation: false, seccompProfile: {type: RuntimeDefault}, \
             capabilities: {add: [NET_ADMIN, NET_RAW], drop: [ALL]}}",
        ),
    );
    Value::Mapping(init)
}

fn proxy_container(
    settings: &Settings,
    shutdown_endpoint: Option<bool>,
    app_probes: Option<&str>,
    handoff: Option<&str>,
    options: &InjectOptions,
) -> Value {
    let mut env = vec![env_var(
        "LAMEDUCK_SHUTDOWN_GRACE_PERIOD",
        &format_duration(settings.grace),
    )];
    match settings.lame_duck {
        None => {}
        Some(LameDuck::Fixed(period)) => env.push(env_var(
            "LAMEDUCK_LAME_DUCK_PERIOD",
            &format_duration(period),
        )),
        Some(LameDuck::Adaptive { max, quiet, min }) => {
            env.push(env_var("LAMEDUCK_LAME_DUCK_MAX", &format_duration(max)));
            for (name, value) in [
                ("LAMEDUCK_LAME_DUCK_QUIET_WINDOW", quiet),
                ("LAMEDUCK_LAME_DUCK_MIN", min),
            ] {
                if let Some(value) = value {
                    env.push(env_var(name, &format_duration(value)));
                }
            }
            // The kubelet's probes come from the node's address: they say nothing of whether
            // the endpoint still points here.
            env.push(yaml(
                "{name: LAMEDUCK_LAME_DUCK_IGNORE_SOURCES, valueFrom: {fieldRef: {fieldPath: status.hostIP}}}",
            ));
        }
    }
    if let Some(window) = settings.close_spread_window {
        env.push(env_var(
            "LAMEDUCK_CLOSE_SPREAD_WINDOW",
            &format_duration(window),
        ));
    }
    env.push(env_var("LAMEDUCK_DRAIN_SOCKET", SHARED_SOCKET));
    // How its shutdown ended, where `kubectl describe pod` shows it.
    env.push(env_var("LAMEDUCK_TERMINATION_LOG", TERMINATION_LOG));
    if let Some(app_probes) = app_probes {
        // The app's probes, which the kubelet now sends to the admin port, go to the pod's
        // address as the kubelet's did.
        env.push(env_var("LAMEDUCK_APP_PROBES", app_probes));
        env.push(yaml(
            "{name: LAMEDUCK_POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}",
        ));
    }
    if let Some(handoff) = handoff {
        env.push(env_var("LAMEDUCK_HANDOFF", handoff));
    }
    if let Some(enabled) = shutdown_endpoint {
        env.push(env_var(
            "LAMEDUCK_SHUTDOWN_ENDPOINT",
            if enabled { "true" } else { "false" },
        ));
    }
    let mut ports = Vec::new();
    let mut routes = Vec::new();
    if settings.intercept.is_some() {
        // Every connection goes where it was sent; both families on each port.
        let both = |port: u16| format!("0.0.0.0:{port}=orig-dst,[::]:{port}=orig-dst");
        env.push(env_var("LAMEDUCK_INBOUND", &both(FIRST_INBOUND_PORT)));
        env.push(env_var("LAMEDUCK_OUTBOUND", &both(OUTBOUND_PORT)));
        ports.push(port("lameduck-in", FIRST_INBOUND_PORT));
    }
    let explicit = match settings.intercept {
        Some(_) => &[][..],
        None => &settings.inbound_ports[..],
    };
    for (index, app_port) in explicit.iter().enumerate() {
        let listen = FIRST_INBOUND_PORT + index as u16;
        routes.push(format!("0.0.0.0:{listen}=127.0.0.1:{app_port}"));
        let name = if index == 0 {
            "lameduck-in".to_string()
        } else {
            format!("lameduck-in-{}", index + 1)
        };
        ports.push(port(&name, listen));
    }
    if settings.intercept.is_none() {
        if routes.is_empty() {
            ports.push(port("lameduck-in", FIRST_INBOUND_PORT));
        } else {
            env.push(env_var("LAMEDUCK_INBOUND", &routes.join(",")));
        }
    }
    ports.push(port("lameduck-admin", ADMIN_PORT));

    let mut container = Mapping::new();
    container.insert("name".into(), PROXY_NAME.into());
    container.insert("image".into(), options.image.clone().into());
    if settings.native {
        container.insert("restartPolicy".into(), "Always".into());
    }
    container.insert("ports".into(), Value::Sequence(ports));
    // The summary it writes; should it die without one, the end of its log.
    container.insert(
        "terminationMessagePolicy".into(),
        "FallbackToLogsOnError".into(),
    );
    container.insert("env".into(), Value::Sequence(env));
    container.insert(
        "volumeMounts".into(),
        yaml(&format!(
            "[{{name: {SHARED_VOLUME}, mountPath: {SHARED_DIR}}}]"
        )),
    );
    container.insert("startupProbe".into(), probe("/ready", 1, 120));
    // Not ready within 4 s of the quiesce (2 probes 2 s apart), well inside the lame duck:
    // when the pod stops without being deleted, failing readiness is what removes it.
    container.insert("readinessProbe".into(), probe("/ready", 2, 2));
    container.insert("livenessProbe".into(), probe("/live", 10, 3));
    container.insert(
        "resources".into(),
        yaml("requests: {cpu: 10m, memory: 20Mi}"),
    );
    container.insert(
        "securityContext".into(),
        yaml(&format!(
            "{{runAsNonRoot: true, runAsUser: {PROXY_UID}, runAsGroup: {PROXY_UID}, \
             readOnlyRootFilesystem: true, allowPrivilegeEscalation: false, \
             seccompProfile: {{type: RuntimeDefault}}, capabilities: {{drop: [ALL]}}}}"
        )),
    );
    let mut container = Value::Mapping(container);
    // The proxy's own preStop hook marks the start of the pod's termination (the kubelet runs
    // every container's preStop then, a native sidecar's too, and only its own before a
    // liveness restart): it quiesces the inbound side, so that the lame duck starts even when
    // an app container's own hook (httpGet) left no room for ours. In legacy mode the proxy
    // is signalled with the app: its hook then also waits until every app container has
    // exited, so that its SIGTERM (and the close of the outbound side) comes after the app's.
    let extra: &[&str] = if settings.native {
        &[]
    } else {
        &["--wait-for-apps"]
    };
    chain_hook(&mut container, "preStop", IMAGE_BINARY, "prestop", extra)
        .expect("the proxy container has no hook of its own");
    container
}

/// Wraps every app container with an explicit command in `lameduck await --shutdown`.
fn wrap_job_containers(spec: &mut Value, object: &Object, notes: &mut Vec<String>) {
    for container in app_containers(spec) {
        let name = container_name(container);
        let Some(command) = container
            .get("command")
            .and_then(Value::as_sequence)
            .cloned()
        else {
            notes.push(object.note(format!(
                "container {name} has no explicit command, so it cannot be wrapped in \
                 `lameduck await --shutdown`; give it a command, or use a native sidecar"
            )));
            continue;
        };
        let mut wrapped: Vec<Value> = [SHARED_BINARY, "await", "--shutdown", "--"]
            .iter()
            .map(|&arg| arg.into())
            .collect();
        wrapped.extend(command);
        map(container).insert("command".into(), Value::Sequence(wrapped));
    }
}

/// Every app container mounts the shared volume (read-only) and gets the preStop and
/// postStart hooks that quiesce and resume the proxy's inbound side; in legacy mode the
/// postStart hook also leaves a holder behind, whose end tells the proxy that the container
/// has exited.
fn hook_app_containers(spec: &mut Value, object: &Object, legacy: bool, notes: &mut Vec<String>) {
    let mount = yaml(&format!(
        "{{name: {SHARED_VOLUME}, mountPath: {SHARED_DIR}, readOnly: true}}"
    ));
    for container in app_containers(spec) {
        sequence(container, "volumeMounts").push(mount.clone());
        let hold: &[&str] = if legacy { &["--hold"] } else { &[] };
        for (event, command, extra) in [
            ("preStop", "prestop", &[][..]),
            ("postStart", "poststart", hold),
        ] {
            if let Err(kept) = chain_hook(container, event, SHARED_BINARY, command, extra) {
                notes.push(object.note(format!(
                    "container {} has a {kept} {event} hook, which cannot run after \
                     another; it is kept and lameduck's `{command}` is not added{}",
                    container_name(container),
                    match event {
                        "preStop" => ": the app may be signalled while inbound requests are in flight; make it an exec hook",
                        _ => ": after a restart of this container the proxy does not serve inbound again until the pod is replaced; make it an exec hook",
                    }
                )));
            }
        }
    }
}

/// Sets the container's `event` hook to `BINARY COMMAND --socket … EXTRA…`, followed by the
/// container's own exec or sleep action; another kind of action (httpGet) is kept, and its
/// kind returned.
fn chain_hook(
    container: &mut Value,
    event: &str,
    binary: &str,
    command: &str,
    extra: &[&str],
) -> Result<(), String> {
    // The socket is named, not left to the command's default, so that the pod spec shows
    // both ends of the channel: this argument and the proxy's LAMEDUCK_DRAIN_SOCKET.
    let mut exec: Vec<Value> = vec![
        binary.into(),
        command.into(),
        "--socket".into(),
        SHARED_SOCKET.into(),
    ];
    exec.extend(extra.iter().map(|&arg| Value::from(arg)));
    let existing = container.get("lifecycle").and_then(|l| l.get(event));
    if let Some(existing) = existing {
        if let Some(theirs) = existing
            .get("exec")
            .and_then(|exec| exec.get("command"))
            .and_then(Value::as_sequence)
        {
            exec.push("--".into());
            exec.extend(theirs.iter().cloned());
        } else if let Some(seconds) = existing
            .get("sleep")
            .and_then(|sleep| sleep.get("seconds"))
            .and_then(Value::as_u64)
        {
            exec.push("--sleep".into());
            exec.push(format!("{seconds}s").into());
        } else {
            let kind = existing
                .as_mapping()
                .and_then(|action| action.keys().next())
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_string();
            return Err(kind);
        }
    }
    let mut action = Mapping::new();
    action.insert("command".into(), Value::Sequence(exec));
    let mut handler = Mapping::new();
    handler.insert("exec".into(), Value::Mapping(action));
    let lifecycle = container
        .as_mapping_mut()
        .expect("containers are mappings")
        .entry("lifecycle".into())
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    if !lifecycle.is_mapping() {
        *lifecycle = Value::Mapping(Mapping::new());
    }
    map(lifecycle).insert(event.into(), Value::Mapping(handler));
    Ok(())
}

/// The shared volume, and the init container that copies the binary into it (first of all,
/// so that the proxy finds the volume ready and the app containers find the binary).
fn install_binary(spec: &mut Value, options: &InjectOptions) {
    sequence(spec, "volumes").push(yaml(&format!("{{name: {SHARED_VOLUME}, emptyDir: {{}}}}")));
    let mut install = Mapping::new();
    install.insert("name".into(), INSTALL_NAME.into());
    install.insert("image".into(), options.image.clone().into());
    install.insert(
        "command".into(),
        yaml(&format!("[{IMAGE_BINARY}, copy-binary, {SHARED_BINARY}]")),
    );
    install.insert(
        "volumeMounts".into(),
        yaml(&format!(
            "[{{name: {SHARED_VOLUME}, mountPath: {SHARED_DIR}}}]"
        )),
    );
    install.insert(
        "securityContext".into(),
        yaml(
            "{runAsNonRoot: true, runAsUser: 65532, allowPrivilegeEscalation: false, \
             seccompProfile: {type: RuntimeDefault}, capabilities: {drop: [ALL]}}",
        ),
    );
    sequence(spec, "initContainers").insert(0, Value::Mapping(install));
}

fn env_var(name: &str, value: &str) -> Value {
    let mut var = Mapping::new();
    var.insert("name".into(), name.into());
    var.insert("value".into(), value.into());
    Value::Mapping(var)
}

fn port(name: &str, number: u16) -> Value {
    yaml(&format!(
        "{{name: {name}, containerPort: {number}, protocol: TCP}}"
    ))
}

fn probe(path: &str, period: u32, failures: u32) -> Value {
    yaml(&format!(
        "{{httpGet: {{path: {path}, port: lameduck-admin}}, periodSeconds: {period}, failureThreshold: {failures}}}"
    ))
}
