//! `Edit`: one exact-string replacement in one file (Claude Code's Edit). It is a MultiEdit
//! of one edit: the same path rules, caps and all-or-nothing write, with messages that speak
//! of one edit.

use env_api::observation::ToolData;

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
            if let ToolData::Edit(d) = &out.data.details {
                out.text = if d.created {
                    format!("Created {}", d.path)
                } else {
                    format!("Edited {}: {} replacement(s)", d.path, d.replacements)
                };
            }
            Ok(out)
        }
        Err(ToolError::Edit { reason, detail, .. }) => {
            let detail = if detail.is_empty() {
                detail
            } else {
                format!("\n{detail}")
            };
            Err(ToolError::InvalidArgument(format!(
                "{reason}; {} was not changed{detail}",
                args.file_path
            )))
        }
        Err(e) => Err(e),
    }
}
