//! What an edit that cannot place its `old_string` shows the agent: the string it gave and
//! where the file holds the nearest text, so that the next attempt copies the file's own
//! text instead of guessing again.

use std::fmt::Write as _;

/// Lines of `old_string` echoed back; a longer one is cut with a note.
const ECHO_LINES: usize = 12;
/// Characters of one echoed line.
const ECHO_LINE_CHARS: usize = 160;
/// Lines of `old_string` compared with the file: the first few place a block well enough,
/// and bound the work per window.
const COMPARE_LINES: usize = 8;
/// Characters of a line compared (a long line's start tells it apart from others).
const COMPARE_CHARS: usize = 200;
/// File lines searched: beyond them the search would cost more than the hint is worth on
/// an 8 MiB file; the note says so.
const SEARCH_LINES: usize = 20_000;
/// Line numbers listed for a string that appears many times.
const LISTED_PLACES: usize = 8;
/// Below this similarity (0..1, bigram Dice averaged over the compared lines) nothing in
/// the file resembles the string and no match is shown.
const MIN_SIMILARITY: f64 = 0.3;

/// `old_string` as shown back: its lines, numbered from 1 and indented, cut past
/// [`ECHO_LINES`].
pub(super) fn echo(old: &str) -> String {
    let lines: Vec<&str> = old.lines().collect();
    let mut out = String::new();
    for line in lines.iter().take(ECHO_LINES) {
        let _ = writeln!(out, "    |{}", cut(line, ECHO_LINE_CHARS));
    }
    if lines.len() > ECHO_LINES {
        let _ = writeln!(
            out,
            "    [... {} more line(s) of old_string]",
            lines.len() - ECHO_LINES
        );
    }
    out
}

fn cut(line: &str, max: usize) -> String {
    let mut s: String = line.chars().take(max).collect();
    if s.len() < line.len() {
        s.push_str(" [line cut]");
    }
    s
}

/// The 1-based line numbers where `needle` starts in `text`, at most [`LISTED_PLACES`] of
/// them, and whether there were more.
pub(super) fn places(text: &str, needle: &str) -> (Vec<usize>, bool) {
    let mut out = Vec::new();
    let mut line = 1;
    let mut counted_to = 0;
    for (at, _) in text.match_indices(needle) {
        line += text[counted_to..at].matches('\n').count();
        counted_to = at;
        if out.len() == LISTED_PLACES {
            return (out, true);
        }
        out.push(line);
    }
    (out, false)
}

/// The block of `text` most like `old`: its first line (1-based), its lines, how alike
/// they are (0..1) and whether they differ from `old` in whitespace alone.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Nearest {
    /// 1-based line of the block's start.
    pub line: usize,
    /// The file's lines of the block.
    pub lines: Vec<String>,
    /// Bigram similarity over the compared lines, 0..1.
    pub similarity: f64,
    /// The block equals `old` once leading and trailing spaces of each line are dropped.
    pub whitespace_only: bool,
}

/// Sorted character bigrams of a line's trimmed text (cut to [`COMPARE_CHARS`]).
fn bigrams(line: &str) -> Vec<(char, char)> {
    let chars: Vec<char> = line.trim().chars().take(COMPARE_CHARS).collect();
    let mut out: Vec<(char, char)> = chars.windows(2).map(|w| (w[0], w[1])).collect();
    out.sort_unstable();
    out
}

/// Dice coefficient of two sorted bigram multisets; two empty lines are alike.
fn dice(a: &[(char, char)], b: &[(char, char)]) -> f64 {
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let (mut i, mut j, mut common) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
        }
    }
    2.0 * common as f64 / (a.len() + b.len()) as f64
}

/// The block of `text` (as many lines as `old` has) most like `old`, or `None` when nothing
/// is alike enough to help; the second value says the search stopped at [`SEARCH_LINES`].
pub(super) fn nearest(text: &str, old: &str) -> (Option<Nearest>, bool) {
    let old_lines: Vec<&str> = old.lines().collect();
    if old_lines.is_empty() {
        return (None, false);
    }
    let file_lines: Vec<&str> = text.lines().collect();
    let searched = file_lines.len().min(SEARCH_LINES);
    let capped = file_lines.len() > SEARCH_LINES;
    let k = old_lines.len().min(COMPARE_LINES);
    // Blank lines of `old` say little about where it belongs; weigh the others only, unless
    // every compared line is blank.
    let weighted: Vec<usize> = (0..k)
        .filter(|&i| !old_lines[i].trim().is_empty())
        .collect();
    let weighted = if weighted.is_empty() {
        (0..k).collect()
    } else {
        weighted
    };
    let old_grams: Vec<Vec<(char, char)>> = old_lines[..k].iter().map(|l| bigrams(l)).collect();
    let file_grams: Vec<Vec<(char, char)>> =
        file_lines[..searched].iter().map(|l| bigrams(l)).collect();
    let mut best: Option<(usize, f64)> = None;
    for start in 0..searched {
        let score: f64 = weighted
            .iter()
            .map(|&i| {
                file_grams
                    .get(start + i)
                    .map_or(0.0, |g| dice(&old_grams[i], g))
            })
            .sum::<f64>()
            / weighted.len() as f64;
        if best.is_none_or(|(_, s)| score > s) {
            best = Some((start, score));
        }
    }
    let found = best
        .filter(|&(_, s)| s >= MIN_SIMILARITY)
        .map(|(start, similarity)| {
            let end = (start + old_lines.len()).min(file_lines.len());
            let lines: Vec<String> = file_lines[start..end]
                .iter()
                .map(|l| l.to_string())
                .collect();
            let whitespace_only = lines.len() == old_lines.len()
                && lines
                    .iter()
                    .zip(&old_lines)
                    .all(|(a, b)| a.trim() == b.trim());
            Nearest {
                line: start + 1,
                lines,
                similarity,
                whitespace_only,
            }
        });
    (found, capped)
}

/// The lines after a failed placement: `old_string` echoed, then the nearest block of the
/// file with its line numbers (or that nothing resembles it). `file` names the text searched.
pub(super) fn not_found_detail(text: &str, old: &str, file: &str) -> String {
    let mut out = format!("old_string was:\n{}", echo(old));
    let (found, capped) = nearest(text, old);
    match found {
        Some(n) => {
            let what = if n.whitespace_only {
                "the same text with other indentation or spacing"
            } else {
                "the closest text"
            };
            let last = n.line + n.lines.len().saturating_sub(1);
            let span = if last > n.line {
                format!("lines {}-{last}", n.line)
            } else {
                format!("line {}", n.line)
            };
            let _ = writeln!(out, "{what} in {file}, {span}:");
            for (i, l) in n.lines.iter().take(ECHO_LINES).enumerate() {
                let _ = writeln!(out, "{:>6}|{}", n.line + i, cut(l, ECHO_LINE_CHARS));
            }
            if n.lines.len() > ECHO_LINES {
                let _ = writeln!(out, "    [... {} more line(s)]", n.lines.len() - ECHO_LINES);
            }
            out.push_str("copy the file's text exactly (Read shows it), whitespace included");
        }
        None => {
            let _ = write!(
                out,
                "nothing in {file} resembles it; Read the file and copy the text to replace"
            );
        }
    }
    if capped {
        let _ = write!(out, "\n(only the first {SEARCH_LINES} lines were searched)");
    }
    out
}

/// The lines after an ambiguous placement: `old_string` echoed and where it appears.
pub(super) fn ambiguous_detail(text: &str, old: &str, file: &str) -> String {
    let (lines, more) = places(text, old);
    let listed: Vec<String> = lines.iter().map(usize::to_string).collect();
    format!(
        "old_string was:\n{}it starts at lines {}{} of {file}",
        echo(old),
        listed.join(", "),
        if more { ", ..." } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_line_numbers_of_each_start() {
        let text = "a x\nb\nx\nc x\n";
        assert_eq!(places(text, "x"), (vec![1, 3, 4], false));
        let many = "y\n".repeat(LISTED_PLACES + 2);
        let (p, more) = places(&many, "y");
        assert_eq!(p.len(), LISTED_PLACES);
        assert!(more);
        assert_eq!(p[LISTED_PLACES - 1], LISTED_PLACES);
    }

    #[test]
    fn the_nearest_block_is_found_and_whitespace_is_told_apart() {
        let text = "import torch\n\ndef f(x):\n    y = x + 1\n    return y\n";
        let (n, capped) = nearest(text, "def f(x):\n  y = x + 1");
        let n = n.unwrap();
        assert!(!capped);
        assert_eq!(n.line, 3);
        assert_eq!(n.lines, ["def f(x):", "    y = x + 1"]);
        assert!(n.whitespace_only);
        let (n, _) = nearest(text, "    return z");
        let n = n.unwrap();
        assert_eq!(n.line, 5);
        assert!(!n.whitespace_only);
        assert!(n.similarity > 0.5 && n.similarity < 1.0, "{n:?}");
        assert_eq!(nearest(text, "qqqqqqqqqqq wwwwwww").0, None);
    }

    #[test]
    fn a_long_old_string_is_echoed_cut() {
        let old: String = (0..20).map(|i| format!("line {i}\n")).collect();
        let e = echo(&old);
        assert!(e.contains("    |line 0\n"), "{e}");
        assert!(!e.contains("line 12\n"), "{e}");
        assert!(e.contains("8 more line(s)"), "{e}");
    }
}
