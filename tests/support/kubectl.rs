//! The real kubectl, offline: what it reads in a YAML file, as `kubectl apply` decodes it
//! (go-yaml v2's YAML 1.1 rules, then JSON).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The kubectl clients on this machine: `kubectl` first, then `kubectl.1.27` … beside it (the
/// cloud SDK installs them side by side), oldest first. Empty when there is none.
pub fn clients() -> Vec<PathBuf> {
    let Some(kubectl) = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("kubectl"))
            .find(|candidate| candidate.is_file())
    }) else {
        return Vec::new();
    };
    let mut found = vec![kubectl.clone()];
    let real = std::fs::canonicalize(&kubectl).unwrap_or(kubectl);
    if let Some(dir) = real.parent().and_then(|dir| std::fs::read_dir(dir).ok()) {
        let mut versions: Vec<(u32, PathBuf)> = dir
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .filter_map(|path| Some((minor(&path)?, path)))
            .collect();
        versions.sort();
        found.extend(versions.into_iter().map(|(_, path)| path));
    }
    found
}

/// The newest kubectl on the machine (the highest `kubectl.1.N`, else `kubectl`).
pub fn newest() -> Option<PathBuf> {
    clients().pop()
}

/// `N` of a `kubectl.1.N` beside the main client.
pub fn minor(path: &Path) -> Option<u32> {
    path.file_name()?
        .to_str()?
        .strip_prefix("kubectl.1.")?
        .parse()
        .ok()
}

/// Every object `kubectl` reads in `yaml`, in order (list items one by one), as JSON: `kubectl
/// label --local` decodes every kind offline. `args` come before the file (a label to set, or
/// another verb such as `set resources --local --limits=cpu=1`); the error is kubectl's stderr.
pub fn read(
    kubectl: &Path,
    yaml: &str,
    args: &[&str],
) -> Result<(Vec<serde_json::Value>, String), String> {
    let file = std::env::temp_dir().join(format!(
        "lameduck-kubectl-{}-{:?}.yaml",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&file, yaml).unwrap();
    let output = Command::new(kubectl)
        .args(args)
        .arg("-f")
        .arg(&file)
        .args(["-o", "json"])
        .env("KUBECONFIG", "/dev/null")
        .output()
        .unwrap_or_else(|error| panic!("{}: {error}", kubectl.display()));
    let _ = std::fs::remove_file(&file);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() && output.stdout.is_empty() {
        return Err(stderr);
    }
    let objects = serde_json::Deserializer::from_slice(&output.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|error| format!("{}: {error}", kubectl.display()))?;
    Ok((objects, stderr))
}

/// [`read`] with a label set on every object, which every kind accepts.
pub fn label(kubectl: &Path, yaml: &str) -> Result<Vec<serde_json::Value>, String> {
    let (objects, stderr) = read(
        kubectl,
        yaml,
        &["label", "--local", "lameduck.test/read=true"],
    )?;
    if !stderr.trim().is_empty() {
        return Err(stderr);
    }
    Ok(objects)
}
