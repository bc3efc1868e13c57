//! The dependency invariants of ARCHITECTURE.md, checked on the resolved graph that
//! `cargo metadata` reports (normal dependencies, transitively; dev and build dependencies
//! are not linked into the crate).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

/// The host's target triple (the graph is resolved for it, as the build is).
fn host() -> String {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("host triple")
}

/// Package name -> names of its normal dependencies, over the resolved graph (once).
fn graph() -> &'static BTreeMap<String, BTreeSet<String>> {
    static GRAPH: OnceLock<BTreeMap<String, BTreeSet<String>>> = OnceLock::new();
    GRAPH.get_or_init(resolve)
}

fn resolve() -> BTreeMap<String, BTreeSet<String>> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--filter-platform",
        ])
        .arg(host())
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let names: BTreeMap<&str, &str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let mut g = BTreeMap::new();
    for node in meta["resolve"]["nodes"].as_array().unwrap() {
        let name = names[node["id"].as_str().unwrap()].to_string();
        let deps: BTreeSet<String> = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| {
                d["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"].is_null())
            })
            .map(|d| names[d["pkg"].as_str().unwrap()].to_string())
            .collect();
        g.entry(name).or_insert_with(BTreeSet::new).extend(deps);
    }
    g
}

/// Everything `root` links, transitively (features of all builds merged: an over-estimate,
/// so a dependency absent here is absent from every build).
fn closure(g: &BTreeMap<String, BTreeSet<String>>, root: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![root.to_string()];
    while let Some(n) = todo.pop() {
        for d in g.get(&n).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn the_trainer_never_links_the_server_or_the_sandbox() {
    let g = graph();
    let deps = closure(g, "trainer");
    for forbidden in ["env-server", "agent-tools"] {
        assert!(!deps.contains(forbidden), "trainer depends on {forbidden}");
    }
    // It reaches the server over HTTP, through the client and the wire types.
    assert!(deps.contains("env-client") && deps.contains("env-api"));
}

#[test]
fn the_tools_know_no_http() {
    let g = graph();
    let deps = closure(g, "agent-tools");
    for http in [
        "hyper",
        "axum",
        "reqwest",
        "env-server",
        "env-client",
        "rmcp",
    ] {
        assert!(!deps.contains(http), "agent-tools depends on {http}");
    }
}

#[test]
fn the_wire_types_hold_types_only() {
    let g = graph();
    let direct = &g["env-api"];
    let allowed: BTreeSet<&str> = ["serde", "serde_json", "utoipa", "schemars"].into();
    let extra: Vec<&String> = direct
        .iter()
        .filter(|d| !allowed.contains(d.as_str()))
        .collect();
    assert!(
        extra.is_empty(),
        "env-api depends on more than serialisation and schemas: {extra:?}"
    );
}

#[test]
fn the_client_and_the_benchmarks_never_link_the_server() {
    let g = graph();
    for krate in ["env-client", "kernelbench", "charts"] {
        let deps = closure(g, krate);
        assert!(!deps.contains("env-server"), "{krate} links the server");
    }
    // kernelbench runs a model's proposed task code only in the tool sandbox, so it links
    // agent-tools for that; the client and the charts have no code to confine.
    for krate in ["env-client", "charts"] {
        assert!(
            !closure(g, krate).contains("agent-tools"),
            "{krate} links the tools and their sandbox"
        );
    }
}
