//! Sandbox ids as E2B clients see them. E2B routes sandbox traffic by host name
//! (`<port>-<sandboxID>.<domain>`), so its ids have no hyphens; Cube's are `sb-` and 16
//! hex digits. The E2B id is the hex part, and the mapping is reversible.

/// The prefix of Cube sandbox ids.
const CUBE_PREFIX: &str = "sb-";

/// The E2B id of a Cube sandbox id.
pub fn to_e2b(cube_id: &str) -> String {
    cube_id
        .strip_prefix(CUBE_PREFIX)
        .unwrap_or(cube_id)
        .to_string()
}

/// The Cube id of an E2B id, when it is one this server hands out. E2B clients also
/// send `<sandboxID>-<clientID>` in places; the part before a hyphen counts.
pub fn to_cube(e2b_id: &str) -> Option<String> {
    let id = e2b_id.split('-').next().unwrap_or("");
    let ok = id.len() == 16
        && id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    ok.then(|| format!("{CUBE_PREFIX}{id}"))
}

/// Reads `<port>-<sandboxID>.<domain>` (E2B's sandbox host names); the domain is not
/// checked, so a server behind any wildcard name routes.
pub fn parse_sandbox_host(host: &str) -> Option<(u16, String)> {
    let host = host.split(':').next().unwrap_or(host);
    let first = host.split('.').next()?;
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    Some((port, to_cube(id)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_map_both_ways() {
        let cube = "sb-0123456789abcdef";
        let e2b = to_e2b(cube);
        assert_eq!(e2b, "0123456789abcdef");
        assert!(!e2b.contains('-'));
        assert_eq!(to_cube(&e2b).as_deref(), Some(cube));
        assert_eq!(to_cube("0123456789abcdef-client").as_deref(), Some(cube));
        for bad in [
            "",
            "sb-0123456789abcdef",
            "0123456789ABCDEF",
            "0123",
            "../../etc",
        ] {
            assert_eq!(to_cube(bad), None, "{bad}");
        }
    }

    #[test]
    fn sandbox_hosts_parse() {
        assert_eq!(
            parse_sandbox_host("49983-0123456789abcdef.cube.local:3000"),
            Some((49983, "sb-0123456789abcdef".into()))
        );
        assert_eq!(parse_sandbox_host("127.0.0.1:3000"), None);
        assert_eq!(parse_sandbox_host("api.cube.local"), None);
    }
}
