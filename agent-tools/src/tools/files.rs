//! `Read`, `Write` and `MultiEdit`: file tools that never leave the workspace, never follow a
//! link, read only regular files, never touch a protected file, and cap what they read and
//! write.

use env_api::observation::{EditData, ReadData, ToolData, WriteData};

use super::{nearest, MultiEditArgs, ReadArgs, ToolError, ToolLimits, ToolOutput, WriteArgs};
use crate::workspace::Workspace;

/// Longest line Read returns before cutting it.
const MAX_LINE_CHARS: usize = 2_000;

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn prefix(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Says a directory is one, with what to use instead, rather than "not a regular file".
fn directory_hint(err: ToolError, what: &str) -> ToolError {
    match err {
        ToolError::NotRegular {
            path,
            kind: "a directory",
        } => ToolError::InvalidArgument(format!("{path} is a directory{what}")),
        other => other,
    }
}

pub(super) fn read(
    ws: &Workspace,
    args: &ReadArgs,
    limits: &ToolLimits,
) -> Result<ToolOutput, ToolError> {
    let rel = ws.rel_path(&args.file_path)?;
    let shown = ws.display(&rel);
    let hint = "; use Glob or Bash ls to list it";
    if rel.as_os_str().is_empty() {
        return Err(ToolError::InvalidArgument(format!(
            "{shown} is a directory{hint}"
        )));
    }
    let capped = match ws.read_capped(&rel, limits.max_read_bytes) {
        Ok(Some(c)) => c,
        Ok(None) => {
            return Err(ToolError::Io {
                path: shown,
                error: std::io::ErrorKind::NotFound.into(),
            })
        }
        Err(e) => return Err(directory_hint(e, hint)),
    };
    let mut bytes = capped.bytes;
    if bytes.contains(&0) {
        return Err(ToolError::InvalidArgument(format!(
            "{shown} is a binary file"
        )));
    }
    if capped.truncated {
        // Show whole lines only: the partial last line is part of the cut.
        if let Some(nl) = bytes.iter().rposition(|&b| b == b'\n') {
            bytes.truncate(nl + 1);
        }
    }
    let bytes_read = bytes.len();
    let text = String::from_utf8_lossy(&bytes);
    let cut_note = capped.truncated.then(|| {
        format!("[the file is {} bytes; Read sees only its first {bytes_read} bytes; use Bash (sed -n, tail) for the rest]", capped.size)
    });
    let data = |lines: usize| {
        ToolData::Read(ReadData {
            bytes_read: bytes_read as u64,
            lines,
            size: capped.size,
            truncated: capped.truncated,
        })
    };
    if text.is_empty() {
        let mut out = "(empty file)".to_string();
        if let Some(n) = &cut_note {
            out = format!(
                "(no whole line in the first {} bytes)\n{n}",
                limits.max_read_bytes
            );
        }
        return Ok(ToolOutput::ok(out, data(0)));
    }
    let offset = args.offset.unwrap_or(1).max(1);
    let limit = args.limit.unwrap_or(limits.default_read_lines).max(1);
    let total = text.lines().count();
    let out_cap = limits.max_output_chars.saturating_mul(4);
    let mut out = String::new();
    let mut output_cut = false;
    for (i, line) in text.lines().enumerate().skip(offset - 1).take(limit) {
        if out.len() > out_cap {
            output_cut = true;
            break;
        }
        let shown_line: String = line.chars().take(MAX_LINE_CHARS).collect();
        let cut = if shown_line.len() < line.len() {
            " [line truncated]"
        } else {
            ""
        };
        out.push_str(&format!("{:>6}\t{shown_line}{cut}\n", i + 1));
    }
    let mut notes = Vec::new();
    if output_cut || out.len() > out_cap {
        out = prefix(&out, out_cap).to_string();
        notes.push("[output truncated; use offset and limit]".to_string());
    }
    let shown_to = (offset - 1 + limit).min(total);
    if offset > total {
        out.clear();
        notes.push(format!(
            "(the file has {total} lines; offset {offset} is past its end)"
        ));
    } else if shown_to < total {
        notes.push(format!(
            "[lines {offset}-{shown_to} of {total}; use offset to read more]"
        ));
    }
    notes.extend(cut_note);
    if !notes.is_empty() {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&notes.join("\n"));
    }
    Ok(ToolOutput::ok(out, data(total)))
}

pub(super) fn write(
    ws: &Workspace,
    args: &WriteArgs,
    limits: &ToolLimits,
) -> Result<ToolOutput, ToolError> {
    let rel = ws.rel_path(&args.file_path)?;
    let shown = ws.display(&rel);
    if args.content.len() as u64 > limits.max_write_bytes {
        return Err(ToolError::TooLarge {
            what: format!("the content for {shown}"),
            limit: limits.max_write_bytes,
        });
    }
    let created = ws
        .write_rel(&rel, args.content.as_bytes())
        .map_err(|e| directory_hint(e, ""))?;
    let verb = if created { "Created" } else { "Updated" };
    Ok(ToolOutput::ok(
        format!("{verb} {shown} ({} bytes)", args.content.len()),
        ToolData::Write(WriteData {
            bytes: args.content.len() as u64,
            created,
            path: shown,
        }),
    ))
}

/// Applies the edits to `original` (None for a missing file) in memory; no intermediate
/// text may grow past `cap` bytes, which is checked before anything is allocated.
fn apply_edits(
    original: Option<&str>,
    args: &MultiEditArgs,
    cap: u64,
    shown: &str,
) -> Result<(String, usize), ToolError> {
    let total = args.edits.len();
    if total == 0 {
        return Err(ToolError::InvalidArgument("edits is empty".into()));
    }
    let fail = |index: usize, reason: String| ToolError::Edit {
        index,
        total,
        reason,
        detail: String::new(),
    };
    // The text an edit is placed in: the file itself, or the file as the edits before it
    // left it (line numbers then count in that text).
    let searched = |index: usize| {
        if index == 1 {
            shown.to_string()
        } else {
            format!("{shown} (as the edits before it left it)")
        }
    };
    let over = |index: usize, size: u128| {
        fail(
            index,
            format!("the file would grow to {size} bytes, over the limit of {cap} bytes"),
        )
    };
    let mut text = match original {
        Some(t) => t.to_string(),
        None => {
            if !args.edits[0].old_string.is_empty() {
                return Err(fail(
                    1,
                    "the file does not exist; to create it, make the first edit's old_string empty"
                        .into(),
                ));
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
        if e.new_string.len() as u64 > cap {
            return Err(over(index, e.new_string.len() as u128));
        }
        if e.old_string.is_empty() {
            if i == 0 && original.is_none() {
                text = e.new_string.clone();
                replacements += 1;
                continue;
            }
            return Err(fail(
                index,
                "old_string is empty; only the first edit of a new file may be empty".into(),
            ));
        }
        let count = text.matches(&e.old_string).count();
        // The size after this edit, in u128 so that no count can overflow it.
        let grown = |n: usize| {
            text.len() as u128 - (n * e.old_string.len()) as u128
                + n as u128 * e.new_string.len() as u128
        };
        match (count, e.replace_all) {
            (0, _) => {
                return Err(ToolError::Edit {
                    index,
                    total,
                    reason: "old_string was not found in the file (after the edits before it)"
                        .into(),
                    detail: nearest::not_found_detail(&text, &e.old_string, &searched(index)),
                })
            }
            (1, _) => {
                if grown(1) > cap as u128 {
                    return Err(over(index, grown(1)));
                }
                text = text.replacen(&e.old_string, &e.new_string, 1);
                replacements += 1;
            }
            (n, true) => {
                if grown(n) > cap as u128 {
                    return Err(over(index, grown(n)));
                }
                text = text.replace(&e.old_string, &e.new_string);
                replacements += n;
            }
            (n, false) => {
                return Err(ToolError::Edit {
                    index,
                    total,
                    reason: format!("old_string appears {n} times; add surrounding context to make it unique, or set replace_all"),
                    detail: nearest::ambiguous_detail(&text, &e.old_string, &searched(index)),
                })
            }
        }
    }
    Ok((text, replacements))
}

pub(super) fn multi_edit(
    ws: &Workspace,
    args: &MultiEditArgs,
    limits: &ToolLimits,
) -> Result<ToolOutput, ToolError> {
    let rel = ws.rel_path(&args.file_path)?;
    let shown = ws.display(&rel);
    ws.check_writable(&rel)?;
    if rel.as_os_str().is_empty() {
        return Err(ToolError::InvalidArgument(format!(
            "{shown} is a directory"
        )));
    }
    if args.edits.len() > limits.max_edits {
        return Err(ToolError::InvalidArgument(format!(
            "{} edits in one call, over the limit of {}; split them across calls",
            args.edits.len(),
            limits.max_edits
        )));
    }
    let original = match ws
        .read_capped(&rel, limits.max_read_bytes)
        .map_err(|e| directory_hint(e, ""))?
    {
        Some(c) if c.truncated => {
            return Err(ToolError::TooLarge {
                what: format!("{shown} (to edit)"),
                limit: limits.max_read_bytes,
            });
        }
        Some(c) => Some(
            String::from_utf8(c.bytes)
                .map_err(|_| ToolError::InvalidArgument(format!("{shown} is not UTF-8 text")))?,
        ),
        None => None,
    };
    let (text, replacements) =
        apply_edits(original.as_deref(), args, limits.max_write_bytes, &shown)?;
    ws.write_rel(&rel, text.as_bytes())?;
    let created = original.is_none();
    Ok(ToolOutput::ok(
        format!(
            "{} {shown}: {} edit(s), {replacements} replacement(s)",
            if created { "Created" } else { "Edited" },
            args.edits.len()
        ),
        ToolData::Edit(EditData {
            created,
            edits: args.edits.len(),
            path: shown,
            replacements,
        }),
    ))
}
