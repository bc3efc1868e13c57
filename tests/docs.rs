//! The docs name only what exists: every repository path, HTTP route, command-line flag, task
//! id and test name that the Markdown files cite in code spans and `sh` blocks is checked
//! against the checkout, the routers' sources, the built binaries' `--help` and the bundled
//! tasks. Every failure is reported at once, as `file:line`, the span and what was expected.
//!
//! Binaries come from `CUDA_AGENT_BIN_DIR` (else the target directory this test was built
//! in); one that is not built is skipped with a printed notice, as are Python scripts'
//! flags without `CUDA_AGENT_PYTHON`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The workspace's binaries, which the docs invoke by name.
const BINARIES: &[&str] = &[
    "env-server",
    "trainer",
    "kernelbench",
    "agent-runner",
    "sandbox-exec",
    "env-bench",
];

/// File-like and test-like spans that name nothing of the checkout and no name the code
/// uses, each with why it is right all the same: (doc, span, reason).
const NOT_REPO_NAMES: &[(&str, &str, &str)] = &[
    (
        "README.md",
        "runs/M/speedups.png",
        "the chart's path is the user's choice (`--png`)",
    ),
    (
        "tests/redteam/README.md",
        "non_default_stream_kernel",
        "a test of KernelBench's adversarial suite, cited as a source",
    ),
    (
        "tests/redteam/README.md",
        "reward_hacking.py",
        "KernelBench's module, cited as a source",
    ),
    (
        "README.md",
        "train.py",
        "the user's own TRL training script",
    ),
    (
        "README.md",
        "my_module.py",
        "the user's module handed to `agent-runner optimize`",
    ),
    (
        "README.md",
        "L1_1_ReLU.py",
        "an example of the solution file names `kernelbench replay` reads",
    ),
    (
        "README.md",
        "level_1_problem_1_sample_0_kernel.py",
        "an example of KernelBench's solution file names, which `kernelbench replay` reads",
    ),
];

/// Flags of other programs that the docs name without their command: (flag, program).
const FOREIGN_FLAGS: &[(&str, &str)] = &[("--build-arg", "docker build, in docs/DEPLOY.md")];

/// File name endings that make a span a file name even without a `/`.
const EXTENSIONS: &[&str] = &[
    "rs",
    "py",
    "sh",
    "toml",
    "md",
    "json",
    "jsonl",
    "txt",
    "yaml",
    "yml",
    "png",
    "lock",
    "cu",
    "cpp",
    "h",
    "log",
    "csv",
    "safetensors",
];

/// One code span, or one line of an `sh` block, of a Markdown file.
#[derive(Clone)]
struct Span {
    doc: String,
    line: usize,
    text: String,
    /// A line of a fenced block, and the block's language.
    fence: Option<String>,
    /// The paragraph cites another repository (`github.com/...`): its paths are that
    /// repository's.
    external: bool,
    /// A table row whose first cell is a directory of the checkout (`trainer/`): the row's
    /// relative paths are inside it.
    scope: Option<String>,
}

/// Everything a check reads of the checkout, gathered once.
struct Repo {
    files: BTreeSet<String>,
    dirs: BTreeSet<String>,
    top: BTreeSet<String>,
    /// Every path-like word of the source files (not Markdown), each of its `/`-separated
    /// segments and each of its tails: the names the code reads and writes.
    names: HashSet<String>,
    /// Every identifier in the source files.
    idents: HashSet<String>,
    /// Every `--flag` the source files spell out (argparse, shell scripts, string literals).
    source_flags: HashSet<String>,
    /// Route path -> methods, of env-server's and the trainer's routers.
    routes: BTreeMap<String, BTreeSet<String>>,
    /// Bundled task ids (`L1/2_Add`).
    tasks: BTreeSet<String>,
}

fn root() -> PathBuf {
    Path::new(ROOT).canonicalize().expect("repository root")
}

/// The checkout's files, relative to its root: git's tracked and not-ignored ones, or where
/// there is no git, a walk that leaves out build outputs and caches.
fn git_files() -> Vec<String> {
    let root = root();
    let out = Command::new("git")
        .args(["ls-files", "-co", "--exclude-standard"])
        .current_dir(&root)
        .output();
    if let Some(out) = out.ok().filter(|o| o.status.success()) {
        return String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .filter(|f| root.join(f).exists())
            .collect();
    }
    let mut files = Vec::new();
    let mut todo = vec![root.clone()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if path.is_dir() {
                let skip = ["target", ".git", "__pycache__", ".pytest_cache", "data"];
                if !skip.contains(&name.as_str()) {
                    todo.push(path);
                }
            } else if let Ok(rel) = path.strip_prefix(&root) {
                files.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    files
}

fn ext_of(name: &str) -> Option<&str> {
    let base = name.rsplit('/').next().unwrap_or(name);
    base.rsplit_once('.').map(|(_, e)| e)
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl Repo {
    fn load() -> Self {
        let files: BTreeSet<String> = git_files().into_iter().collect();
        let mut dirs = BTreeSet::new();
        for f in &files {
            let mut p = f.as_str();
            while let Some((d, _)) = p.rsplit_once('/') {
                dirs.insert(d.to_string());
                p = d;
            }
        }
        let top = files
            .iter()
            .map(|f| f.split('/').next().unwrap().to_string())
            .collect();
        let mut source = String::new();
        for f in &files {
            let code = matches!(
                ext_of(f),
                Some("rs" | "py" | "sh" | "toml" | "yaml" | "yml" | "json" | "txt")
            ) || f.starts_with(".ci/")
                || f.contains("Containerfile");
            // This file's own strings are examples of stale names, not names the code uses.
            if code && !f.starts_with("vendor/") && f != "tests/docs.rs" {
                if let Ok(t) = std::fs::read_to_string(root().join(f)) {
                    source.push_str(&t);
                    source.push('\n');
                }
            }
        }
        // The vendored crates' items count as identifiers (vendor/README.md names them), not
        // their paths and strings.
        let mut vendored = String::new();
        for f in files
            .iter()
            .filter(|f| f.starts_with("vendor/") && f.ends_with(".rs"))
        {
            vendored.push_str(&std::fs::read_to_string(root().join(f)).unwrap_or_default());
        }
        let idents = [&source, &vendored]
            .into_iter()
            .flat_map(|t| t.split(|c: char| !is_ident_char(c)))
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect();
        let mut names = HashSet::new();
        for w in source.split(|c: char| !(is_ident_char(c) || matches!(c, '.' | '-' | '/'))) {
            let w = w.trim_matches(['/', '.']);
            let segments: Vec<&str> = w.split('/').filter(|s| !s.is_empty()).collect();
            for i in 0..segments.len() {
                names.insert(segments[i].to_string());
                names.insert(segments[i..].join("/"));
            }
        }
        let source_flags = flag_words(&source);
        let mut routes = BTreeMap::new();
        for f in ["env-server/src/api.rs", "trainer/src/serve/mod.rs"] {
            let text = std::fs::read_to_string(root().join(f)).expect(f);
            for (path, methods) in parse_routes(&text) {
                routes
                    .entry(path)
                    .or_insert_with(BTreeSet::new)
                    .extend(methods);
            }
        }
        assert!(
            routes.contains_key("/v1/episodes"),
            "no routes parsed from the routers: {routes:?}"
        );
        let tasks = files
            .iter()
            .filter_map(|f| {
                let rest = f.strip_prefix("kernelbench/tasks/level")?;
                let (level, file) = rest.split_once('/')?;
                Some(format!("L{level}/{}", file.strip_suffix(".py")?))
            })
            .collect();
        Repo {
            files,
            dirs,
            top,
            names,
            idents,
            source_flags,
            routes,
            tasks,
        }
    }

    /// `rel` is a file or directory of the checkout; `*` matches within one segment.
    fn exists(&self, rel: &str) -> bool {
        let rel = rel.trim_end_matches('/');
        if !rel.contains('*') {
            return self.files.contains(rel) || self.dirs.contains(rel);
        }
        self.files
            .iter()
            .chain(&self.dirs)
            .any(|f| glob_match(rel, f))
    }

    /// Some file (or directory) under `dir` ends with `tail` at a segment boundary.
    fn has_tail_under(&self, dir: &str, tail: &str) -> bool {
        let tail = tail.trim_end_matches('/');
        let suffix = format!("/{tail}");
        let prefix = format!("{dir}/");
        self.files
            .iter()
            .chain(&self.dirs)
            .any(|f| f.starts_with(&prefix) && (f.ends_with(&suffix) || f[prefix.len()..] == *tail))
    }

    /// Some file (or directory) of the checkout ends with `tail` at a segment boundary.
    fn has_tail(&self, tail: &str) -> bool {
        let tail = tail.trim_end_matches('/');
        let suffix = format!("/{tail}");
        self.files
            .iter()
            .chain(&self.dirs)
            .any(|f| f == tail || f.ends_with(&suffix))
    }
}

/// `pattern` with `*` within a segment matches `path` whole.
fn glob_match(pattern: &str, path: &str) -> bool {
    let (ps, fs): (Vec<_>, Vec<_>) = (pattern.split('/').collect(), path.split('/').collect());
    ps.len() == fs.len() && ps.iter().zip(&fs).all(|(p, f)| segment_match(p, f))
}

fn segment_match(p: &str, f: &str) -> bool {
    match p.split_once('*') {
        None => p == f,
        Some((head, tail)) => {
            f.len() >= head.len() + tail.len() && f.starts_with(head) && f.ends_with(tail)
        }
    }
}

/// The routes of an axum router's source: `.route("PATH", get(a).delete(b))`.
fn parse_routes(src: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut out = Vec::new();
    for (i, _) in src.match_indices(".route(") {
        let rest = &src[i + ".route(".len()..];
        // The call's arguments, up to its closing parenthesis.
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map_or(rest.len(), |(j, _)| j);
        let args = &rest[..end];
        let Some(path) = args.split('"').nth(1) else {
            continue;
        };
        let handlers = &args[args.find(',').unwrap_or(0)..];
        let mut methods = BTreeSet::new();
        for m in ["get", "post", "put", "patch", "delete", "any"] {
            for (k, _) in handlers.match_indices(&format!("{m}(")) {
                let before = handlers[..k].chars().last();
                if !before.is_some_and(is_ident_char) {
                    methods.insert(m.to_uppercase());
                }
            }
        }
        out.push((path.to_string(), methods));
    }
    out
}

/// The Markdown files the test reads: every tracked one but fixtures and the upstream
/// READMEs of vendored crates.
fn docs(repo: &Repo) -> Vec<String> {
    repo.files
        .iter()
        .filter(|f| f.ends_with(".md"))
        .filter(|f| !f.contains("/fixtures/"))
        .filter(|f| !f.starts_with("vendor/") || *f == "vendor/README.md")
        .cloned()
        .collect()
}

/// Code spans (joined across line breaks, within a paragraph) and fenced blocks' lines (a
/// line ending in `\` joined with the next).
fn spans(doc: &str, text: &str) -> Vec<Span> {
    let mut out = Vec::new();
    let mut fence: Option<String> = None;
    let mut para: Vec<(usize, &str)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    let flush = |para: &mut Vec<(usize, &str)>, out: &mut Vec<Span>| {
        inline_spans(doc, para, out);
        para.clear();
    };
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = line.trim_start();
        if let Some(lang) = trimmed.strip_prefix("```") {
            if fence.is_some() {
                fence = None;
            } else {
                flush(&mut para, &mut out);
                fence = Some(lang.trim().to_string());
            }
            continue;
        }
        if let Some(lang) = &fence {
            let (start, mut joined) = pending.take().unwrap_or((n, String::new()));
            joined.push_str(line.trim_end_matches('\\'));
            if line.ends_with('\\') {
                joined.push(' ');
                pending = Some((start, joined));
            } else {
                out.push(Span {
                    doc: doc.to_string(),
                    line: start,
                    text: joined,
                    fence: Some(lang.clone()),
                    external: false,
                    scope: None,
                });
            }
            continue;
        }
        if line.trim().is_empty() {
            flush(&mut para, &mut out);
        } else if trimmed.starts_with('|') {
            // A table row is a paragraph of its own.
            flush(&mut para, &mut out);
            para.push((n, line));
            flush(&mut para, &mut out);
        } else {
            para.push((n, line));
        }
    }
    flush(&mut para, &mut out);
    out
}

fn inline_spans(doc: &str, para: &[(usize, &str)], out: &mut Vec<Span>) {
    // (char, line) of the paragraph, lines joined by a space.
    let chars: Vec<(char, usize)> = para
        .iter()
        .flat_map(|&(n, l)| l.chars().chain([' ']).map(move |c| (c, n)))
        .collect();
    let run = |at: usize| chars[at..].iter().take_while(|c| c.0 == '`').count();
    let external = para.iter().any(|(_, l)| l.contains("github.com/"));
    let scope = match para {
        [(_, row)] if row.trim_start().starts_with('|') => row
            .split('|')
            .nth(1)
            .map(str::trim)
            .and_then(|c| c.strip_prefix('`')?.strip_suffix("/`"))
            .filter(|d| !d.contains(['`', ' ']))
            .map(str::to_string),
        _ => None,
    };
    let mut i = 0;
    while i < chars.len() {
        if chars[i].0 != '`' {
            i += 1;
            continue;
        }
        let ticks = run(i);
        let start = i + ticks;
        let mut j = start;
        let mut close = None;
        while j < chars.len() {
            if chars[j].0 == '`' {
                let r = run(j);
                if r == ticks {
                    close = Some(j);
                    break;
                }
                j += r;
            } else {
                j += 1;
            }
        }
        let Some(close) = close else {
            break;
        };
        let text: String = chars[start..close].iter().map(|c| c.0).collect();
        out.push(Span {
            doc: doc.to_string(),
            line: chars[i].1,
            text: text.trim().to_string(),
            fence: None,
            external,
            scope: scope.clone(),
        });
        i = close + ticks;
    }
}

/// Whitespace-separated words, stripped of the punctuation prose and usage lines put around
/// them.
fn words(text: &str) -> Vec<String> {
    text.split_whitespace()
        .map(|w| {
            w.trim_matches(|c: char| matches!(c, '(' | ')' | '[' | ']' | ',' | ';' | '"' | '\''))
                .trim_end_matches(['.', ':'])
                .to_string()
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// The command part of a fenced line: no shell comment.
fn command_part(text: &str) -> &str {
    if text.trim_start().starts_with('#') {
        return "";
    }
    text.find(" #").map_or(text, |i| &text[..i])
}

/// A span's text is a task id (`L1/2_Add`), possibly as a solution file (`.py`).
fn task_id(word: &str) -> Option<&str> {
    let (level, rest) = word.split_once('/')?;
    let ok_level = level.len() == 2
        && level.starts_with('L')
        && level[1..].chars().all(|c| c.is_ascii_digit());
    let stem = rest.strip_suffix(".py").unwrap_or(rest);
    let ok_stem = stem.split_once('_').is_some_and(|(n, name)| {
        !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) && !name.is_empty()
    }) && stem.chars().all(is_ident_char);
    (ok_level && ok_stem).then(|| &word[..level.len() + 1 + stem.len()])
}

/// `DIR`, `DATA_DIR`, `M`, or a lowercase stem with an uppercase tail (`slotN`).
fn is_placeholder_segment(s: &str) -> bool {
    let stem =
        s.trim_end_matches(|c: char| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    stem.len() < s.len()
        && s[stem.len()..].starts_with(|c: char| c.is_ascii_uppercase())
        && stem
            .chars()
            .all(|c| c.is_ascii_lowercase() || c == '-' || c == '_')
}

/// Failures, each `doc:line: `span`: what was expected`.
#[derive(Default)]
struct Report {
    failures: Vec<(String, String)>,
    notices: BTreeSet<String>,
    checked: BTreeMap<&'static str, usize>,
}

impl Report {
    fn fail(&mut self, span: &Span, what: impl std::fmt::Display) {
        self.failures.push((
            span.doc.clone(),
            format!("{}:{}: `{}`: {what}", span.doc, span.line, span.text),
        ));
    }
    fn count(&mut self, kind: &'static str) {
        *self.checked.entry(kind).or_default() += 1;
    }
}

fn check_paths(repo: &Repo, span: &Span, text: &str, report: &mut Report) {
    if span.external {
        return;
    }
    for w in words(text) {
        let w = w.strip_prefix("./").unwrap_or(&w);
        if w.starts_with(['/', '~', '$', '-', '.', '<', '*'])
            || w.contains("://")
            || w.contains(['<', '>', '{', '}', '=', '@', '`', '|'])
            || w.contains("...")
            || w.starts_with("localhost:")
            || task_id(w).is_some()
        {
            // Absolute and runtime paths, placeholders, routes and flags are no repository
            // paths; `.ci/` is the one hidden directory cited, and it is a top-level entry.
            if !w.starts_with(".ci/") {
                continue;
            }
        }
        // `file.py:LINE` cites a line of a file.
        let w = match w.split_once(':') {
            Some((file, _)) if ext_of(file).is_some() => file,
            Some(_) => continue,
            None => w,
        };
        let first = w.split('/').next().unwrap();
        let ext = ext_of(w).filter(|e| EXTENSIONS.contains(e));
        let has_slash = w.contains('/');
        if has_slash && repo.top.contains(first) && !is_placeholder_segment(first) {
            report.count("path");
            let placeholder = w.split('/').any(is_placeholder_segment);
            // A crate's README may name paths from its own directory.
            let local = Path::new(&span.doc)
                .parent()
                .and_then(Path::to_str)
                .filter(|d| !d.is_empty())
                .is_some_and(|d| repo.exists(&format!("{d}/{w}")));
            if !placeholder && !local && !repo.exists(w) {
                report.fail(span, format!("no `{w}` in the checkout"));
            }
            continue;
        }
        if ext.is_none() && !(has_slash && w.ends_with('/')) {
            continue;
        }
        // Not rooted at the checkout: a path inside a crate (`src/lib.rs`), or a name the
        // code writes at run time (`results.jsonl`); after a placeholder, only the last
        // segment is checked.
        let segments: Vec<&str> = w.split('/').filter(|s| !s.is_empty()).collect();
        let tail = match segments.iter().rposition(|s| is_placeholder_segment(s)) {
            // `judge-cache/slotN/`: what comes before the placeholder.
            Some(p) if p + 1 == segments.len() => match segments[..p].last() {
                Some(s) if !s.chars().any(|c| c.is_ascii_uppercase()) => s.to_string(),
                _ => continue,
            },
            Some(p) => segments[p + 1..].join("/"),
            None => segments.join("/"),
        };
        if tail.contains('*')
            || !tail
                .chars()
                .all(|c| is_ident_char(c) || matches!(c, '/' | '.' | '-'))
        {
            continue;
        }
        if NOT_REPO_NAMES
            .iter()
            .any(|(doc, s, _)| *doc == span.doc && *s == w)
        {
            continue;
        }
        report.count("path");
        let name = tail.rsplit('/').next().unwrap();
        let found = match &span.scope {
            Some(dir) if repo.dirs.contains(dir) => repo.has_tail_under(dir, &tail),
            _ => repo.has_tail(&tail),
        };
        if !found && !repo.names.contains(&tail) && !repo.names.contains(name) {
            report.fail(
                span,
                format!(
                    "`{w}` is no file of the checkout (nor the end of a path) and no name the code uses"
                ),
            );
        }
    }
}

/// `GET /v1/x`, or a bare `/v1/...`, `/mcp`, `/metrics`, or a URL's path on the server.
fn check_routes(repo: &Repo, span: &Span, text: &str, report: &mut Report) {
    let ws: Vec<&str> = text.split_whitespace().collect();
    for (i, raw) in ws.iter().enumerate() {
        let method = i
            .checked_sub(1)
            .map(|j| ws[j].trim_start_matches(['(', '`']))
            .filter(|m| ["GET", "POST", "PUT", "PATCH", "DELETE"].contains(m));
        let w = raw.trim_matches(|c: char| matches!(c, '(' | ')' | ',' | ';' | '\'' | '"' | '`'));
        let path = if let Some(p) = w.find("://") {
            match w[p + 3..].find('/') {
                Some(q) => &w[p + 3 + q..],
                None => continue,
            }
        } else if let Some(q) = w.find(":8080/").or_else(|| w.find(":8000/")) {
            &w[q + 5..]
        } else if w.starts_with('/') {
            w
        } else {
            continue;
        };
        let path = path
            .split(['?', '#'])
            .next()
            .unwrap()
            .trim_end_matches(['.', ':']);
        let first = path.trim_start_matches('/').split('/').next().unwrap();
        if !["v1", "mcp", "metrics", "health"].contains(&first) {
            continue;
        }
        // A base URL (`http://127.0.0.1:8000/v1`) is no route.
        if path == "/v1" || path == "/v1/" {
            continue;
        }
        report.count("route");
        let found = repo.routes.iter().any(|(route, methods)| {
            route_match(route, path)
                && method.is_none_or(|m| methods.contains(m) || methods.contains("ANY"))
        });
        if !found {
            let m = method.map(|m| format!("{m} ")).unwrap_or_default();
            report.fail(
                span,
                format!("no route {m}{path} in env-server's or the trainer's router"),
            );
        }
    }
}

fn route_match(route: &str, path: &str) -> bool {
    let r: Vec<&str> = route.trim_start_matches('/').split('/').collect();
    let p: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let wild = |s: &str| {
        s.starts_with('{') || s.starts_with('$') || s.starts_with('<') || s == "ID" || s == "..."
    };
    if r.last().is_some_and(|s| s.starts_with("{*")) {
        return p.len() >= r.len()
            && r[..r.len() - 1]
                .iter()
                .zip(&p)
                .all(|(a, b)| a == b || wild(a) || wild(b));
    }
    r.len() == p.len() && r.iter().zip(&p).all(|(a, b)| a == b || wild(a) || wild(b))
}

fn check_tasks(repo: &Repo, span: &Span, text: &str, report: &mut Report) {
    for w in text.split(|c: char| !(is_ident_char(c) || c == '/' || c == '.')) {
        let w = w.trim_end_matches('.');
        if let Some(id) = task_id(w) {
            report.count("task id");
            if !repo.tasks.contains(id) {
                report.fail(
                    span,
                    format!("no bundled task `{id}` under kernelbench/tasks/"),
                );
            }
        }
    }
}

/// A span of four or more snake_case words names a test (or a red-team case, or another
/// identifier of the code): it must appear as a word in the sources.
fn check_test_names(repo: &Repo, span: &Span, report: &mut Report) {
    let t = span.text.as_str();
    if span.external
        || NOT_REPO_NAMES
            .iter()
            .any(|(doc, s, _)| *doc == span.doc && *s == t)
    {
        return;
    }
    let snake = t.split('_').count() >= 4
        && t.starts_with(|c: char| c.is_ascii_lowercase())
        && t.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !t.contains("__");
    if !snake {
        return;
    }
    report.count("test name");
    if !repo.idents.contains(t) {
        report.fail(
            span,
            "no test, case or identifier of that name in the sources",
        );
    }
}

/// The project's environment variables (`CUDA_AGENT_*`, `REDTEAM_*`) are read somewhere.
fn check_env_vars(repo: &Repo, span: &Span, text: &str, report: &mut Report) {
    for w in text.split(|c: char| !is_ident_char(c)) {
        let ours = w.starts_with("CUDA_AGENT_") || w.starts_with("REDTEAM_");
        if !ours || w.ends_with('_') || w.chars().any(|c| c.is_ascii_lowercase()) {
            continue;
        }
        report.count("env var");
        if !repo.idents.contains(w) {
            report.fail(span, format!("no source reads `{w}`"));
        }
    }
}

/// A Rust path (`EpisodeManager::reset`, `drain::Work`, `aten::add`): each of its names must
/// be an identifier of the sources.
fn check_items(repo: &Repo, span: &Span, report: &mut Report) {
    let t = span.text.strip_suffix("()").unwrap_or(&span.text);
    let segments: Vec<&str> = t.split("::").collect();
    let item = segments.len() >= 2
        && segments.iter().all(|s| {
            s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && s.chars().all(is_ident_char)
        });
    if !item || span.external {
        return;
    }
    report.count("item");
    let missing: Vec<&&str> = segments
        .iter()
        .filter(|s| !repo.idents.contains(**s))
        .collect();
    if !missing.is_empty() {
        report.fail(span, format!("no identifier {missing:?} in the sources"));
    }
}

/// What `--help` prints, per program and subcommand.
struct Helps {
    bin_dir: Option<PathBuf>,
    python: Option<PathBuf>,
    cache: HashMap<Vec<String>, Option<String>>,
}

impl Helps {
    fn new() -> Self {
        let bin_dir = std::env::var_os("CUDA_AGENT_BIN_DIR")
            .map(PathBuf::from)
            .or_else(|| {
                let exe = std::env::current_exe().ok()?;
                Some(exe.parent()?.parent()?.to_path_buf())
            });
        let python = std::env::var_os("CUDA_AGENT_PYTHON").map(PathBuf::from);
        Helps {
            bin_dir,
            python,
            cache: HashMap::new(),
        }
    }

    /// Runs the `--help` of these scripts at once (each imports torch: seconds apiece).
    fn prefetch(&mut self, argvs: BTreeSet<Vec<String>>, notices: &mut BTreeSet<String>) {
        if self.python.is_none() || argvs.is_empty() {
            return;
        }
        let lanes = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .max(2);
        let argvs: Vec<Vec<String>> = argvs.into_iter().collect();
        let results: Vec<(Vec<String>, Option<String>, BTreeSet<String>)> =
            std::thread::scope(|s| {
                let handles: Vec<_> = argvs
                    .chunks(argvs.len().div_ceil(lanes))
                    .map(|chunk| {
                        let mut lane = Helps {
                            bin_dir: self.bin_dir.clone(),
                            python: self.python.clone(),
                            cache: HashMap::new(),
                        };
                        s.spawn(move || {
                            chunk
                                .iter()
                                .map(|a| {
                                    let mut n = BTreeSet::new();
                                    let h = lane.help(a, &mut n);
                                    (a.clone(), h, n)
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("help lane"))
                    .collect()
            });
        for (argv, help, n) in results {
            notices.extend(n);
            self.cache.insert(argv, help);
        }
    }

    /// `argv --help`'s output (stdout and stderr), or None where the program is absent.
    fn help(&mut self, argv: &[String], notices: &mut BTreeSet<String>) -> Option<String> {
        if let Some(h) = self.cache.get(argv) {
            return h.clone();
        }
        let prog = &argv[0];
        let mut cmd = if prog.ends_with(".py") {
            match &self.python {
                Some(py) => {
                    let mut c = Command::new(py);
                    c.arg(prog);
                    c
                }
                None => {
                    notices.insert(format!(
                        "skipped the flags of {prog}: CUDA_AGENT_PYTHON is not set"
                    ));
                    self.cache.insert(argv.to_vec(), None);
                    return None;
                }
            }
        } else {
            let bin = self.bin_dir.as_ref().map(|d| d.join(prog));
            match bin.filter(|b| b.is_file()) {
                Some(b) => Command::new(b),
                None => {
                    notices.insert(format!(
                        "skipped the flags of {prog}: not built in {:?} (cargo build --workspace --bins, or set CUDA_AGENT_BIN_DIR)",
                        self.bin_dir
                    ));
                    self.cache.insert(argv.to_vec(), None);
                    return None;
                }
            }
        };
        let out = cmd
            .args(&argv[1..])
            .arg("--help")
            .current_dir(root())
            .output()
            .ok()
            .map(|o| {
                let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
                s.push_str(&String::from_utf8_lossy(&o.stderr));
                s
            });
        self.cache.insert(argv.to_vec(), out.clone());
        out
    }
}

/// Every `--flag` of a text.
fn flag_words(text: &str) -> HashSet<String> {
    text.match_indices("--")
        .filter(|&(i, _)| !text[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '-'))
        .map(|(i, _)| {
            let rest = &text[i + 2..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(rest.len());
            format!("--{}", &rest[..end])
        })
        .filter(|f| f.len() > 2)
        .collect()
}

/// `--flag` appears in a help text as a whole flag.
fn lists_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(i, _)| {
        let next = help[i + flag.len()..].chars().next();
        let prev = help[..i].chars().last();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            && !prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

fn flags_of(ws: &[String]) -> Vec<String> {
    ws.iter()
        .filter(|w| w.starts_with("--") && w[2..].starts_with(|c: char| c.is_ascii_lowercase()))
        .map(|w| {
            let w = w.split('=').next().unwrap();
            w.trim_end_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .to_string()
        })
        .collect()
}

/// The commands that subcommand listings of a `--help` name.
fn subcommands(help: &str) -> BTreeSet<String> {
    let mut subs = BTreeSet::new();
    let mut on = false;
    for l in help.lines() {
        if l.starts_with("Commands:") {
            on = true;
        } else if on && l.starts_with("  ") && !l.starts_with("   ") {
            if let Some(w) = l.split_whitespace().next() {
                subs.insert(w.to_string());
            }
        } else if on && !l.starts_with(' ') {
            on = false;
        }
    }
    subs.remove("help");
    subs
}

/// What a span's words run.
enum Invocation {
    /// A program of the project (binary name, script path) and the words after it.
    Ours(String, Vec<String>),
    /// Another program (`cargo build`, `docker`, `python -m pytest`): its flags are its own.
    Foreign,
    /// Flags without a command (`--max-builds` in prose).
    Lone,
}

/// The interpreter words that run a Python script.
fn is_python(w: &str) -> bool {
    let base = w.rsplit('/').next().unwrap();
    matches!(base, "python" | "python3" | "$CUDA_AGENT_PYTHON")
}

fn find_command(repo: &Repo, ws: &[String]) -> Invocation {
    for (i, w) in ws.iter().enumerate() {
        let base = w.rsplit('/').next().unwrap();
        if BINARIES.contains(&base) && (i == 0 || !ws[i - 1].starts_with('-')) {
            return Invocation::Ours(base.to_string(), ws[i + 1..].to_vec());
        }
        if w == "cargo" && ws.get(i + 1).is_some_and(|r| r == "run") {
            let rest = &ws[i + 2..];
            let Some(pkg) = rest
                .windows(2)
                .find(|p| p[0] == "-p" || p[0] == "--bin")
                .map(|p| p[1].clone())
            else {
                return Invocation::Foreign;
            };
            let after = rest
                .iter()
                .position(|w| w == "--")
                .map_or(&[][..], |p| &rest[p + 1..]);
            return Invocation::Ours(pkg, after.to_vec());
        }
        let interp = i > 0 && is_python(&ws[i - 1]);
        if w.ends_with(".py") && !w.contains(['<', '*']) && (interp || i == 0) {
            // A script by its path, or by its name alone: the harness's in the agent's
            // workspace (SKILL.md), a benchmark's in scripts/.
            let path = [w.clone(), format!("skills/{w}"), format!("scripts/{w}")]
                .into_iter()
                .find(|p| repo.files.contains(p));
            return match path {
                Some(p) => Invocation::Ours(p, ws[i + 1..].to_vec()),
                None => Invocation::Foreign,
            };
        }
        if w.ends_with(".sh") && repo.files.contains(w.as_str()) && i == 0 {
            return Invocation::Ours(w.clone(), ws[i + 1..].to_vec());
        }
        // Environment assignments and interpreters come before the program.
        if w.contains('=') && !w.starts_with('-') || is_python(w) {
            continue;
        }
        return if w.starts_with("--") {
            Invocation::Lone
        } else {
            Invocation::Foreign
        };
    }
    Invocation::Lone
}

fn check_command(
    repo: &Repo,
    helps: &mut Helps,
    span: &Span,
    text: &str,
    report: &mut Report,
) -> Vec<String> {
    let ws = words(text);
    let (prog, args) = match find_command(repo, &ws) {
        Invocation::Ours(prog, args) => (prog, args),
        Invocation::Foreign => return Vec::new(),
        // A flag named without its command: some command of the project must take it.
        Invocation::Lone => return flags_of(&ws),
    };
    let flags = flags_of(&args);
    if prog.ends_with(".sh") {
        let text = std::fs::read_to_string(root().join(&prog)).unwrap_or_default();
        for f in flags {
            report.count("flag");
            if !text.contains(&f) {
                report.fail(span, format!("{prog} takes no `{f}`"));
            }
        }
        return Vec::new();
    }
    if prog.ends_with(".py") && flags.is_empty() {
        // A script's `--help` imports what it imports (torch: seconds): only for flags.
        return Vec::new();
    }
    let mut argv = vec![prog.clone()];
    let Some(main) = helps.help(&argv, &mut report.notices) else {
        return Vec::new();
    };
    let subs = subcommands(&main);
    let first = args
        .first()
        .filter(|a| !a.starts_with('-') && !a.contains(['/', '.', '=']));
    let mut sub_help = None;
    if let Some(sub) = first {
        // argparse lists its subcommands as `{a,b}`.
        let py_sub = prog.ends_with(".py")
            && (main.contains(&format!("{{{sub},"))
                || main.contains(&format!(",{sub}}}"))
                || main.contains(&format!("{{{sub}}}")));
        if subs.contains(sub.as_str()) || py_sub {
            argv.push(sub.clone());
            sub_help = helps.help(&argv, &mut report.notices);
        } else if !subs.is_empty() && !prog.ends_with(".py") {
            report.count("subcommand");
            report.fail(
                span,
                format!("`{prog}` has no subcommand `{sub}` (it has {subs:?})"),
            );
        }
    }
    for f in flags {
        report.count("flag");
        let ok = sub_help.as_deref().is_some_and(|h| lists_flag(h, &f)) || lists_flag(&main, &f);
        if !ok {
            report.fail(
                span,
                format!("`{}` does not list `{f}` in its --help", argv.join(" ")),
            );
        }
    }
    Vec::new()
}

/// Runs every check over the spans of `docs` (path, text).
fn check_docs(repo: &Repo, helps: &mut Helps, docs: &[(String, String)]) -> Report {
    let mut report = Report::default();
    let all: Vec<Span> = docs.iter().flat_map(|(d, t)| spans(d, t)).collect();
    let scripts = all
        .iter()
        .filter(|s| matches!(s.fence.as_deref(), None | Some("sh" | "bash")))
        .filter_map(
            |s| match find_command(repo, &words(command_part(&s.text))) {
                Invocation::Ours(p, args) if p.ends_with(".py") && !flags_of(&args).is_empty() => {
                    Some(vec![p])
                }
                _ => None,
            },
        )
        .collect();
    helps.prefetch(scripts, &mut report.notices);
    let mut lone_flags: Vec<(Span, String)> = Vec::new();
    for span in all {
        let text = match span.fence.as_deref() {
            // A shell line: everything but its comment.
            Some("sh" | "bash") => command_part(&span.text).to_string(),
            None => span.text.clone(),
            // Other blocks (diagrams, tables of numbers, Python, YAML): task ids only.
            Some(_) => {
                check_tasks(repo, &span, &span.text, &mut report);
                continue;
            }
        };
        check_paths(repo, &span, &text, &mut report);
        check_routes(repo, &span, &span.text, &mut report);
        check_tasks(repo, &span, &span.text, &mut report);
        check_env_vars(repo, &span, &text, &mut report);
        if span.fence.is_none() {
            check_test_names(repo, &span, &mut report);
            check_items(repo, &span, &mut report);
        }
        let flags = check_command(repo, helps, &span, &text, &mut report);
        lone_flags.extend(flags.into_iter().map(|f| (span.clone(), f)));
    }
    check_lone_flags(repo, helps, &lone_flags, &mut report);
    report
}

#[test]
fn the_docs_name_only_what_exists() {
    let repo = Repo::load();
    let mut helps = Helps::new();
    let docs: Vec<(String, String)> = docs(&repo)
        .into_iter()
        .map(|d| {
            let text = std::fs::read_to_string(root().join(&d)).expect(&d);
            (d, text)
        })
        .collect();
    assert!(
        docs.iter().any(|(d, _)| d == "README.md") && docs.len() >= 6,
        "too few docs found"
    );
    let report = check_docs(&repo, &mut helps, &docs);
    // An exception whose span left its doc is one to remove.
    for (doc, span, _) in NOT_REPO_NAMES {
        let text = docs.iter().find(|(d, _)| d == doc).map(|(_, t)| t.as_str());
        assert!(
            text.is_some_and(|t| t.contains(span)),
            "NOT_REPO_NAMES: {doc} no longer names `{span}`: remove the entry"
        );
    }
    for n in &report.notices {
        println!("notice: {n}");
    }
    println!("checked: {:?}", report.checked);
    let failures: Vec<&str> = report.failures.iter().map(|(_, f)| f.as_str()).collect();
    assert!(
        failures.is_empty(),
        "{} things the docs name do not exist:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The checker itself: each kind of stale name in a doc is reported, with its line, and the
/// names that exist are not.
#[test]
fn each_kind_of_stale_name_is_reported_with_its_line() {
    let repo = Repo::load();
    let mut helps = Helps::new();
    let doc = "\
`scripts/test.sh`, `scripts/no_such_script.sh` and `no_such_module_anywhere.rs`.\n\
`POST /v1/evaluate` and `GET /v1/no_such_route`, on `L1/2_Add` and `L1/999_NoSuchTask`.\n\
`a_background_command_cannot_raise_its_cpu_share` and `a_test_that_was_never_written_anywhere`.\n\
`EpisodeManager::reset` and `EpisodeManager::no_such_method`, `CUDA_AGENT_NO_SUCH_VARIABLE`.\n\
\n\
`--max-builds` and `--no-such-flag-anywhere`; `kernelbench no-such-subcommand`.\n\
\n\
```sh\n\
env-server --bind 127.0.0.1:8080 --no-such-server-flag\n\
```\n\
| `env-api/` | `src/lib.rs`, and `rollout.rs`, which is the trainer's |\n";
    let report = check_docs(
        &repo,
        &mut helps,
        &[("fake.md".to_string(), doc.to_string())],
    );
    let got: Vec<&str> = report.failures.iter().map(|(_, f)| f.as_str()).collect();
    let mut want = vec![
        "fake.md:1: `scripts/no_such_script.sh`",
        "fake.md:1: `no_such_module_anywhere.rs`",
        "fake.md:2: `GET /v1/no_such_route`",
        "fake.md:2: `L1/999_NoSuchTask`",
        "fake.md:3: `a_test_that_was_never_written_anywhere`",
        "fake.md:4: `EpisodeManager::no_such_method`",
        "fake.md:4: `CUDA_AGENT_NO_SUCH_VARIABLE`",
        "fake.md:11: `rollout.rs`",
        "fake.md:6: `--no-such-flag-anywhere`",
    ];
    let built = |b: &str| helps.bin_dir.as_ref().is_some_and(|d| d.join(b).is_file());
    if built("kernelbench") {
        want.push("fake.md:6: `kernelbench no-such-subcommand`");
    }
    if built("env-server") {
        want.push("fake.md:9: `env-server --bind 127.0.0.1:8080 --no-such-server-flag`");
    }
    for w in &want {
        assert!(
            got.iter().any(|g| g.starts_with(w)),
            "not reported: {w}\ngot:\n{}",
            got.join("\n")
        );
    }
    assert_eq!(
        got.len(),
        want.len(),
        "reported more than the stale names:\n{}",
        got.join("\n")
    );
}

/// Flags named without their command (`--max-builds` in prose) must be taken by some
/// command of the project: a binary's (or subcommand's) `--help`, or a script's source.
fn check_lone_flags(repo: &Repo, helps: &mut Helps, flags: &[(Span, String)], report: &mut Report) {
    let mut all_help = HashSet::new();
    for bin in BINARIES {
        let argv = vec![bin.to_string()];
        if let Some(h) = helps.help(&argv, &mut report.notices) {
            for sub in subcommands(&h) {
                if let Some(s) = helps.help(&[bin.to_string(), sub], &mut report.notices) {
                    all_help.extend(flag_words(&s));
                }
            }
            all_help.extend(flag_words(&h));
        }
    }
    for (span, f) in flags {
        report.count("flag");
        // clap derives `--max-builds` from a field `max_builds`: without the binaries, the
        // field stands in for the flag.
        let field = f.trim_start_matches('-').replace('-', "_");
        if FOREIGN_FLAGS.iter().any(|(flag, _)| flag == f) {
            continue;
        }
        let ok = all_help.contains(f)
            || repo.source_flags.contains(f)
            || (all_help.is_empty() && repo.idents.contains(&field));
        if !ok {
            report.fail(span, format!("no command of the project takes `{f}`"));
        }
    }
}
