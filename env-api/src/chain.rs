//! An error with its causes, for text that leaves the process as a string: API error bodies
//! and tool observations. Errors keep their causes as `source()`s and print only their own
//! message, so the causes are joined here, each once.

use std::error::Error;
use std::fmt;

/// Displays an error and each of its `source()`s after it, joined by `": "`.
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'e>(pub &'e (dyn Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(err) = cause {
            write!(f, ": {err}")?;
            cause = err.source();
        }
        Ok(())
    }
}

/// An error and its causes as one line: `"outer: inner: innermost"`.
pub fn error_chain(err: &(dyn Error + 'static)) -> String {
    ErrorChain(err).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("reading x")
        }
    }

    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_cause_once_in_order() {
        let err = Outer(std::io::Error::other("disk on fire"));
        assert_eq!(error_chain(&err), "reading x: disk on fire");
        let plain = std::io::Error::other("alone");
        assert_eq!(error_chain(&plain), "alone");
    }
}
