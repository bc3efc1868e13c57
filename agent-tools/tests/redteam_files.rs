//! Red team: the file tools run inside the server, as root, on paths the agent shapes. Each
//! test is an attack an agent can mount through its own tools (Bash as its uid, then a file
//! tool), and checks that root never acts on what the agent planted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::sync::mpsc;
use std::time::Duration;

use agent_tools::ToolOutput;
use common::{fixture, glob_data, read_data, Fixture};
use serde_json::{json, Value};

/// Runs one call on its own thread and runtime, so that a call that blocks for good fails
/// the test instead of hanging it. The wait is a guard, not a measurement: a passing call
/// returns at once.
fn call_guarded(f: Fixture, tool: &'static str, args: Value) -> (Fixture, ToolOutput) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut f = f;
        let out = rt.block_on(f.call(tool, args));
        let _ = tx.send((f, out));
    });
    rx.recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("{tool} blocked the server thread"))
}

fn bash_ok(f: &mut Fixture, command: &str) -> ToolOutput {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let out = rt.block_on(f.bash(command));
    assert!(!out.is_error, "{command}: {}", out.text);
    out
}

fn call(f: &mut Fixture, tool: &str, args: Value) -> ToolOutput {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(f.call(tool, args))
}

fn secret_text(f: &Fixture) -> String {
    std::fs::read_to_string(&f.secret).expect("secret readable")
}

/// The temporary name a write used to go through was `.NAME.<server pid>.tmp`; the agent
/// reads the pid as `$PPID` and plants a link under that name.
#[test]
fn writes_never_go_through_a_planted_temp_name() {
    let mut f = fixture();
    let pid = std::process::id();
    let planted = f.dir.path().join("server-state/planted-by-agent");
    let secret = f.secret.display().to_string();
    let before = secret_text(&f);
    let out = call(
        &mut f,
        "Write",
        json!({"file_path": "model_new.py", "content": "import torch\n"}),
    );
    assert!(!out.is_error, "{}", out.text);
    bash_ok(
        &mut f,
        &format!(
            "chmod 4755 model_new.py && ln -s {planted} .model_new.py.{pid}.tmp && ln -s {secret} .notes.py.{pid}.tmp \
             && mkdir -p kernels && ln -s {secret} kernels/.add.cu.{pid}.tmp",
            planted = planted.display()
        ),
    );
    for (path, content) in [
        ("model_new.py", "#!/bin/sh\nid > /tmp/owned\n"),
        ("notes.py", "overwrite"),
        ("kernels/add.cu", "x"),
    ] {
        let out = call(
            &mut f,
            "Write",
            json!({"file_path": path, "content": content}),
        );
        assert!(!out.is_error, "{path}: {}", out.text);
    }
    let out = call(
        &mut f,
        "MultiEdit",
        json!({"file_path": "notes.py", "edits": [{"old_string": "overwrite", "new_string": "edited"}]}),
    );
    assert!(!out.is_error, "{}", out.text);
    assert!(
        !planted.exists(),
        "root created a file the agent chose, outside the workspace"
    );
    assert_eq!(
        secret_text(&f),
        before,
        "root overwrote a file outside the workspace"
    );
    assert_eq!(
        std::fs::read_to_string(f.root.join("model_new.py")).unwrap(),
        "#!/bin/sh\nid > /tmp/owned\n"
    );
    let mode = std::fs::metadata(f.root.join("model_new.py"))
        .unwrap()
        .mode();
    assert_eq!(
        mode & 0o7000,
        0,
        "a tool-written file keeps no setuid/setgid bit: {mode:o}"
    );
}

/// A Bash-only variant: break a protected file so that it is restored, with a link planted
/// under the name the restore writes through.
#[test]
fn restoring_protected_files_never_follows_a_planted_link() {
    let mut f = fixture();
    let pid = std::process::id();
    let secret = f.secret.display().to_string();
    let before = secret_text(&f);
    let planted = f.dir.path().join("server-state/planted-by-restore");
    let out = bash_ok(
        &mut f,
        &format!(
            "ln -s {secret} .verify.py.{pid}.tmp && rm -f verify.py && ln -s {planted} .model.py.{pid}.tmp && chmod 0644 model.py 2>/dev/null; rm -f model.py && echo changed > model.py",
            planted = planted.display()
        ),
    );
    assert!(out.text.contains("restored"), "{}", out.text);
    assert_eq!(
        secret_text(&f),
        before,
        "the restore wrote through the agent's link"
    );
    assert!(
        !planted.exists(),
        "the restore created a file the agent chose"
    );
    assert_eq!(
        std::fs::read_to_string(f.root.join("verify.py")).unwrap(),
        "print('pristine verify')\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.root.join("model.py")).unwrap(),
        "class Model: pass\n"
    );
}

/// A protected file replaced by a link, a FIFO or a directory is put back as the regular,
/// read-only, server-owned file, and the link's target is untouched.
#[test]
fn protected_files_replaced_by_links_fifos_or_directories_are_restored() {
    let mut f = fixture();
    let secret = f.secret.display().to_string();
    let before = secret_text(&f);
    for replace in [
        format!("rm -f verify.py && ln -s {secret} verify.py"),
        "rm -f verify.py && mkfifo verify.py".to_string(),
        "rm -f verify.py && mkdir -p verify.py/deeper && echo x > verify.py/deeper/file"
            .to_string(),
        "rm -f verify.py && ln -s . verify.py".to_string(),
    ] {
        let out = bash_ok(&mut f, &replace);
        assert!(out.text.contains("verify.py"), "{replace}: {}", out.text);
        let meta = std::fs::symlink_metadata(f.root.join("verify.py")).unwrap();
        assert!(
            meta.file_type().is_file(),
            "{replace}: {:?}",
            meta.file_type()
        );
        assert_eq!(meta.mode() & 0o7777, 0o444, "{replace}");
        assert_eq!(
            meta.uid(),
            unsafe { libc::geteuid() },
            "{replace}: owned by the server"
        );
        assert_eq!(
            std::fs::read_to_string(f.root.join("verify.py")).unwrap(),
            "print('pristine verify')\n"
        );
        assert_eq!(secret_text(&f), before, "{replace}");
    }
}

/// Read and MultiEdit of a FIFO used to block a server thread for good.
#[test]
fn read_and_edit_of_a_fifo_answer_at_once() {
    let mut f = fixture();
    bash_ok(
        &mut f,
        "mkfifo pipe && mkdir -p kernels && mkfifo kernels/k.cu",
    );
    let (f, out) = call_guarded(f, "Read", json!({"file_path": "pipe"}));
    assert!(out.is_error);
    assert!(out.text.contains("not a regular file"), "{}", out.text);
    let (f, out) = call_guarded(
        f,
        "MultiEdit",
        json!({"file_path": "kernels/k.cu", "edits": [{"old_string": "a", "new_string": "b"}]}),
    );
    assert!(out.is_error);
    assert!(out.text.contains("not a regular file"), "{}", out.text);
    let (f, out) = call_guarded(f, "Write", json!({"file_path": "pipe", "content": "x"}));
    assert!(
        out.is_error,
        "a write does not silently replace a FIFO: {}",
        out.text
    );
    assert!(std::fs::symlink_metadata(f.root.join("pipe"))
        .unwrap()
        .file_type()
        .is_fifo());
}

/// The working-directory record lives where the agent can write; a FIFO in its place used
/// to block the server thread reading it.
#[test]
fn working_directory_record_cannot_block_the_server() {
    let mut f = fixture();
    let (f, out) = call_guarded(
        {
            bash_ok(&mut f, "mkdir -p sub");
            f
        },
        "Bash",
        json!({"command": "cd sub && trap - EXIT && rm -f \"$CUDA_AGENT_CWD_FILE\" && mkfifo \"$CUDA_AGENT_CWD_FILE\""}),
    );
    assert!(!out.is_error, "{}", out.text);
    let (_f, out) = call_guarded(
        f,
        "Bash",
        json!({"command": "trap - EXIT && rm -f \"$CUDA_AGENT_CWD_FILE\" && head -c 100000000 /dev/zero | tr '\\0' / > \"$CUDA_AGENT_CWD_FILE\"; pwd"}),
    );
    assert!(!out.is_error, "{}", out.text);
}

/// 28 doubling replace_all edits in one small request asked for a 256 MiB file (31 for
/// 2 GiB, which aborted the server).
#[test]
fn multi_edit_cannot_grow_a_file_without_bound() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "a").unwrap();
    let edits: Vec<Value> = (0..28)
        .map(|_| json!({"old_string": "a", "new_string": "aa", "replace_all": true}))
        .collect();
    let out = call(
        &mut f,
        "MultiEdit",
        json!({"file_path": "a.py", "edits": edits}),
    );
    assert!(out.is_error, "{}", &out.text[..out.text.len().min(200)]);
    assert!(out.text.contains("limit"), "{}", out.text);
    assert_eq!(
        std::fs::read_to_string(f.root.join("a.py")).unwrap(),
        "a",
        "nothing written"
    );
    // One edit whose new text alone is over the cap.
    let big = "b".repeat(9 << 20);
    let out = call(
        &mut f,
        "MultiEdit",
        json!({"file_path": "a.py", "edits": [{"old_string": "a", "new_string": big}]}),
    );
    assert!(out.is_error);
    assert!(
        out.text.contains("limit"),
        "{}",
        &out.text[..out.text.len().min(300)]
    );
    // Write has the same cap.
    let out = call(
        &mut f,
        "Write",
        json!({"file_path": "big.py", "content": big}),
    );
    assert!(out.is_error);
    assert!(
        out.text.contains("limit"),
        "{}",
        &out.text[..out.text.len().min(300)]
    );
    assert!(!f.root.join("big.py").exists());
    // A short request naming thousands of nested directories.
    let out = call(
        &mut f,
        "Write",
        json!({"file_path": "d/".repeat(5_000) + "x", "content": "x"}),
    );
    assert!(
        out.is_error && out.text.contains("over the limit"),
        "{}",
        &out.text[..out.text.len().min(300)]
    );
    assert!(!f.root.join("d").exists());
}

/// Read of a huge file used to load all of it (a 900 MB file cost 1.7 GiB): only a capped
/// prefix is read, and the cut is said.
#[test]
fn read_of_a_huge_file_reads_a_capped_prefix() {
    let mut f = fixture();
    bash_ok(&mut f, "yes 'a line of text' | head -c 20000000 > big.txt");
    let out = call(
        &mut f,
        "Read",
        json!({"file_path": "big.txt", "offset": 1, "limit": 3}),
    );
    assert!(!out.is_error, "{}", out.text);
    assert!(
        out.text.starts_with("     1\ta line of text\n"),
        "{}",
        out.text
    );
    assert!(out.text.contains("only its first"), "{}", out.text);
    assert!(read_data(&out).truncated, "{:?}", out.data);
    assert!(read_data(&out).bytes_read <= 8 << 20, "{:?}", out.data);
    let out = call(
        &mut f,
        "Read",
        json!({"file_path": "big.txt", "offset": 1_000_000, "limit": 2}),
    );
    assert!(out.text.contains("only its first"), "{}", out.text);
}

/// Patterns built to blow up the matcher: 100,000 `*` panicked the handler.
#[test]
fn glob_survives_hostile_patterns() {
    let mut f = fixture();
    std::fs::write(f.root.join("a.py"), "x").unwrap();
    for pattern in [
        "*".repeat(100_000),
        "**/".repeat(2_000) + "*",
        "{a,b}".repeat(500),
        "[".repeat(5_000),
        "?".repeat(300),
    ] {
        let (g, out) = call_guarded(f, "Glob", json!({"pattern": pattern}));
        f = g;
        assert!(out.is_error, "{}", out.text);
        assert!(out.text.contains("pattern"), "{}", out.text);
    }
    let out = call(&mut f, "Glob", json!({"pattern": "a.*"}));
    assert_eq!(glob_data(&out).paths, ["a.py"]);
}

/// Deep trees and many entries: the walk is bounded and says it stopped.
#[test]
fn glob_walk_is_bounded() {
    let mut f = fixture();
    bash_ok(&mut f, "d=.; for i in $(seq 1 80); do d=$d/d; done; mkdir -p $d && touch $d/deep.cu && touch top.cu");
    let out = call(&mut f, "Glob", json!({"pattern": "**/*.cu"}));
    assert!(!out.is_error, "{}", out.text);
    assert!(glob_data(&out).paths.iter().any(|p| p == "top.cu"));
    assert!(out.text.contains("deeper than"), "{}", out.text);
}

/// Links are never followed by any file tool, whichever component they sit at, and a link
/// is never replaced by a write either.
#[test]
fn no_file_tool_follows_a_link_anywhere_in_the_path() {
    let mut f = fixture();
    let secret = f.secret.display().to_string();
    let server_dir = f.dir.path().join("server-state").display().to_string();
    bash_ok(
        &mut f,
        &format!("mkdir -p real && echo inside > real/in.txt && ln -s real alias && ln -s {secret} leak.txt && ln -s {server_dir} state && ln -s real/in.txt inner.txt"),
    );
    for path in [
        "alias/in.txt",
        "leak.txt",
        "state/hidden_seeds.json",
        "inner.txt",
    ] {
        let out = call(&mut f, "Read", json!({"file_path": path}));
        assert!(out.is_error, "{path}: {}", out.text);
        assert!(!out.text.contains("[1, 2, 3]"), "{path}: {}", out.text);
        let out = call(&mut f, "Write", json!({"file_path": path, "content": "x"}));
        assert!(out.is_error, "{path}: {}", out.text);
        let out = call(
            &mut f,
            "MultiEdit",
            json!({"file_path": path, "edits": [{"old_string": "inside", "new_string": "x"}]}),
        );
        assert!(out.is_error, "{path}: {}", out.text);
    }
    assert_eq!(
        std::fs::read_to_string(f.root.join("real/in.txt")).unwrap(),
        "inside\n"
    );
    assert!(std::fs::symlink_metadata(f.root.join("inner.txt"))
        .unwrap()
        .file_type()
        .is_symlink());
    let out = call(&mut f, "Glob", json!({"pattern": "**/*", "path": "alias"}));
    assert!(out.is_error, "{}", out.text);
    let out = call(&mut f, "Glob", json!({"pattern": "**/*"}));
    let paths = &glob_data(&out).paths;
    assert!(paths.iter().any(|p| p == "real/in.txt"), "{paths:?}");
    assert!(
        !paths
            .iter()
            .any(|p| p.starts_with("state/") || p.starts_with("alias/")),
        "{paths:?}"
    );
}

/// At Submit the solution used to be read as root by path: `model_new.py` or `kernels/` as
/// links to a host file put its contents in the trajectory log.
#[test]
fn collecting_the_solution_never_reads_through_a_link() {
    let mut f = fixture();
    let secret = f.secret.display().to_string();
    let server_dir = f.dir.path().join("server-state").display().to_string();
    bash_ok(
        &mut f,
        &format!(
            "rm -f model_new.py && ln -s {secret} model_new.py && mkdir -p kernels/sub && echo '__global__ void k() {{}}' > kernels/add.cu \
             && ln -s {secret} kernels/leak.cu && ln -s {server_dir} kernels/state && mkfifo kernels/pipe.cu \
             && printf 'ab\\0cd' > kernels/blob.o && echo 'int x;' > kernels/sub/x.cpp"
        ),
    );
    let solution = f
        .toolbox
        .workspace()
        .collect_solution(1 << 20)
        .expect("collected");
    let files: Vec<&str> = solution.files.keys().map(String::as_str).collect();
    assert_eq!(files, ["kernels/add.cu", "kernels/sub/x.cpp"]);
    assert!(
        !solution.files.values().any(|t| t.contains("[1, 2, 3]")),
        "a host file was read"
    );
    let skipped: Vec<(&str, &str)> = solution
        .skipped
        .iter()
        .map(|s| (s.path.as_str(), s.reason.as_str()))
        .collect();
    for (path, why) in [
        ("model_new.py", "symbolic link"),
        ("kernels/leak.cu", "symbolic link"),
        ("kernels/state", "symbolic link"),
        ("kernels/pipe.cu", "FIFO"),
        ("kernels/blob.o", "not UTF-8 text"),
    ] {
        assert!(
            skipped.iter().any(|(p, r)| *p == path && r.contains(why)),
            "{path}: {skipped:?}"
        );
    }
    let summary = solution.skipped_summary().expect("something was skipped");
    assert!(
        summary.contains("model_new.py (a symbolic link"),
        "{summary}"
    );

    // `kernels` itself a link to a host directory.
    bash_ok(&mut f, &format!("rm -rf kernels model_new.py && echo 'class ModelNew: pass' > model_new.py && ln -s {server_dir} kernels"));
    let solution = f
        .toolbox
        .workspace()
        .collect_solution(1 << 20)
        .expect("collected");
    assert_eq!(solution.files.keys().collect::<Vec<_>>(), ["model_new.py"]);
    assert_eq!(solution.skipped.len(), 1, "{:?}", solution.skipped);
    assert!(solution.skipped[0].reason.contains("symbolic link"));
}

/// The solution is bounded: in total bytes (an error naming the cap), in depth and in
/// entries (listed as skipped).
#[test]
fn collecting_the_solution_is_bounded() {
    let mut f = fixture();
    bash_ok(&mut f, "mkdir -p kernels && head -c 700000 /dev/zero | tr '\\0' a > kernels/a.cu && cp kernels/a.cu kernels/b.cu");
    let err = f
        .toolbox
        .workspace()
        .collect_solution(1 << 20)
        .expect_err("over the cap");
    assert!(
        err.to_string().contains("over the limit of 1048576 bytes"),
        "{err}"
    );
    bash_ok(&mut f, "rm -rf kernels && d=kernels; for i in $(seq 1 12); do d=$d/d; done; mkdir -p $d && echo deep > $d/deep.cu && echo top > kernels/top.cu");
    let solution = f
        .toolbox
        .workspace()
        .collect_solution(1 << 20)
        .expect("collected");
    assert!(solution.files.contains_key("kernels/top.cu"));
    assert!(!solution.files.keys().any(|k| k.ends_with("deep.cu")));
    assert!(
        solution
            .skipped
            .iter()
            .any(|s| s.reason.contains("deeper than")),
        "{:?}",
        solution.skipped
    );
}

/// Both ways of resolving paths (openat2, and the walk used where the kernel lacks it) refuse
/// links at every component and write only where they should.
#[test]
fn both_resolvers_refuse_links_at_every_component() {
    let f = fixture();
    for resolver in [
        agent_tools::workspace::Resolver::Openat2,
        agent_tools::workspace::Resolver::Walk,
    ] {
        if resolver == agent_tools::workspace::Resolver::Openat2
            && agent_tools::workspace::Resolver::detect() != resolver
        {
            continue;
        }
        let ws = agent_tools::Workspace::open(&f.root, f.toolbox.workspace().owner())
            .unwrap()
            .with_resolver(resolver);
        std::fs::create_dir_all(f.root.join("real/sub")).unwrap();
        let _ = std::fs::remove_file(f.root.join("alias"));
        std::os::unix::fs::symlink(f.dir.path().join("server-state"), f.root.join("alias"))
            .unwrap();
        let _ = std::fs::remove_file(f.root.join("real/up"));
        std::os::unix::fs::symlink("..", f.root.join("real/up")).unwrap();
        for path in [
            "alias/new.txt",
            "alias/hidden_seeds.json",
            "real/up/real/x.txt",
            "real/up/new.txt",
        ] {
            let err = ws
                .write_atomic(std::path::Path::new(path), b"x")
                .expect_err(path);
            assert!(
                err.to_string().contains("symbolic link"),
                "{resolver:?} {path}: {err}"
            );
        }
        assert!(!f.dir.path().join("server-state/new.txt").exists());
        ws.write_atomic(std::path::Path::new("real/sub/ok.txt"), b"fine")
            .expect("plain write");
        ws.write_atomic(&f.root.join("real/sub/abs.txt"), b"fine")
            .expect("absolute path inside");
        assert_eq!(
            std::fs::read_to_string(f.root.join("real/sub/ok.txt")).unwrap(),
            "fine"
        );
        let solution = ws
            .collect(
                &["alias/hidden_seeds.json", "real/sub/ok.txt"],
                &["real"],
                1 << 20,
            )
            .expect("collected");
        assert_eq!(
            solution.files.keys().collect::<Vec<_>>(),
            ["real/sub/abs.txt", "real/sub/ok.txt"],
            "{resolver:?}"
        );
        assert!(
            solution
                .skipped
                .iter()
                .any(|s| s.path == "alias/hidden_seeds.json"),
            "{resolver:?} {:?}",
            solution.skipped
        );
        assert!(
            solution.skipped.iter().any(|s| s.path == "real/up"),
            "{resolver:?} {:?}",
            solution.skipped
        );
    }
}

/// Where the kernel lets users hard-link files they cannot write (`fs.protected_hardlinks`
/// off), a second name for a host file inside the workspace would be read as root. The link
/// is made here by the test, as such a kernel would let the agent make it.
#[test]
fn hard_links_to_files_the_agent_does_not_own_are_not_read() {
    let mut f = fixture();
    if f.toolbox.workspace().owner().is_none() {
        return; // no uid of its own: the agent reads what the server reads anyway
    }
    std::fs::create_dir_all(f.root.join("kernels")).unwrap();
    std::fs::hard_link(&f.secret, f.root.join("kernels/h.cu")).unwrap();
    std::fs::hard_link(&f.secret, f.root.join("model_new.py")).unwrap();
    let out = call(&mut f, "Read", json!({"file_path": "kernels/h.cu"}));
    assert!(out.is_error, "{}", out.text);
    assert!(out.text.contains("hard link"), "{}", out.text);
    let out = call(
        &mut f,
        "MultiEdit",
        json!({"file_path": "model_new.py", "edits": [{"old_string": "seeds", "new_string": "x"}]}),
    );
    assert!(out.is_error, "{}", out.text);
    let solution = f
        .toolbox
        .workspace()
        .collect_solution(1 << 20)
        .expect("collected");
    assert!(solution.files.is_empty(), "{:?}", solution.files);
    assert_eq!(solution.skipped.len(), 2, "{:?}", solution.skipped);
    assert!(solution
        .skipped
        .iter()
        .all(|s| s.reason.contains("hard link")));
    // A Write replaces the name; the host file keeps its contents.
    let out = call(
        &mut f,
        "Write",
        json!({"file_path": "kernels/h.cu", "content": "mine"}),
    );
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(secret_text(&f), "{\"seeds\": [1, 2, 3]}");
}
