//! CRIU release numbers, as `criu --version` prints them.

use std::fmt;

/// A CRIU release number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CriuVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch level (0 when the release has none).
    pub patch: u32,
}

impl fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Parses the `Version: X.Y[.Z]` line of `criu --version`.
pub fn parse_version(output: &str) -> Option<CriuVersion> {
    let line = output
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?;
    let mut parts = line.trim().split('.');
    let mut next = |required: bool| -> Option<u32> {
        match parts.next() {
            Some(p) => {
                let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
                digits.parse().ok()
            }
            None if required => None,
            None => Some(0),
        }
    };
    Some(CriuVersion {
        major: next(true)?,
        minor: next(true)?,
        patch: next(false)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        let v = parse_version("Version: 4.1.1\nGitID: v4.1.1\n").unwrap();
        assert_eq!(
            v,
            CriuVersion {
                major: 4,
                minor: 1,
                patch: 1
            }
        );
        assert_eq!(v.to_string(), "4.1.1");
        let v = parse_version("Version: 3.17\n").unwrap();
        assert_eq!((v.major, v.minor, v.patch), (3, 17, 0));
        assert!(
            v < CriuVersion {
                major: 4,
                minor: 0,
                patch: 0
            }
        );
        assert_eq!(parse_version("criu 4.1"), None);
        assert_eq!(parse_version("Version: x.y"), None);
        assert_eq!(parse_version(""), None);
    }
}
