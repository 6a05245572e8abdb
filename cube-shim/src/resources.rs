//! The OCI spec's `linux.resources` that a Cube sandbox honours (memory, CPU quota,
//! pids) as Cube limits: at create from the container's spec, and on `Update` from
//! the resources containerd passes (the same JSON, in a protobuf `Any`).
//!
//! An OCI value that means "unlimited" (-1, 0 for pids) leaves Cube's limit as it is:
//! a sandbox always keeps a limit (Cube's defaults where none is asked for).

use cube_core::LimitChange;
use serde::Deserialize;

/// Why resources could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ResourcesError {
    /// Not the JSON of the OCI spec's `LinuxResources`.
    #[error("resources are not the OCI spec's LinuxResources JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// An `Any` of another type.
    #[error("resources of type {0:?}: expected the OCI spec's LinuxResources")]
    Type(String),
    /// A CPU period the kernel would refuse.
    #[error("CPU period {0} µs: must be positive")]
    Period(u64),
}

/// The kernel's default CFS period, µs: what a quota without a period is over.
const DEFAULT_CPU_PERIOD_US: u64 = 100_000;

/// The parts of `LinuxResources` Cube honours.
#[derive(Debug, Default, Deserialize)]
pub struct Resources {
    /// Memory.
    #[serde(default)]
    pub memory: Option<Memory>,
    /// CPU.
    #[serde(default)]
    pub cpu: Option<Cpu>,
    /// Processes.
    #[serde(default)]
    pub pids: Option<Pids>,
}

/// `LinuxResources.memory`.
#[derive(Debug, Default, Deserialize)]
pub struct Memory {
    /// Bytes; -1: unlimited.
    #[serde(default)]
    pub limit: Option<i64>,
}

/// `LinuxResources.cpu`.
#[derive(Debug, Default, Deserialize)]
pub struct Cpu {
    /// CFS quota per period, µs; -1: unlimited.
    #[serde(default)]
    pub quota: Option<i64>,
    /// CFS period, µs.
    #[serde(default)]
    pub period: Option<u64>,
}

/// `LinuxResources.pids`.
#[derive(Debug, Default, Deserialize)]
pub struct Pids {
    /// Most tasks; 0 or -1: unlimited.
    #[serde(default)]
    pub limit: Option<i64>,
}

impl Resources {
    /// Parses `LinuxResources` JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Resources, ResourcesError> {
        Ok(serde_json::from_slice(bytes)?)
    }

    /// Parses the `Any` of an `UpdateTaskRequest`: containerd marshals the OCI
    /// types as JSON under a type URL ending in `LinuxResources`.
    pub fn from_any(type_url: &str, value: &[u8]) -> Result<Resources, ResourcesError> {
        if !type_url.ends_with("/LinuxResources") {
            return Err(ResourcesError::Type(type_url.to_string()));
        }
        Resources::from_json(value)
    }

    /// As Cube limits: memory rounded up to whole MiB, the CPU quota over its
    /// period in thousandths of a core (rounded up), the pids limit.
    pub fn limits(&self) -> Result<LimitChange, ResourcesError> {
        let memory_mib = self
            .memory
            .as_ref()
            .and_then(|m| m.limit)
            .and_then(|b| u64::try_from(b).ok())
            .filter(|&b| b > 0)
            .map(|b| b.div_ceil(1 << 20));
        let cpu_millis = match self.cpu.as_ref() {
            Some(Cpu {
                quota: Some(quota),
                period,
            }) if *quota > 0 => {
                let period = period.unwrap_or(DEFAULT_CPU_PERIOD_US);
                if period == 0 {
                    return Err(ResourcesError::Period(period));
                }
                let millis = (*quota as u64).saturating_mul(1000).div_ceil(period);
                Some(u32::try_from(millis).unwrap_or(u32::MAX))
            }
            _ => None,
        };
        let pids_max = self
            .pids
            .as_ref()
            .and_then(|p| p.limit)
            .filter(|&l| l > 0)
            .map(|l| u32::try_from(l).unwrap_or(u32::MAX));
        Ok(LimitChange {
            memory_mib,
            cpu_millis,
            pids_max,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_values_become_cube_limits() {
        let r = Resources::from_json(
            br#"{"memory":{"limit":268435457},"cpu":{"quota":50000,"period":100000,"shares":2},"pids":{"limit":64}}"#,
        )
        .unwrap();
        assert_eq!(
            r.limits().unwrap(),
            LimitChange {
                memory_mib: Some(257),
                cpu_millis: Some(500),
                pids_max: Some(64),
            }
        );
        // A quota without a period is over the kernel's default period.
        let r = Resources::from_json(br#"{"cpu":{"quota":150000}}"#).unwrap();
        assert_eq!(r.limits().unwrap().cpu_millis, Some(1500));
    }

    #[test]
    fn unlimited_and_absent_values_change_nothing() {
        for json in [
            r#"{}"#,
            r#"{"memory":{"limit":-1},"cpu":{"quota":-1,"period":100000},"pids":{"limit":0}}"#,
            r#"{"memory":{},"cpu":{"shares":1024},"pids":{"limit":-1}}"#,
        ] {
            let r = Resources::from_json(json.as_bytes()).unwrap();
            assert!(r.limits().unwrap().is_empty(), "{json}");
        }
    }

    #[test]
    fn bad_input_is_refused_naming_what_is_wrong() {
        let e = Resources::from_json(br#"{"memory":{"limit":"lots"}}"#).unwrap_err();
        assert!(e.to_string().contains("LinuxResources JSON"), "{e}");
        let e = Resources::from_any("types.containerd.io/Other", b"{}").unwrap_err();
        assert!(e.to_string().contains("types.containerd.io/Other"), "{e}");
        let ok = Resources::from_any(
            "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources",
            br#"{"pids":{"limit":8}}"#,
        )
        .unwrap();
        assert_eq!(ok.limits().unwrap().pids_max, Some(8));
        let r = Resources::from_json(br#"{"cpu":{"quota":1000,"period":0}}"#).unwrap();
        assert!(r.limits().unwrap_err().to_string().contains("period 0"));
    }
}
