//! Embeds the bundled task files so the server works with no checkout of the task data.

// A build script reports failure by panicking: cargo prints the message and stops the build.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    // Read when the script runs, not when it was compiled: a target directory shared by two
    // checkouts of the same sources reuses the compiled script for both.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest).join("tasks");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut files = Vec::new();
    for level in std::fs::read_dir(&root).expect("tasks/ exists") {
        let level = level.expect("entry").path();
        if !level.is_dir() {
            continue;
        }
        println!("cargo:rerun-if-changed={}", level.display());
        for f in std::fs::read_dir(&level).expect("level dir") {
            let f = f.expect("entry").path();
            if f.extension().is_some_and(|e| e == "py") {
                files.push(f);
            }
        }
    }
    files.sort();
    let mut out = String::from("/// (path relative to tasks/, source) of every bundled task.\npub static BUNDLED: &[(&str, &str)] = &[\n");
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .expect("under tasks/")
            .display()
            .to_string();
        writeln!(
            out,
            "    ({rel:?}, include_str!({:?})),",
            f.display().to_string()
        )
        .expect("write");
    }
    out.push_str("];\n");
    let dest = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("bundled.rs");
    std::fs::write(dest, out).expect("write bundled.rs");
}
