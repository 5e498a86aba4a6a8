//! `lameduck inject`: read Kubernetes YAML, write it back with the proxy injected into every
//! pod template (CONTRACT section 5).
//!
//! Pod, Deployment, StatefulSet, DaemonSet, ReplicaSet, ReplicationController, Job and CronJob
//! are injected; `kind: List` items are visited; anything else passes through. Documents are
//! read as generic YAML values, so fields this tool does not know are kept as they are.
//!
//! - Native sidecar (default): an init container `lameduck-proxy` with `restartPolicy: Always`.
//! - Legacy (`--native-sidecar=false`, or `lameduck.io/native-sidecar: disabled`): an ordinary
//!   container; in Job and CronJob pods every app container with an explicit `command` is
//!   wrapped as `lameduck await --shutdown -- <command…>`, the binary copied into a shared
//!   `emptyDir` by an init container, and the shutdown endpoint enabled.
//! - The grace budget: the proxy's grace period comes from the annotation (ours, else
//!   Linkerd's) and `terminationGracePeriodSeconds` is raised to cover it plus
//!   [`GRACE_MARGIN_SECONDS`], never lowered; without an annotation the grace period is the
//!   pod's budget minus that margin, so the proxy's forced close comes before the kubelet's
//!   SIGKILL.
//! - Idempotent: a pod template that already has `lameduck-proxy` is left alone.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde_norway::{Mapping, Value};

use crate::config::{Raw, parse_bool, parse_duration};

mod yaml;

pub const ANNOTATION_INJECT: &str = "lameduck.io/inject";
pub const ANNOTATION_GRACE: &str = "lameduck.io/shutdown-grace-period";
pub const ANNOTATION_LAME_DUCK: &str = "lameduck.io/lame-duck-period";
pub const ANNOTATION_SHUTDOWN_ENDPOINT: &str = "lameduck.io/shutdown-endpoint";
pub const ANNOTATION_INBOUND_PORTS: &str = "lameduck.io/inbound-ports";
pub const ANNOTATION_NATIVE_SIDECAR: &str = "lameduck.io/native-sidecar";
pub const ANNOTATION_LINKERD_GRACE: &str = "config.linkerd.io/shutdown-grace-period";
const KNOWN: [&str; 6] = [
    ANNOTATION_INJECT,
    ANNOTATION_GRACE,
    ANNOTATION_LAME_DUCK,
    ANNOTATION_SHUTDOWN_ENDPOINT,
    ANNOTATION_INBOUND_PORTS,
    ANNOTATION_NATIVE_SIDECAR,
];

/// The proxy container's name; its presence marks a pod template as injected.
pub const PROXY_NAME: &str = "lameduck-proxy";
/// Seconds between the proxy's grace period and the pod's, for the proxy to exit in.
pub const GRACE_MARGIN_SECONDS: u64 = 5;
/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_POD_GRACE_SECONDS: u64 = 30;
/// The image the proxy container runs when `--image` is not given.
pub const DEFAULT_IMAGE: &str = concat!("lameduck:", env!("CARGO_PKG_VERSION"));
/// Where the image keeps the binary, and where legacy injection puts a copy for app containers.
const IMAGE_BINARY: &str = "/usr/local/bin/lameduck";
const SHARED_DIR: &str = "/lameduck";
const SHARED_BINARY: &str = "/lameduck/lameduck";
const SHARED_VOLUME: &str = "lameduck-bin";
const INSTALL_NAME: &str = "lameduck-install";
const FIRST_INBOUND_PORT: u16 = 4143;
const ADMIN_PORT: u16 = 4191;

/// What `inject` was asked to do.
#[derive(Clone, Debug)]
pub struct InjectOptions {
    pub image: String,
    pub native_sidecar: bool,
}

/// The injected YAML, and what the operator should know about it (written to stderr).
#[derive(Debug, Default)]
pub struct Injected {
    pub yaml: String,
    pub notes: Vec<String>,
}

/// Input that cannot be injected: bad YAML or a bad annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectError(pub String);

impl fmt::Display for InjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InjectError {}

/// Injects every pod template in a stream of YAML documents.
pub fn inject(input: &str, options: &InjectOptions) -> Result<Injected, InjectError> {
    let mut injected = Injected::default();
    let mut documents = Vec::new();
    for (index, document) in serde_norway::Deserializer::from_str(input).enumerate() {
        let mut value = Value::deserialize(document).map_err(|error| {
            InjectError(format!("document {}: invalid YAML: {error}", index + 1))
        })?;
        if value.is_null() {
            continue;
        }
        inject_document(&mut value, options, &mut injected.notes)?;
        documents.push(value);
    }
    for (index, document) in documents.iter().enumerate() {
        if index > 0 {
            injected.yaml.push_str("---\n");
        }
        let yaml = yaml::to_string(document).map_err(|error| {
            InjectError(format!(
                "document {}: cannot write YAML: {}",
                index + 1,
                error.0
            ))
        })?;
        injected.yaml.push_str(&yaml);
    }
    Ok(injected)
}

fn inject_document(
    document: &mut Value,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) -> Result<(), InjectError> {
    let kind = document
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if kind == "List" {
        if let Some(items) = document.get_mut("items").and_then(Value::as_sequence_mut) {
            for item in items {
                inject_document(item, options, notes)?;
            }
        }
        return Ok(());
    }
    let object = Object::of(&kind, document);
    let template = match kind.as_str() {
        "Pod" => Some(document),
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "ReplicationController"
        | "Job" => document
            .get_mut("spec")
            .and_then(|spec| spec.get_mut("template")),
        "CronJob" => document
            .get_mut("spec")
            .and_then(|spec| spec.get_mut("jobTemplate"))
            .and_then(|job| job.get_mut("spec"))
            .and_then(|spec| spec.get_mut("template")),
        _ => return Ok(()),
    };
    match template {
        Some(template) if template.is_mapping() => {
            let is_job = matches!(kind.as_str(), "Job" | "CronJob");
            inject_template(template, &object, is_job, options, notes)
        }
        _ => Err(object.error(format!(
            "has no pod template ({kind} without spec.template)"
        ))),
    }
}

/// Names a Kubernetes object in messages: `Deployment default/web`.
struct Object {
    kind: String,
    namespace: String,
    name: String,
}

impl Object {
    fn of(kind: &str, document: &Value) -> Object {
        let metadata = document.get("metadata");
        let field = |key: &str| {
            metadata
                .and_then(|m| m.get(key))
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        Object {
            kind: kind.to_string(),
            namespace: field("namespace").unwrap_or_else(|| "default".into()),
            name: field("name")
                .or_else(|| field("generateName"))
                .unwrap_or_else(|| "<unnamed>".into()),
        }
    }

    fn error(&self, message: impl fmt::Display) -> InjectError {
        InjectError(format!(
            "{} {}/{}: {message}",
            self.kind, self.namespace, self.name
        ))
    }

    fn annotation_error(
        &self,
        annotation: &str,
        value: &str,
        reason: impl fmt::Display,
    ) -> InjectError {
        self.error(format!(
            "annotation {annotation}: invalid value {value:?}: {reason}"
        ))
    }
}

/// The settings one pod template's annotations ask for.
struct Settings {
    grace: Duration,
    /// `terminationGracePeriodSeconds` to set, when it must be raised.
    raise_pod_grace_to: Option<(u64, u64)>,
    lame_duck: Option<Duration>,
    shutdown_endpoint: Option<bool>,
    inbound_ports: Vec<u16>,
    native: bool,
}

fn inject_template(
    template: &mut Value,
    object: &Object,
    is_job: bool,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) -> Result<(), InjectError> {
    let annotations = annotations(template, object)?;
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
        .get_mut("spec")
        .filter(|spec| spec.is_mapping())
        .ok_or_else(|| object.error("the pod template has no spec"))?;
    if has_container(spec, "initContainers", PROXY_NAME)
        || has_container(spec, "containers", PROXY_NAME)
    {
        return Ok(());
    }
    let settings = settings(spec, object, &get, options)?;
    if let Some((from, to)) = settings.raise_pod_grace_to {
        let message = format!(
            "{} {}/{}: raised terminationGracePeriodSeconds from {from} to {to} to cover the proxy's grace period",
            object.kind, object.namespace, object.name
        );
        notes.push(message);
        map(spec).insert("terminationGracePeriodSeconds".into(), to.into());
    }
    let legacy_job = is_job && !settings.native;
    let mut endpoint = settings.shutdown_endpoint;
    if legacy_job {
        if endpoint == Some(false) {
            notes.push(format!(
                "{} {}/{}: the shutdown endpoint is enabled anyway: the wrapped Job needs it to stop the proxy",
                object.kind, object.namespace, object.name
            ));
        }
        endpoint = Some(true);
    }
    let proxy = proxy_container(&settings, endpoint, options);
    if settings.native {
        sequence(spec, "initContainers").insert(0, proxy);
    } else {
        sequence(spec, "containers").push(proxy);
    }
    if legacy_job {
        wrap_job_containers(spec, object, options, notes);
    }
    Ok(())
}

/// The pod template's annotations as strings (numbers and booleans written unquoted included).
fn annotations(template: &Value, object: &Object) -> Result<Vec<(String, String)>, InjectError> {
    let Some(annotations) = template.get("metadata").and_then(|m| m.get("annotations")) else {
        return Ok(Vec::new());
    };
    let Some(annotations) = annotations.as_mapping() else {
        return Err(object.error("metadata.annotations is not a map"));
    };
    let mut pairs = Vec::new();
    for (key, value) in annotations {
        let key = key.as_str().unwrap_or_default().to_string();
        let value = match value {
            Value::String(text) => text.clone(),
            Value::Number(number) => number.to_string(),
            Value::Bool(flag) => flag.to_string(),
            _ => return Err(object.error(format!("annotation {key} is not a string"))),
        };
        pairs.push((key, value));
    }
    Ok(pairs)
}

fn settings<'a>(
    spec: &Value,
    object: &Object,
    get: &impl Fn(&str) -> Option<&'a str>,
    options: &InjectOptions,
) -> Result<Settings, InjectError> {
    let duration = |key: &str, value: &str| {
        parse_duration(&Raw::new(value, key), "90s")
            .map_err(|error| object.annotation_error(key, value, error.reason))
    };
    let enabled = |key: &str| -> Result<Option<bool>, InjectError> {
        match get(key) {
            None => Ok(None),
            Some("enabled") => Ok(Some(true)),
            Some("disabled") => Ok(Some(false)),
            Some(other) => match parse_bool(&Raw::new(other, key), "enabled or disabled") {
                Ok(flag) => Ok(Some(flag)),
                Err(_) => Err(object.annotation_error(key, other, "expected enabled or disabled")),
            },
        }
    };

    let pod_grace = match spec.get("terminationGracePeriodSeconds") {
        None => DEFAULT_POD_GRACE_SECONDS,
        Some(value) => value.as_u64().ok_or_else(|| {
            object.error("spec.terminationGracePeriodSeconds is not a whole number of seconds")
        })?,
    };
    let annotated = match (get(ANNOTATION_GRACE), get(ANNOTATION_LINKERD_GRACE)) {
        (Some(value), _) => Some(duration(ANNOTATION_GRACE, value)?),
        (None, Some(value)) => Some(duration(ANNOTATION_LINKERD_GRACE, value)?),
        (None, None) => None,
    };
    let (grace, raise_pod_grace_to) = match annotated {
        Some(grace) => {
            let needed =
                grace.as_secs() + u64::from(grace.subsec_nanos() > 0) + GRACE_MARGIN_SECONDS;
            (grace, (pod_grace < needed).then_some((pod_grace, needed)))
        }
        None => (
            Duration::from_secs(pod_grace - GRACE_MARGIN_SECONDS.min(pod_grace / 2)),
            None,
        ),
    };
    let lame_duck = match get(ANNOTATION_LAME_DUCK) {
        Some(value) => {
            let period = duration(ANNOTATION_LAME_DUCK, value)?;
            if period > grace {
                return Err(object.annotation_error(
                    ANNOTATION_LAME_DUCK,
                    value,
                    format!(
                        "longer than the shutdown grace period ({})",
                        format_duration(grace)
                    ),
                ));
            }
            Some(period)
        }
        None => None,
    };
    let inbound_ports = match get(ANNOTATION_INBOUND_PORTS) {
        Some(value) => {
            let ports: Result<Vec<u16>, _> = value
                .split(',')
                .map(|port| port.trim().parse::<u16>())
                .collect();
            match ports {
                Ok(ports) if !ports.is_empty() && !ports.contains(&0) => ports,
                _ => {
                    return Err(object.annotation_error(
                        ANNOTATION_INBOUND_PORTS,
                        value,
                        "expected ports such as 8080,9090",
                    ));
                }
            }
        }
        None => declared_ports(spec),
    };
    let native = enabled(ANNOTATION_NATIVE_SIDECAR)?.unwrap_or(options.native_sidecar);
    Ok(Settings {
        grace,
        raise_pod_grace_to,
        lame_duck,
        shutdown_endpoint: enabled(ANNOTATION_SHUTDOWN_ENDPOINT)?,
        inbound_ports,
        native,
    })
}

/// TCP ports the app containers declare, in order, without repeats.
fn declared_ports(spec: &Value) -> Vec<u16> {
    let mut ports = Vec::new();
    let containers = spec
        .get("containers")
        .and_then(Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for container in containers {
        let declared = container
            .get("ports")
            .and_then(Value::as_sequence)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for port in declared {
            let tcp = port
                .get("protocol")
                .and_then(Value::as_str)
                .is_none_or(|protocol| protocol == "TCP");
            if let Some(number) = port
                .get("containerPort")
                .and_then(Value::as_u64)
                .and_then(|n| u16::try_from(n).ok())
                && tcp
                && !ports.contains(&number)
            {
                ports.push(number);
            }
        }
    }
    ports
}

fn proxy_container(
    settings: &Settings,
    shutdown_endpoint: Option<bool>,
    options: &InjectOptions,
) -> Value {
    let mut env = vec![env_var(
        "LAMEDUCK_SHUTDOWN_GRACE_PERIOD",
        &format_duration(settings.grace),
    )];
    if let Some(period) = settings.lame_duck {
        env.push(env_var(
            "LAMEDUCK_LAME_DUCK_PERIOD",
            &format_duration(period),
        ));
    }
    if let Some(enabled) = shutdown_endpoint {
        env.push(env_var(
            "LAMEDUCK_SHUTDOWN_ENDPOINT",
            if enabled { "true" } else { "false" },
        ));
    }
    let mut ports = Vec::new();
    let mut routes = Vec::new();
    for (index, app_port) in settings.inbound_ports.iter().enumerate() {
        let listen = FIRST_INBOUND_PORT + index as u16;
        routes.push(format!("0.0.0.0:{listen}=127.0.0.1:{app_port}"));
        let name = if index == 0 {
            "lameduck-in".to_string()
        } else {
            format!("lameduck-in-{}", index + 1)
        };
        ports.push(port(&name, listen));
    }
    if settings.inbound_ports.is_empty() {
        ports.push(port("lameduck-in", FIRST_INBOUND_PORT));
    } else {
        env.push(env_var("LAMEDUCK_INBOUND", &routes.join(",")));
    }
    ports.push(port("lameduck-admin", ADMIN_PORT));

    let mut container = Mapping::new();
    container.insert("name".into(), PROXY_NAME.into());
    container.insert("image".into(), options.image.clone().into());
    if settings.native {
        container.insert("restartPolicy".into(), "Always".into());
    }
    container.insert("ports".into(), Value::Sequence(ports));
    container.insert("env".into(), Value::Sequence(env));
    container.insert("startupProbe".into(), probe("/ready", 1, 120));
    container.insert("readinessProbe".into(), probe("/ready", 5, 3));
    container.insert("livenessProbe".into(), probe("/live", 10, 3));
    container.insert(
        "resources".into(),
        yaml("requests: {cpu: 10m, memory: 20Mi}"),
    );
    container.insert(
        "securityContext".into(),
        yaml(
            "{runAsNonRoot: true, runAsUser: 65532, readOnlyRootFilesystem: true, \
             allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}",
        ),
    );
    Value::Mapping(container)
}

/// Wraps every app container with an explicit command in `lameduck await --shutdown`.
fn wrap_job_containers(
    spec: &mut Value,
    object: &Object,
    options: &InjectOptions,
    notes: &mut Vec<String>,
) {
    let mount = yaml(&format!(
        "{{name: {SHARED_VOLUME}, mountPath: {SHARED_DIR}, readOnly: true}}"
    ));
    for container in sequence(spec, "containers").iter_mut() {
        let name = container
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if name == PROXY_NAME {
            continue;
        }
        let Some(command) = container
            .get("command")
            .and_then(Value::as_sequence)
            .cloned()
        else {
            notes.push(format!(
                "{} {}/{}: container {name} has no explicit command, so it cannot be wrapped in \
                 `lameduck await --shutdown`; give it a command, or use a native sidecar",
                object.kind, object.namespace, object.name
            ));
            continue;
        };
        let mut wrapped: Vec<Value> = ["await", "--shutdown", "--"]
            .iter()
            .map(|&arg| arg.into())
            .collect();
        wrapped.insert(0, SHARED_BINARY.into());
        wrapped.extend(command);
        map(container).insert("command".into(), Value::Sequence(wrapped));
        sequence(container, "volumeMounts").push(mount.clone());
    }
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
        yaml("{runAsNonRoot: true, runAsUser: 65532, allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}"),
    );
    sequence(spec, "initContainers").insert(0, Value::Mapping(install));
}

fn has_container(spec: &Value, list: &str, name: &str) -> bool {
    spec.get(list)
        .and_then(Value::as_sequence)
        .is_some_and(|containers| {
            containers
                .iter()
                .any(|c| c.get("name").and_then(Value::as_str) == Some(name))
        })
}

/// The mapping inside `value`, which the caller has checked is one.
fn map(value: &mut Value) -> &mut Mapping {
    value.as_mapping_mut().expect("checked to be a mapping")
}

/// The sequence at `key`, created when missing (or replaced when not a sequence).
fn sequence<'a>(value: &'a mut Value, key: &str) -> &'a mut Vec<Value> {
    let map = map(value);
    if !map.get(key).is_some_and(Value::is_sequence) {
        map.insert(key.into(), Value::Sequence(Vec::new()));
    }
    map.get_mut(key)
        .and_then(Value::as_sequence_mut)
        .expect("just made a sequence")
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

/// A fixed YAML fragment written in this file.
fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).expect("fragments in this file are valid YAML")
}

/// `90s`, or `1500ms` when not whole seconds.
fn format_duration(duration: Duration) -> String {
    if duration.subsec_nanos() == 0 {
        format!("{}s", duration.as_secs())
    } else {
        format!("{}ms", duration.as_millis())
    }
}
