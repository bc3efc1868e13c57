//! `Glob`: files matching a pattern, newest first, never outside the workspace.

use std::time::SystemTime;

use serde_json::json;

use super::{GlobArgs, ToolError, ToolOutput};
use crate::workspace::Workspace;

pub(super) fn run(ws: &Workspace, args: &GlobArgs, max: usize) -> Result<ToolOutput, ToolError> {
    let base = match &args.path {
        Some(p) => ws.resolve(p)?,
        None => ws.root().to_path_buf(),
    };
    if !base.is_dir() {
        return Err(ToolError::InvalidArgument(format!("{} is not a directory", ws.display(&base))));
    }
    // A pattern given as an absolute path inside the workspace is taken relative to it.
    let pattern = match args.pattern.strip_prefix(&format!("{}/", base.display())) {
        Some(rel) => rel.to_string(),
        None if args.pattern.starts_with('/') => {
            return Err(ToolError::OutsideWorkspace(args.pattern.clone()));
        }
        None => args.pattern.clone(),
    };
    if pattern.split('/').any(|c| c == "..") {
        return Err(ToolError::OutsideWorkspace(args.pattern.clone()));
    }
    let matcher = globset::GlobBuilder::new(&pattern)
        .literal_separator(true)
        .build()
        .map_err(|e| ToolError::InvalidArgument(format!("bad glob pattern: {e}")))?
        .compile_matcher();
    let mut hits: Vec<(SystemTime, String)> = walkdir::WalkDir::new(&base)
        .follow_links(false)
        .into_iter()
        .flatten()
        .filter(|e| e.file_type().is_file())
        .filter_map(|e| {
            let rel = e.path().strip_prefix(&base).ok()?;
            if !matcher.is_match(rel) {
                return None;
            }
            let mtime = e.metadata().ok()?.modified().ok()?;
            Some((mtime, ws.display(e.path())))
        })
        .collect();
    hits.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let total = hits.len();
    let paths: Vec<String> = hits.into_iter().take(max).map(|(_, p)| p).collect();
    let mut text = if paths.is_empty() { "No files found".to_string() } else { paths.join("\n") };
    if total > max {
        text.push_str(&format!("\n[{} more matches not shown; narrow the pattern]", total - max));
    }
    Ok(ToolOutput::ok(text, json!({"paths": paths, "total": total})))
}
