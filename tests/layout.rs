//! The layers of docs/architecture.md hold: no module of `src/` uses, directly or through
//! others, a module that uses it, and the bottom layers use nothing above them. Read from the
//! `crate::` and `super::` paths in the source, as a reviewer would.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (`proxy::http::server`) → the source text outside its unit tests.
fn modules() -> BTreeMap<String, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeMap::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let relative = path.strip_prefix(&root).unwrap().with_extension("");
            let name = relative
                .components()
                .map(|part| part.as_os_str().to_str().unwrap().to_string())
                .collect::<Vec<_>>()
                .join("::");
            if name == "main" || name == "lib" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let text = match text.find("#[cfg(test)]\nmod tests") {
                Some(at) => text[..at].to_string(),
                None => text,
            };
            modules.insert(name, text);
        }
    }
    modules
}

/// The modules `module` uses: every `crate::…` and `super::…` path, resolved to the longest
/// module it names (an item's module, or a module itself).
fn uses(module: &str, text: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (at, _) in code.match_indices(['c', 's']) {
            let rest = &code[at..];
            if !(rest.starts_with("crate::") || rest.starts_with("super::")) {
                continue;
            }
            if at > 0 && code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let path: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':' || *c == '#')
                .collect();
            let mut current: Vec<&str> = module.split("::").collect();
            for part in path.split("::").filter(|part| !part.is_empty()) {
                match part {
                    "crate" => current.clear(),
                    "super" => {
                        current.pop();
                    }
                    name => current.push(name),
                }
            }
            while !current.is_empty() {
                let candidate = current.join("::").replace("r#", "");
                if known.contains(&candidate) {
                    if candidate != module {
                        used.insert(candidate);
                    }
                    break;
                }
                current.pop();
            }
        }
    }
    used
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules();
    let known: BTreeSet<String> = modules.keys().cloned().collect();
    modules
        .iter()
        .map(|(module, text)| (module.clone(), uses(module, text, &known)))
        .collect()
}

/// Every module `from` reaches through its uses.
fn reachable(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<&String> = graph[from].iter().collect();
    while let Some(module) = stack.pop() {
        if seen.insert(module.clone()) {
            stack.extend(graph.get(module).into_iter().flatten());
        }
    }
    seen
}

#[test]
fn no_module_uses_a_module_that_uses_it() {
    let graph = graph();
    assert!(graph.contains_key("proxy::http::server"), "{graph:?}");
    let cycles: Vec<String> = graph
        .keys()
        .filter(|module| reachable(&graph, module).contains(*module))
        .cloned()
        .collect();
    assert!(
        cycles.is_empty(),
        "modules in a cycle: {cycles:?}\n{graph:#?}"
    );
}

#[test]
fn the_bottom_layers_use_nothing_above_them() {
    let graph = graph();
    let rules: [(&str, &[&str]); 7] = [
        ("config", &[]),
        ("sync", &[]),
        ("arrivals", &[]),
        ("logging", &["config"]),
        ("net", &["config", "logging"]),
        ("drain", &["arrivals", "config", "sync"]),
        ("conns", &["config", "sync"]),
    ];
    for (module, allowed) in rules {
        let above: Vec<String> = reachable(&graph, module)
            .into_iter()
            .filter(|used| !allowed.contains(&used.as_str()))
            .collect();
        assert!(above.is_empty(), "{module} uses {above:?}");
    }
    // The data path never reaches the lifecycle, the admin server or the commands.
    for module in graph.keys().filter(|module| module.starts_with("proxy")) {
        let up: Vec<String> = reachable(&graph, module)
            .into_iter()
            .filter(|used| {
                ["app", "admin", "quiesce", "commands"]
                    .iter()
                    .any(|top| used == top || used.starts_with(&format!("{top}::")))
            })
            .collect();
        assert!(up.is_empty(), "{module} uses {up:?}");
    }
}
