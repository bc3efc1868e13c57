//! `Read`, `Write` and `MultiEdit`: file tools that never leave the workspace and never touch
//! a protected file.

use serde_json::json;

use super::{MultiEditArgs, ReadArgs, ToolError, ToolLimits, ToolOutput, WriteArgs};
use crate::workspace::Workspace;

/// Longest line Read returns before cutting it.
const MAX_LINE_CHARS: usize = 2_000;

pub(super) fn read(ws: &Workspace, args: &ReadArgs, limits: &ToolLimits) -> Result<ToolOutput, ToolError> {
    let path = ws.resolve(&args.file_path)?;
    if path.is_dir() {
        return Err(ToolError::InvalidArgument(format!(
            "{} is a directory; use Glob or Bash ls to list it",
            ws.display(&path)
        )));
    }
    let bytes = std::fs::read(&path).map_err(|e| ToolError::io(&path, e))?;
    if bytes.contains(&0) {
        return Err(ToolError::InvalidArgument(format!("{} is a binary file", ws.display(&path))));
    }
    let text = String::from_utf8_lossy(&bytes);
    if text.is_empty() {
        return Ok(ToolOutput::ok("(empty file)", json!({"lines": 0})));
    }
    let offset = args.offset.unwrap_or(1).max(1);
    let limit = args.limit.unwrap_or(limits.default_read_lines).max(1);
    let total = text.lines().count();
    let mut out = String::new();
    for (i, line) in text.lines().enumerate().skip(offset - 1).take(limit) {
        let shown: String = line.chars().take(MAX_LINE_CHARS).collect();
        let cut = if shown.len() < line.len() { " [line truncated]" } else { "" };
        out.push_str(&format!("{:>6}\t{shown}{cut}\n", i + 1));
    }
    if out.len() > limits.max_output_chars * 4 {
        out.truncate(limits.max_output_chars * 4);
        out.push_str("\n[output truncated; use offset and limit]");
    }
    let shown_to = (offset - 1 + limit).min(total);
    if offset > total {
        out = format!("(the file has {total} lines; offset {offset} is past its end)");
    } else if shown_to < total {
        out.push_str(&format!("[lines {offset}-{shown_to} of {total}; use offset to read more]"));
    }
    Ok(ToolOutput::ok(out, json!({"lines": total})))
}

pub(super) fn write(ws: &Workspace, args: &WriteArgs) -> Result<ToolOutput, ToolError> {
    let path = ws.resolve(&args.file_path)?;
    if path.is_dir() {
        return Err(ToolError::InvalidArgument(format!("{} is a directory", ws.display(&path))));
    }
    let existed = path.exists();
    ws.write_atomic(&path, args.content.as_bytes())?;
    let verb = if existed { "Updated" } else { "Created" };
    Ok(ToolOutput::ok(
        format!("{verb} {} ({} bytes)", ws.display(&path), args.content.len()),
        json!({"path": ws.display(&path), "bytes": args.content.len(), "created": !existed}),
    ))
}

/// Applies the edits to `original` (None for a missing file) in memory.
fn apply_edits(original: Option<&str>, args: &MultiEditArgs) -> Result<(String, usize), ToolError> {
    let total = args.edits.len();
    if total == 0 {
        return Err(ToolError::InvalidArgument("edits is empty".into()));
    }
    let fail = |index: usize, reason: String| ToolError::Edit { index, total, reason };
    let mut text = match original {
        Some(t) => t.to_string(),
        None => {
            if !args.edits[0].old_string.is_empty() {
                return Err(fail(1, "the file does not exist; to create it, make the first edit's old_string empty".into()));
            }
            String::new()
        }
    };
    let mut replacements = 0;
    for (i, e) in args.edits.iter().enumerate() {
        let index = i + 1;
        if e.old_string == e.new_string {
            return Err(fail(index, "old_string and new_string are the same".into()));
        }
        if e.old_string.is_empty() {
            if i == 0 && original.is_none() {
                text = e.new_string.clone();
                replacements += 1;
                continue;
            }
            return Err(fail(index, "old_string is empty; only the first edit of a new file may be empty".into()));
        }
        let count = text.matches(&e.old_string).count();
        match (count, e.replace_all) {
            (0, _) => return Err(fail(index, "old_string was not found in the file (after the edits before it)".into())),
            (1, _) => {
                text = text.replacen(&e.old_string, &e.new_string, 1);
                replacements += 1;
            }
            (n, true) => {
                text = text.replace(&e.old_string, &e.new_string);
                replacements += n;
            }
            (n, false) => {
                return Err(fail(
                    index,
                    format!("old_string appears {n} times; add surrounding context to make it unique, or set replace_all"),
                ))
            }
        }
    }
    Ok((text, replacements))
}

pub(super) fn multi_edit(ws: &Workspace, args: &MultiEditArgs) -> Result<ToolOutput, ToolError> {
    let path = ws.resolve(&args.file_path)?;
    ws.check_writable(&path)?;
    if path.is_dir() {
        return Err(ToolError::InvalidArgument(format!("{} is a directory", ws.display(&path))));
    }
    let original = match std::fs::read(&path) {
        Ok(b) => Some(String::from_utf8(b).map_err(|_| {
            ToolError::InvalidArgument(format!("{} is not UTF-8 text", ws.display(&path)))
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(ToolError::io(&path, e)),
    };
    let (text, replacements) = apply_edits(original.as_deref(), args)?;
    ws.write_atomic(&path, text.as_bytes())?;
    let created = original.is_none();
    Ok(ToolOutput::ok(
        format!(
            "{} {}: {} edit(s), {replacements} replacement(s)",
            if created { "Created" } else { "Edited" },
            ws.display(&path),
            args.edits.len()
        ),
        json!({"path": ws.display(&path), "edits": args.edits.len(), "replacements": replacements, "created": created}),
    ))
}
