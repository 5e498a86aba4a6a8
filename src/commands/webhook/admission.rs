//! One `AdmissionReview` (admission.k8s.io/v1) in, its answer out: a pod being created gets, as
//! a JSON Patch, exactly what `lameduck inject` writes for it (the same function injects both).
//! Everything else is allowed unchanged.

use base64::Engine as _;
use serde_json::{Value, json};

use crate::commands::inject::{self, InjectOptions};

/// Namespaces whose pods are never injected, whatever the selectors say.
const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];
/// The API server shows at most this much of each warning.
const WARNING_MAX: usize = 256;

/// What the webhook does besides injecting.
#[derive(Clone, Debug)]
pub struct Policy {
    pub inject: InjectOptions,
    /// Refuse a pod whose lameduck annotations are invalid, instead of letting it start
    /// unmeshed with a warning.
    pub deny_invalid: bool,
    /// The webhook's own namespace: its pods are never injected.
    pub own_namespace: Option<String>,
}

/// What a review came to, for the log and the metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A patch that injects the pod.
    Injected,
    /// Allowed unchanged: not a pod, not a creation, opted out, already injected, a system
    /// namespace, a pod on its node's network or in another mesh (with a warning).
    Skipped(&'static str),
    /// Invalid lameduck annotations: allowed unchanged with a warning, or denied.
    Invalid { denied: bool, message: String },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Injected => "injected",
            Outcome::Skipped(_) => "skipped",
            Outcome::Invalid { denied: false, .. } => "invalid",
            Outcome::Invalid { denied: true, .. } => "denied",
        }
    }
}

/// A body that is not an `AdmissionReview` request (answered 400).
#[derive(Debug, PartialEq, Eq)]
pub struct BadReview(pub String);

/// The namespace of the pod a review would create, if it is one (for its Services).
pub fn pod_namespace(body: &[u8]) -> Option<String> {
    let review: Value = serde_json::from_slice(body).ok()?;
    let request = &review["request"];
    if request["kind"]["kind"] != "Pod" || request["operation"] != "CREATE" {
        return None;
    }
    request["namespace"]
        .as_str()
        .or_else(|| request["object"]["metadata"]["namespace"].as_str())
        .map(str::to_string)
}

/// Answers one review: the response `AdmissionReview`, and what it came to.
pub fn review(body: &[u8], policy: &Policy) -> Result<(Value, Outcome), BadReview> {
    let review: Value =
        serde_json::from_slice(body).map_err(|error| BadReview(format!("not JSON: {error}")))?;
    if review["apiVersion"] != "admission.k8s.io/v1" || review["kind"] != "AdmissionReview" {
        return Err(BadReview(
            "not an admission.k8s.io/v1 AdmissionReview".into(),
        ));
    }
    let request = &review["request"];
    let Some(uid) = request["uid"].as_str() else {
        return Err(BadReview("the review has no request.uid".into()));
    };
    let (outcome, patch, warnings) = decide(request, policy);
    let mut response = json!({"uid": uid, "allowed": true});
    if let Some(patch) = patch {
        response["patchType"] = "JSONPatch".into();
        response["patch"] = base64::engine::general_purpose::STANDARD
            .encode(patch.to_string())
            .into();
    }
    if let Outcome::Invalid {
        denied: true,
        message,
    } = &outcome
    {
        response["allowed"] = false.into();
        response["status"] = json!({"code": 400, "message": message});
    }
    if !warnings.is_empty() {
        let warnings: Vec<String> = warnings.into_iter().map(|w| truncate(&w)).collect();
        response["warnings"] = warnings.into();
    }
    let answer = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    });
    Ok((answer, outcome))
}

/// The outcome, the patch (when the pod is injected) and the warnings for one request.
fn decide(request: &Value, policy: &Policy) -> (Outcome, Option<Value>, Vec<String>) {
    let skipped = |why| (Outcome::Skipped(why), None, Vec::new());
    if request["kind"]["kind"] != "Pod" || request["kind"]["group"] != "" {
        return skipped("not a pod");
    }
    if request["operation"] != "CREATE" {
        return skipped("not a creation");
    }
    if request["subResource"]
        .as_str()
        .is_some_and(|sub| !sub.is_empty())
    {
        return skipped("a subresource");
    }
    let pod = &request["object"];
    if !pod.is_object() {
        return skipped("no object");
    }
    // A pod being created may not carry its namespace yet; the request does.
    let namespace = request["namespace"]
        .as_str()
        .or_else(|| pod["metadata"]["namespace"].as_str())
        .unwrap_or("default");
    if SYSTEM_NAMESPACES.contains(&namespace) {
        return skipped("a system namespace");
    }
    if policy.own_namespace.as_deref() == Some(namespace) {
        return skipped("the webhook's own namespace");
    }
    // The namespace goes into the copy only for inject's messages; the patch is taken against
    // that copy, so it never touches the namespace (the API server sets it).
    let mut named = pod.clone();
    if named["metadata"]["namespace"].is_null() && named["metadata"].is_object() {
        named["metadata"]["namespace"] = namespace.into();
    }
    // The request says what the object is; inject goes by the object's own apiVersion and
    // kind, which the API server always sends but a hand-made review may leave out.
    for (field, value) in [("apiVersion", "v1"), ("kind", "Pod")] {
        if named[field].is_null() {
            named[field] = value.into();
        }
    }
    let mut document = match serde_norway::to_value(&named) {
        Ok(document) => document,
        Err(error) => return invalid(policy, format!("the pod cannot be read: {error}")),
    };
    let mut notes = Vec::new();
    if let Err(error) = inject::inject_document(&mut document, &policy.inject, &mut notes) {
        return invalid(policy, error.to_string());
    }
    let injected = match serde_json::to_value(&document) {
        Ok(injected) => injected,
        Err(error) => {
            return invalid(
                policy,
                format!("the injected pod cannot be written: {error}"),
            );
        }
    };
    let patch = json_patch::diff(&named, &injected);
    if patch.0.is_empty() {
        // A note says why a pod was left alone (its host's network, another mesh): the
        // person who created it sees it as a warning.
        return match notes.is_empty() {
            true => skipped("opted out or injected already"),
            false => (Outcome::Skipped("not safe to mesh"), None, notes),
        };
    }
    let patch = serde_json::to_value(patch).unwrap_or(Value::Null);
    (Outcome::Injected, Some(patch), notes)
}

fn invalid(policy: &Policy, message: String) -> (Outcome, Option<Value>, Vec<String>) {
    let warning = format!("lameduck: not injected: {message}");
    let outcome = Outcome::Invalid {
        denied: policy.deny_invalid,
        message: warning.clone(),
    };
    (outcome, None, vec![warning])
}

fn truncate(text: &str) -> String {
    if text.len() <= WARNING_MAX {
        return text.to_string();
    }
    let mut end = WARNING_MAX - 3;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}
