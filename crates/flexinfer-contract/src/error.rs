//! Rendering an error for a person or a log: its message followed by its causes.
//!
//! The workspace's own errors keep an underlying error as their `source()` and leave it out of their
//! message (`"reading {path}"`, not `"reading {path}: {source}"`), so `to_string()` alone loses the
//! cause: every place that shows an error to a user, a log line, a status condition, an Event or a
//! termination message renders it with [`chain`].

/// `e`'s text followed by its causes (`source()`), each after `: `, as anyhow's `{:#}` prints them. A
/// cause whose text the message already contains is not repeated (an error of another library may
/// print its cause itself and also return it as `source()`), so the message names every cause exactly
/// once either way.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let own = c.to_string();
        if !text.contains(&own) {
            text.push_str(": ");
            text.push_str(&own);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::chain;
    use std::fmt;

    /// An error with a fixed message and an optional cause; `repeat` prints the cause in the message too.
    #[derive(Debug)]
    struct E {
        msg: &'static str,
        cause: Option<Box<E>>,
        repeat: bool,
    }

    impl fmt::Display for E {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.msg)?;
            match &self.cause {
                Some(c) if self.repeat => write!(f, ": {c}"),
                _ => Ok(()),
            }
        }
    }

    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.cause.as_deref().map(|c| c as _)
        }
    }

    fn leaf(msg: &'static str) -> E {
        E {
            msg,
            cause: None,
            repeat: false,
        }
    }

    fn wrap(msg: &'static str, cause: E, repeat: bool) -> E {
        E {
            msg,
            cause: Some(Box::new(cause)),
            repeat,
        }
    }

    #[test]
    fn chain_names_every_cause_once() {
        assert_eq!(chain(&leaf("no such file")), "no such file");
        let e = wrap("reading a.json", leaf("no such file"), false);
        assert_eq!(chain(&e), "reading a.json: no such file");
        // A cause the message already prints is not repeated.
        let e = wrap("reading a.json", leaf("no such file"), true);
        assert_eq!(chain(&e), "reading a.json: no such file");
        // Every level of the chain, in order.
        let e = wrap(
            "loading model",
            wrap("reading a.json", leaf("no such file"), false),
            false,
        );
        assert_eq!(chain(&e), "loading model: reading a.json: no such file");
        let e = wrap(
            "loading model",
            wrap("reading a.json", leaf("no such file"), true),
            false,
        );
        assert_eq!(chain(&e), "loading model: reading a.json: no such file");
    }
}
