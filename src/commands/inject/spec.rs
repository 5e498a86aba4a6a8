//! The parts of a pod template that inject reads and changes, and the name of the object it
//! belongs to in notes and errors. Shared by inject's rooms (the injection itself, the probes,
//! what is left alone); it knows nothing of what they add.

use std::fmt;

use serde_norway::{Mapping, Value};

/// The proxy container's name; its presence marks a pod template as injected.
pub const PROXY_NAME: &str = "lameduck-proxy";

/// Input that cannot be injected: bad YAML or a bad annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectError(pub String);

impl fmt::Display for InjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InjectError {}

/// Names a Kubernetes object in messages: `Deployment default/web`.
pub(super) struct Object {
    kind: String,
    namespace: String,
    /// As the document names it, if it does.
    named_namespace: Option<String>,
    name: String,
}

impl Object {
    pub(super) fn of(kind: &str, document: &Value) -> Object {
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
            named_namespace: field("namespace"),
            name: field("name")
                .or_else(|| field("generateName"))
                .unwrap_or_else(|| "<unnamed>".into()),
        }
    }

    /// The namespace the document names, if any (kubectl's `-n` or the context's decides
    /// otherwise).
    pub(super) fn namespace(&self) -> Option<&str> {
        self.named_namespace.as_deref()
    }

    pub(super) fn error(&self, message: impl fmt::Display) -> InjectError {
        InjectError(self.note(message))
    }

    /// A note for stderr (or the webhook's warnings) about this object.
    pub(super) fn note(&self, message: impl fmt::Display) -> String {
        format!("{} {}/{}: {message}", self.kind, self.namespace, self.name)
    }

    pub(super) fn annotation_error(
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

/// The pod's app containers: every entry of `containers` but the proxy.
pub(super) fn app_containers(spec: &mut Value) -> impl Iterator<Item = &mut Value> {
    sequence(spec, "containers")
        .iter_mut()
        .filter(|container| container_name(container) != PROXY_NAME)
        .filter(|container| container.is_mapping())
}

pub(super) fn container_name(container: &Value) -> String {
    container
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

pub(super) fn has_container(spec: &Value, list: &str, name: &str) -> bool {
    spec.get(list)
        .and_then(Value::as_sequence)
        .is_some_and(|containers| {
            containers
                .iter()
                .any(|c| c.get("name").and_then(Value::as_str) == Some(name))
        })
}

/// The mapping inside `value`, which the caller has checked is one.
pub(super) fn map(value: &mut Value) -> &mut Mapping {
    value.as_mapping_mut().expect("checked to be a mapping")
}

/// The sequence at `key`, created when missing (or replaced when not a sequence).
pub(super) fn sequence<'a>(value: &'a mut Value, key: &str) -> &'a mut Vec<Value> {
    let map = map(value);
    if !map.get(key).is_some_and(Value::is_sequence) {
        map.insert(key.into(), Value::Sequence(Vec::new()));
    }
    map.get_mut(key)
        .and_then(Value::as_sequence_mut)
        .expect("just made a sequence")
}

/// A fixed YAML fragment written in inject's code.
pub(super) fn yaml(text: &str) -> Value {
    serde_norway::from_str(text).expect("fragments in this file are valid YAML")
}
