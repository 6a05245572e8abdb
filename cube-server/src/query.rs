//! Query strings as the SDKs write them (form-urlencoded): pairs and percent-decoding,
//! for the control plane's filters and the sandbox plane's `/files` parameters.

/// `a=1&b=%20x` into pairs (form-urlencoded, as the SDKs write query strings).
pub(crate) fn pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Percent-decodes a query component (`+` is a space, as in forms).
pub(crate) fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or(""), 16)
            {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_escapes_stay_as_written() {
        assert_eq!(decode("%zz"), "%zz");
        assert_eq!(decode("%4"), "%4");
        assert_eq!(decode("a+b%2F"), "a b/");
    }

    #[test]
    fn pairs_without_value_are_empty() {
        assert_eq!(
            pairs("a&b=1&&c="),
            vec![
                ("a".to_string(), String::new()),
                ("b".to_string(), "1".to_string()),
                ("c".to_string(), String::new())
            ]
        );
    }
}
