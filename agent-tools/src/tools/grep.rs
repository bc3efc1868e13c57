//! `Grep`: ripgrep's matcher and searcher (the `grep-regex` and `grep-searcher` crates) over
//! the workspace. The walk is the file tools' own (directory fds, no link followed, depth and
//! entries capped), every file is read through the workspace's no-follow open with a size cap,
//! and the total read and the output are capped too.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use env_api::observation::{GrepData, ToolData};
use grep_regex::{RegexMatcher, RegexMatcherBuilder};
use grep_searcher::{
    BinaryDetection, Searcher, SearcherBuilder, Sink, SinkContext, SinkContextKind, SinkMatch,
};

use super::{GrepArgs, GrepOutputMode, ToolError, ToolLimits, ToolOutput};
use crate::workspace::fsops::{self, Kind};
use crate::workspace::Workspace;

/// Bytes one call reads over all files; past it the search stops and says so.
const MAX_TOTAL_BYTES: u64 = 64 << 20;
/// Longest line shown in content mode (longer ones are cut).
const MAX_LINE_CHARS: usize = 500;
/// Most context lines asked for on each side.
const MAX_CONTEXT: usize = 100;
/// Compiled-regex size caps: a pathological pattern is refused, not built.
const REGEX_SIZE_LIMIT: usize = 10 << 20;

/// File types (`type`), as ripgrep names them, with their extensions.
const TYPES: &[(&str, &[&str])] = &[
    ("py", &["py", "pyi"]),
    ("python", &["py", "pyi"]),
    (
        "cpp",
        &["c", "cc", "cpp", "cxx", "h", "hh", "hpp", "hxx", "inl"],
    ),
    ("c", &["c", "h"]),
    ("cuda", &["cu", "cuh"]),
    ("md", &["md", "markdown"]),
    ("markdown", &["md", "markdown"]),
    ("txt", &["txt"]),
    ("json", &["json", "jsonl"]),
    ("sh", &["sh", "bash"]),
    ("rust", &["rs"]),
    ("toml", &["toml"]),
    ("yaml", &["yaml", "yml"]),
];

/// A regular file found by the walk: its path relative to the workspace root, its path
/// below the search base and its modification time.
struct Found {
    rel: PathBuf,
    below: PathBuf,
    mtime: (i64, i64),
}

struct Walk<'a> {
    ws: &'a Workspace,
    limits: &'a ToolLimits,
    files: Vec<Found>,
    entries: usize,
    too_deep: bool,
    stopped: bool,
}

impl Walk<'_> {
    /// Walks `dir` (`below` under the base, `rel` under the root), skipping hidden entries
    /// as ripgrep does.
    fn dir(&mut self, dir: &OwnedFd, below: &Path, rel: &Path, depth: usize) {
        let room = self.limits.max_glob_entries.saturating_sub(self.entries);
        let Ok((mut entries, stopped)) = fsops::list_dir(dir, room) else {
            return;
        };
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        self.entries += entries.len();
        self.stopped |= stopped;
        for e in entries {
            if e.name.as_encoded_bytes().first() == Some(&b'.') {
                continue;
            }
            match e.kind {
                Kind::Regular => {
                    let Ok(name) = std::ffi::CString::new(e.name.as_encoded_bytes()) else {
                        continue;
                    };
                    if let Ok(Some(st)) = fsops::stat_at(dir, &name) {
                        if Kind::of_mode(st.st_mode) == Kind::Regular {
                            self.files.push(Found {
                                rel: rel.join(&e.name),
                                below: below.join(&e.name),
                                mtime: (st.st_mtime, st.st_mtime_nsec),
                            });
                        }
                    }
                }
                Kind::Directory if depth >= self.limits.max_glob_depth => self.too_deep = true,
                Kind::Directory => {
                    if let Ok(sub) = fsops::open_dir(self.ws.resolver(), dir, Path::new(&e.name)) {
                        self.dir(&sub, &below.join(&e.name), &rel.join(&e.name), depth + 1);
                    }
                }
                _ => {}
            }
            if self.stopped {
                return;
            }
        }
    }
}

/// Which files to search: a glob on the name (or the path below the base when it holds a
/// `/`) and a type's extensions.
struct Filter {
    glob: Option<(globset::GlobMatcher, bool)>,
    extensions: Option<&'static [&'static str]>,
}

impl Filter {
    fn new(args: &GrepArgs, limits: &ToolLimits) -> Result<Self, ToolError> {
        let glob = match &args.glob {
            Some(g) if !g.trim().is_empty() => {
                if g.len() > limits.max_glob_pattern_len {
                    return Err(ToolError::InvalidArgument(format!(
                        "the glob is {} bytes long, over the limit of {}",
                        g.len(),
                        limits.max_glob_pattern_len
                    )));
                }
                let m = globset::GlobBuilder::new(g)
                    .literal_separator(true)
                    .build()
                    .map_err(|e| ToolError::InvalidArgument(format!("bad glob: {e}")))?
                    .compile_matcher();
                Some((m, g.contains('/')))
            }
            _ => None,
        };
        let extensions = match &args.file_type {
            Some(t) => Some(
                TYPES
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case(t))
                    .map(|(_, exts)| *exts)
                    .ok_or_else(|| {
                        let known: Vec<&str> = TYPES.iter().map(|(n, _)| *n).collect();
                        ToolError::InvalidArgument(format!(
                            "unknown type {t:?}; known types: {}",
                            known.join(", ")
                        ))
                    })?,
            ),
            None => None,
        };
        Ok(Self { glob, extensions })
    }

    fn keeps(&self, below: &Path) -> bool {
        if let Some((m, by_path)) = &self.glob {
            let ok = if *by_path {
                m.is_match(below)
            } else {
                below.file_name().is_some_and(|n| m.is_match(Path::new(n)))
            };
            if !ok {
                return false;
            }
        }
        if let Some(exts) = self.extensions {
            let ext = below.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !exts.iter().any(|x| x.eq_ignore_ascii_case(ext)) {
                return false;
            }
        }
        true
    }
}

/// Collects what content mode prints for one file, rg-style: `path:line:text` for matching
/// lines, `path-line-text` for context, `--` between groups.
struct Lines<'a> {
    path: &'a str,
    numbers: bool,
    out: &'a mut Vec<String>,
    /// Lines (or entries) still wanted; the search stops at 0.
    room: &'a mut usize,
    matched: usize,
    last_line: Option<u64>,
}

impl Lines<'_> {
    fn push(&mut self, sep: char, line_number: Option<u64>, bytes: &[u8]) -> bool {
        // A multi-line match prints each of its lines.
        let text = String::from_utf8_lossy(bytes);
        for (k, line) in text.trim_end_matches(['\n', '\r']).split('\n').enumerate() {
            if *self.room == 0 {
                return false;
            }
            let line = line.trim_end_matches('\r');
            let mut shown: String = line.chars().take(MAX_LINE_CHARS).collect();
            if shown.len() < line.len() {
                shown.push_str(" [line truncated]");
            }
            let n = line_number.map(|n| n + k as u64);
            self.out.push(match (self.numbers, n) {
                (true, Some(n)) => format!("{}{sep}{n}{sep}{shown}", self.path),
                _ => format!("{}{sep}{shown}", self.path),
            });
            *self.room -= 1;
            self.last_line = n;
        }
        *self.room > 0
    }
}

impl Sink for Lines<'_> {
    type Error = std::io::Error;

    fn matched(&mut self, _s: &Searcher, m: &SinkMatch<'_>) -> Result<bool, Self::Error> {
        self.matched += 1;
        Ok(self.push(':', m.line_number(), m.bytes()))
    }

    fn context(&mut self, _s: &Searcher, c: &SinkContext<'_>) -> Result<bool, Self::Error> {
        if matches!(c.kind(), SinkContextKind::Other) {
            return Ok(true);
        }
        Ok(self.push('-', c.line_number(), c.bytes()))
    }

    fn context_break(&mut self, _s: &Searcher) -> Result<bool, Self::Error> {
        if *self.room == 0 {
            return Ok(false);
        }
        self.out.push("--".into());
        *self.room -= 1;
        Ok(true)
    }
}

/// Counts matching lines of one file (and stops at the first for files_with_matches).
struct Count {
    n: u64,
    first_only: bool,
}

impl Sink for Count {
    type Error = std::io::Error;

    fn matched(&mut self, _s: &Searcher, m: &SinkMatch<'_>) -> Result<bool, Self::Error> {
        self.n += m.lines().count().max(1) as u64;
        Ok(!self.first_only)
    }
}

fn matcher(args: &GrepArgs, multiline: bool) -> Result<RegexMatcher, ToolError> {
    let mut b = RegexMatcherBuilder::new();
    b.case_insensitive(args.case_insensitive.unwrap_or(false))
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_SIZE_LIMIT)
        .nest_limit(100);
    if multiline {
        b.multi_line(true).dot_matches_new_line(true);
    } else {
        // Line-oriented, as ripgrep without -U: a match never crosses a line end.
        b.line_terminator(Some(b'\n'));
    }
    b.build(&args.pattern)
        .map_err(|e| ToolError::InvalidArgument(format!("bad regular expression: {e}")))
}

pub(super) fn run(
    ws: &Workspace,
    args: &GrepArgs,
    limits: &ToolLimits,
) -> Result<ToolOutput, ToolError> {
    check_pattern(&args.pattern, limits)?;
    let mode = args.output_mode.unwrap_or_default();
    let multiline = args.multiline.unwrap_or(false);
    let matcher = matcher(args, multiline)?;
    let filter = Filter::new(args, limits)?;
    let (files, walked) = files_to_search(ws, args, limits, &filter, mode)?;
    let mut searcher = searcher(args, mode, multiline);
    let tally = search(ws, args, limits, mode, &matcher, &mut searcher, &files);
    let notes = notes(&tally, args, limits, &walked);
    let text = render(&tally, mode, limits.max_output_chars, &notes);
    Ok(ToolOutput::ok(
        text,
        ToolData::Grep(GrepData {
            complete: notes.is_empty(),
            files_searched: files.len(),
            matching_files: tally.matching_files,
            matching_lines: tally.matching_lines,
        }),
    ))
}

fn check_pattern(pattern: &str, limits: &ToolLimits) -> Result<(), ToolError> {
    if pattern.is_empty() {
        return Err(ToolError::InvalidArgument("pattern is empty".into()));
    }
    if pattern.len() > limits.max_glob_pattern_len {
        return Err(ToolError::InvalidArgument(format!(
            "the pattern is {} bytes long, over the limit of {}",
            pattern.len(),
            limits.max_glob_pattern_len
        )));
    }
    Ok(())
}

/// How the walk ended, for the notes.
struct Walked {
    too_deep: bool,
    stopped: bool,
}

/// The files to search: `path` itself when it is a file (whatever the filter says), else those
/// the walk below it finds and the filter keeps; newest first when only names are listed.
fn files_to_search(
    ws: &Workspace,
    args: &GrepArgs,
    limits: &ToolLimits,
    filter: &Filter,
    mode: GrepOutputMode,
) -> Result<(Vec<Found>, Walked), ToolError> {
    let base = match &args.path {
        Some(p) => ws.rel_path(p)?,
        None => PathBuf::new(),
    };
    let mut walk = Walk {
        ws,
        limits,
        files: Vec::new(),
        entries: 0,
        too_deep: false,
        stopped: false,
    };
    match ws.open_dir(&base) {
        Ok(fd) => walk.dir(&fd, Path::new(""), &base, 1),
        Err(ToolError::InvalidArgument(_)) => {
            let name = base.file_name().map(PathBuf::from).unwrap_or_default();
            walk.files.push(Found {
                rel: base.clone(),
                below: name,
                mtime: (0, 0),
            });
        }
        Err(e) => return Err(e),
    }
    let single_file = walk.files.len() == 1 && walk.entries == 0;
    let walked = Walked {
        too_deep: walk.too_deep,
        stopped: walk.stopped,
    };
    let mut files: Vec<Found> = walk
        .files
        .into_iter()
        .filter(|f| single_file || filter.keeps(&f.below))
        .collect();
    if mode == GrepOutputMode::FilesWithMatches {
        // Newest first, as Glob lists them.
        files.sort_by(|a, b| b.mtime.cmp(&a.mtime).then_with(|| a.rel.cmp(&b.rel)));
    }
    Ok((files, walked))
}

/// ripgrep's searcher with the call's context (in content mode only) and line numbers.
fn searcher(args: &GrepArgs, mode: GrepOutputMode, multiline: bool) -> Searcher {
    let context = args.context.unwrap_or(0).min(MAX_CONTEXT);
    let before = args.before.unwrap_or(context).min(MAX_CONTEXT);
    let after = args.after.unwrap_or(context).min(MAX_CONTEXT);
    let content = mode == GrepOutputMode::Content;
    SearcherBuilder::new()
        .line_number(true)
        .multi_line(multiline)
        .before_context(if content { before } else { 0 })
        .after_context(if content { after } else { 0 })
        .binary_detection(BinaryDetection::quit(0))
        .build()
}

/// What the search found: the output lines, the counts, and why it stopped early, if it did.
#[derive(Default)]
struct Tally {
    out: Vec<String>,
    matching_files: usize,
    matching_lines: u64,
    skipped_large: usize,
    budget_hit: bool,
    limited: bool,
}

impl Tally {
    /// Output lines past the output cap (whole lines only are shown).
    fn cut_lines(&self, cap: usize) -> usize {
        let mut len = 0;
        for (k, line) in self.out.iter().enumerate() {
            if len + line.len() + 1 > cap {
                return self.out.len() - k;
            }
            len += line.len() + 1;
        }
        0
    }
}

/// Searches `files` in order until `head_limit` lines (or names) are out or the read budget
/// is spent; files over the read cap are skipped and counted.
fn search(
    ws: &Workspace,
    args: &GrepArgs,
    limits: &ToolLimits,
    mode: GrepOutputMode,
    matcher: &RegexMatcher,
    searcher: &mut Searcher,
    files: &[Found],
) -> Tally {
    let head_limit = args.head_limit.filter(|&n| n > 0);
    let mut room = head_limit.unwrap_or(usize::MAX);
    let mut t = Tally::default();
    let mut read_total = 0u64;
    for f in files {
        if room == 0 {
            t.limited = true;
            break;
        }
        if read_total >= MAX_TOTAL_BYTES {
            t.budget_hit = true;
            break;
        }
        let capped = match ws.read_capped(&f.rel, limits.max_read_bytes) {
            Ok(Some(c)) => c,
            // Vanished, unreadable, a link or a hard link to someone else's file: not searched.
            Ok(None) | Err(_) => continue,
        };
        if capped.truncated {
            t.skipped_large += 1;
            continue;
        }
        read_total += capped.bytes.len() as u64;
        let shown = ws.display(&f.rel);
        if mode == GrepOutputMode::Content {
            let mut sink = Lines {
                path: &shown,
                numbers: args.line_numbers.unwrap_or(true),
                out: &mut t.out,
                room: &mut room,
                matched: 0,
                last_line: None,
            };
            let _ = searcher.search_slice(matcher, &capped.bytes, &mut sink);
            let n = sink.matched;
            if n > 0 {
                t.matching_files += 1;
                t.matching_lines += n as u64;
            }
        } else {
            let mut sink = Count {
                n: 0,
                first_only: mode == GrepOutputMode::FilesWithMatches,
            };
            let _ = searcher.search_slice(matcher, &capped.bytes, &mut sink);
            if sink.n > 0 {
                t.matching_files += 1;
                t.matching_lines += sink.n;
                t.out.push(if mode == GrepOutputMode::Count {
                    format!("{shown}:{}", sink.n)
                } else {
                    shown
                });
                room -= 1;
            }
        }
    }
    if head_limit.is_some() && room == 0 {
        t.limited = true;
    }
    t
}

/// Why the output is not the whole answer, one line each.
fn notes(t: &Tally, args: &GrepArgs, limits: &ToolLimits, walked: &Walked) -> Vec<String> {
    let mut notes = Vec::new();
    let cut_lines = t.cut_lines(limits.max_output_chars);
    if cut_lines > 0 {
        notes.push(format!(
            "[{cut_lines} more lines not shown (output cap); narrow the search or use head_limit]"
        ));
    }
    if t.limited {
        notes.push(format!(
            "[stopped at head_limit {}]",
            args.head_limit.unwrap_or(0)
        ));
    }
    if t.skipped_large > 0 {
        notes.push(format!(
            "[{} files over {} bytes were not searched; use Bash (rg, grep) for them]",
            t.skipped_large, limits.max_read_bytes
        ));
    }
    if t.budget_hit {
        notes.push(format!(
            "[the search stopped after reading {MAX_TOTAL_BYTES} bytes; narrow the path or glob]"
        ));
    }
    if walked.too_deep {
        notes.push(format!(
            "[directories deeper than {} levels were not searched]",
            limits.max_glob_depth
        ));
    }
    if walked.stopped {
        notes.push(format!(
            "[the walk stopped after {} entries; narrow the path]",
            limits.max_glob_entries
        ));
    }
    notes
}

/// The observation: whole lines within the output cap, the mode's header or footer, the notes.
fn render(t: &Tally, mode: GrepOutputMode, cap: usize, notes: &[String]) -> String {
    let shown = t.out.len() - t.cut_lines(cap);
    let mut text = String::new();
    for line in &t.out[..shown] {
        text.push_str(line);
        text.push('\n');
    }
    if t.out.is_empty() {
        text = "No matches found\n".into();
    } else if mode == GrepOutputMode::Count {
        text.push_str(&format!(
            "[{} matching lines in {} files]\n",
            t.matching_lines, t.matching_files
        ));
    } else if mode == GrepOutputMode::FilesWithMatches {
        text.insert_str(0, &format!("Found {} files\n", t.matching_files));
    }
    for n in notes {
        text.push_str(n);
        text.push('\n');
    }
    text.trim_end().to_string()
}
