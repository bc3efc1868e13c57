//! `Edit`: one exact-string replacement in one file (Claude Code's Edit). It is a MultiEdit
//! of one edit: the same path rules, caps and all-or-nothing write, with messages that speak
//! of one edit.

use super::{files, Edit, EditArgs, MultiEditArgs, ToolError, ToolLimits, ToolOutput};
use crate::workspace::Workspace;

pub(super) fn run(
    ws: &Workspace,
    args: &EditArgs,
    limits: &ToolLimits,
) -> Result<ToolOutput, ToolError> {
    let multi = MultiEditArgs {
        file_path: args.file_path.clone(),
        edits: vec![Edit {
            old_string: args.old_string.clone(),
            new_string: args.new_string.clone(),
            replace_all: args.replace_all,
        }],
    };
    match files::multi_edit(ws, &multi, limits) {
        Ok(mut out) => {
            let n = out.data["replacements"].as_u64().unwrap_or(0);
            let shown = out.data["path"].as_str().unwrap_or_default().to_string();
            out.text = if out.data["created"] == true {
                format!("Created {shown}")
            } else {
                format!("Edited {shown}: {n} replacement(s)")
            };
            Ok(out)
        }
        Err(ToolError::Edit { reason, .. }) => Err(ToolError::InvalidArgument(format!(
            "{reason}; {} was not changed",
            args.file_path
        ))),
        Err(e) => Err(e),
    }
}
