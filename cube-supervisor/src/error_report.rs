//! One line for an error and every cause under it, for logs and for people.

/// `error: cause: cause's cause ...`.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("Outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn causes_follow_the_error() {
        let e = Outer(std::io::Error::other("inner"));
        assert_eq!(super::chain(&e), "Outer: inner");
    }
}
