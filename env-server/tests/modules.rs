//! The crate's modules import each other without circles: each can be read, changed and
//! tested knowing only the modules below it. A module here is a file or folder of `src/`;
//! `lib.rs`, which declares them all, and the `main.rs` binary are above every one of them.
//! A module's own submodules (`evaluation/judge.rs` in `evaluation`) are part of it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module of `src/` and the modules its code (comments and unit tests left out) names
/// as `crate::<module>`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    for entry in walk(&src) {
        let rel = entry.strip_prefix(&src).expect("under src").to_path_buf();
        let top = rel.components().next().expect("a part");
        let name = top.as_os_str().to_string_lossy();
        let name = name.strip_suffix(".rs").unwrap_or(&name).to_string();
        if name == "lib" || name == "main" {
            continue;
        }
        graph.entry(name.clone()).or_default();
        files.push((name, entry));
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for (name, path) in files {
        let text = std::fs::read_to_string(&path).expect("a source file");
        // Unit tests may reach anywhere: only the module's own code counts.
        let code = text.split("\n#[cfg(test)]").next().unwrap_or("");
        for line in code.lines() {
            let line = line.split("//").next().unwrap_or("");
            for (at, _) in line.match_indices("crate::") {
                let rest = &line[at + "crate::".len()..];
                let mut named: Vec<String> = Vec::new();
                if let Some(group) = rest.strip_prefix('{') {
                    let group = group.split('}').next().unwrap_or("");
                    named.extend(group.split(',').map(|s| ident(s.trim())));
                } else {
                    named.push(ident(rest));
                }
                for m in named {
                    if m != name && modules.contains(&m) {
                        graph.get_mut(&name).expect("known").insert(m);
                    }
                }
            }
        }
    }
    graph
}

/// The identifier `s` starts with.
fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Every `.rs` file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("the source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// A circle through `from`, if the graph has one: the modules along it.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn visit(
        graph: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut c = path[i..].to_vec();
            c.push(at.to_string());
            return Some(c);
        }
        if !done.insert(at.to_string()) {
            return None;
        }
        path.push(at.to_string());
        for next in &graph[at] {
            if let Some(c) = visit(graph, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    visit(graph, from, &mut Vec::new(), &mut BTreeSet::new())
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let graph = imports();
    assert!(
        graph.contains_key("api") && graph.contains_key("state"),
        "{graph:?}"
    );
    assert!(
        graph["api"].contains("state"),
        "the scan sees imports: {graph:?}"
    );
    for m in graph.keys() {
        if let Some(c) = circle(&graph, m) {
            panic!("an import circle: {}", c.join(" -> "));
        }
    }
}
