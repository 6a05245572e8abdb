//! Protobuf's canonical JSON mapping for the envd messages (what the SDKs' JSON codec
//! speaks): 64-bit integers as strings, bytes as base64, enums by name, timestamps as
//! RFC 3339. Readers are lenient as the mapping asks: numbers may come as strings,
//! enums as numbers, base64 with or without padding or URL-safe.

use base64::Engine as _;
use serde::de::{self, Deserializer, Visitor};
use serde::Serializer;

/// `bytes` fields: base64 (standard alphabet, padded) out; either alphabet in.
pub mod bytes_b64 {
    use super::*;

    /// Writes base64.
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    /// Reads base64 (null reads as empty).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s: Option<String> = serde::Deserialize::deserialize(d)?;
        decode(s.as_deref().unwrap_or("")).map_err(de::Error::custom)
    }

    /// Decodes standard or URL-safe base64, padded or not.
    pub fn decode(s: &str) -> Result<Vec<u8>, String> {
        let trimmed = s.trim_end_matches('=');
        let engine = if trimmed.contains(['-', '_']) {
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
        } else {
            &base64::engine::general_purpose::STANDARD_NO_PAD
        };
        engine
            .decode(trimmed)
            .map_err(|e| format!("Bad base64: {e}"))
    }
}

/// `int64` fields: a string out; a string or a number in.
pub mod i64_str {
    use super::*;

    /// Writes the number as a string.
    pub fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    /// Reads a number or a numeric string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        d.deserialize_any(IntVisitor)
            .and_then(|v| i64::try_from(v).map_err(|_| de::Error::custom("integer out of range")))
    }
}

/// 32-bit integer fields: a number out; a number or a numeric string in.
pub mod u32_lenient {
    use super::*;

    /// Writes the number.
    pub fn serialize<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(*v)
    }

    /// Reads a number or a numeric string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        d.deserialize_any(IntVisitor)
            .and_then(|v| u32::try_from(v).map_err(|_| de::Error::custom("integer out of range")))
    }
}

/// Signed 32-bit fields (`sint32`): a number out; a number or a numeric string in.
pub mod i32_lenient {
    use super::*;

    /// Writes the number.
    pub fn serialize<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i32(*v)
    }

    /// Reads a number or a numeric string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
        d.deserialize_any(IntVisitor)
            .and_then(|v| i32::try_from(v).map_err(|_| de::Error::custom("integer out of range")))
    }
}

struct IntVisitor;

impl Visitor<'_> for IntVisitor {
    type Value = i128;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an integer or a string holding one")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i128, E> {
        Ok(v.into())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i128, E> {
        Ok(v.into())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<i128, E> {
        if v.fract() == 0.0 && v.abs() < 9.0e18 {
            Ok(v as i128)
        } else {
            Err(E::custom("not an integer"))
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<i128, E> {
        v.trim()
            .parse::<i128>()
            .map_err(|_| E::custom(format!("{v:?} is not an integer")))
    }

    fn visit_unit<E: de::Error>(self) -> Result<i128, E> {
        Ok(0)
    }
}

/// Declares a serde module for an enum field held as `i32` (as prost holds them):
/// written by name, read by name or number.
macro_rules! proto_enum_json {
    ($module:ident, [$(($value:expr, $name:expr)),+ $(,)?]) => {
        /// An enum field by its protobuf name.
        pub mod $module {
            use serde::de::{self, Deserializer, Visitor};
            use serde::Serializer;

            const NAMES: &[(i32, &str)] = &[$(($value, $name)),+];

            /// Writes the value's name (its number when it has none).
            pub fn serialize<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
                match NAMES.iter().find(|(n, _)| n == v) {
                    Some((_, name)) => s.serialize_str(name),
                    None => s.serialize_i32(*v),
                }
            }

            struct EnumVisitor;

            impl Visitor<'_> for EnumVisitor {
                type Value = i32;

                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("an enum name or number")
                }

                fn visit_i64<E: de::Error>(self, v: i64) -> Result<i32, E> {
                    i32::try_from(v).map_err(|_| E::custom("enum number out of range"))
                }

                fn visit_u64<E: de::Error>(self, v: u64) -> Result<i32, E> {
                    i32::try_from(v).map_err(|_| E::custom("enum number out of range"))
                }

                fn visit_str<E: de::Error>(self, v: &str) -> Result<i32, E> {
                    NAMES
                        .iter()
                        .find(|(_, name)| *name == v)
                        .map(|(n, _)| *n)
                        .ok_or_else(|| E::custom(format!("unknown enum value {v:?}")))
                }

                fn visit_unit<E: de::Error>(self) -> Result<i32, E> {
                    Ok(0)
                }
            }

            /// Reads a name or a number.
            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
                d.deserialize_any(EnumVisitor)
            }
        }
    };
}

pub(crate) use proto_enum_json;

/// Days since 1970-01-01 to a civil (year, month, day), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A civil date to days since 1970-01-01.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// RFC 3339 in UTC, e.g. `2024-05-01T12:00:00.123Z` (fraction only when non-zero).
pub fn rfc3339(seconds: i64, nanos: u32) -> String {
    let days = seconds.div_euclid(86_400);
    let secs = seconds.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    let (h, mi, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    if nanos == 0 {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
    } else {
        let frac = format!("{nanos:09}");
        format!(
            "{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{}Z",
            frac.trim_end_matches('0')
        )
    }
}

/// Reads an RFC 3339 timestamp (`Z` or a numeric offset) into Unix seconds and nanos.
pub fn parse_rfc3339(s: &str) -> Option<(i64, u32)> {
    let s = s.trim();
    let (date, rest) = s.split_once(['T', 't', ' '])?;
    let mut dp = date.splitn(3, '-');
    let year: i64 = dp.next()?.parse().ok()?;
    let month: u32 = dp.next()?.parse().ok()?;
    let day: u32 = dp.next()?.parse().ok()?;
    let (time, offset_secs) = if let Some(t) = rest.strip_suffix(['Z', 'z']) {
        (t, 0i64)
    } else {
        let pos = rest.rfind(['+', '-'])?;
        let (t, off) = rest.split_at(pos);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (oh, om) = off[1..].split_once(':')?;
        let oh: i64 = oh.parse().ok()?;
        let om: i64 = om.parse().ok()?;
        (t, sign * (oh * 3600 + om * 60))
    };
    let (hms, frac) = match time.split_once('.') {
        Some((a, b)) => (a, b),
        None => (time, ""),
    };
    let mut tp = hms.splitn(3, ':');
    let h: i64 = tp.next()?.parse().ok()?;
    let mi: i64 = tp.next()?.parse().ok()?;
    let sec: i64 = tp.next()?.parse().ok()?;
    let nanos = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().take(9).collect();
        let n: u32 = digits.parse().ok()?;
        n * 10u32.pow(9 - digits.len() as u32)
    };
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some((
        days * 86_400 + h * 3600 + mi * 60 + sec - offset_secs,
        nanos,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(1_700_000_000, 500_000_000),
            "2023-11-14T22:13:20.5Z"
        );
        assert_eq!(
            parse_rfc3339("2023-11-14T22:13:20.5Z"),
            Some((1_700_000_000, 500_000_000))
        );
        assert_eq!(
            parse_rfc3339("2023-11-14T23:13:20+01:00"),
            Some((1_700_000_000, 0))
        );
        assert_eq!(parse_rfc3339("not a time"), None);
        for t in [0i64, 951_782_400, 4_102_444_800, -86_400] {
            assert_eq!(parse_rfc3339(&rfc3339(t, 0)), Some((t, 0)));
        }
    }

    #[test]
    fn base64_reads_both_alphabets() {
        assert_eq!(bytes_b64::decode("aGk=").unwrap(), b"hi");
        assert_eq!(bytes_b64::decode("aGk").unwrap(), b"hi");
        assert_eq!(bytes_b64::decode("-_8").unwrap(), vec![0xfb, 0xff]);
        assert!(bytes_b64::decode("!!").is_err());
    }
}
