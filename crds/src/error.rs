//! Errors on one line, for logs and messages.

/// `error: cause: cause`: an error and its sources on one line. A source whose text the line
/// already holds (an error that prints its cause itself) is not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Leaf(&'static str);

    #[derive(Debug, thiserror::Error)]
    #[error("{what}")]
    struct Wrapper {
        what: String,
        #[source]
        source: Leaf,
    }

    #[test]
    fn causes_follow_once_each() {
        let plain = Wrapper {
            what: "failed to read status".into(),
            source: Leaf("connection refused"),
        };
        assert_eq!(
            error_chain(&plain),
            "failed to read status: connection refused"
        );
        let repeating = Wrapper {
            what: "failed to read status: connection refused".into(),
            source: Leaf("connection refused"),
        };
        assert_eq!(
            error_chain(&repeating),
            "failed to read status: connection refused"
        );
    }
}
