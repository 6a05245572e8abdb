//! Sandbox networking in the CLI: the `--network` flags of `cube sandbox create` (and
//! of `cube run` and `cube code`), and
//! `cube sandbox net | policy | expose` on a live sandbox.

use clap::Args;
use cube_core::network::{NetworkOptions, NetworkPolicy, NetworkReport, PortMapping};

use crate::cli_error::{chain, CliError};

/// The egress policy flags (create and `cube sandbox policy`).
#[derive(Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Reachable even where the defaults refuse it (private ranges, the host itself
    /// as an exact /32); repeatable.
    #[arg(long = "allow-out", value_name = "CIDR")]
    pub allow_out: Vec<String>,
    /// Refused (the longer matching prefix of allow and deny wins); repeatable.
    #[arg(long = "deny-out", value_name = "CIDR")]
    pub deny_out: Vec<String>,
    /// Refuse every destination no --allow-out names.
    #[arg(long)]
    pub no_internet: bool,
}

impl PolicyArgs {
    fn touched(&self) -> bool {
        !self.allow_out.is_empty() || !self.deny_out.is_empty() || self.no_internet
    }

    /// The policy these flags describe; malformed CIDRs are refused here.
    pub fn policy(&self) -> Result<NetworkPolicy, CliError> {
        let policy = NetworkPolicy {
            internet: !self.no_internet,
            allow_out: self.allow_out.clone(),
            deny_out: self.deny_out.clone(),
        };
        policy.to_egress().map_err(|e| CliError::usage(chain(&e)))?;
        Ok(policy)
    }
}

/// The network flags of `cube sandbox create`.
#[derive(Args, Debug, Clone, Default)]
pub struct NetworkArgs {
    /// Give the sandbox a network (NAT through the host; private ranges and the host
    /// refused unless allowed). Implied by the other network flags. Without it the
    /// sandbox has loopback only.
    #[arg(long)]
    pub network: bool,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Serve a sandbox port on the host's addresses (not 127.0.0.1); repeatable.
    #[arg(long = "expose", value_name = "PORT[:SANDBOX_PORT]", value_parser = parse_port)]
    pub expose: Vec<PortMapping>,
}

impl NetworkArgs {
    /// The create options these flags ask for; None: no network.
    pub fn options(&self) -> Result<Option<NetworkOptions>, CliError> {
        if !self.network && !self.policy.touched() && self.expose.is_empty() {
            return Ok(None);
        }
        Ok(Some(NetworkOptions {
            policy: self.policy.policy()?,
            expose: self.expose.clone(),
        }))
    }
}

/// `PORT` or `HOST_PORT:SANDBOX_PORT`.
pub fn parse_port(text: &str) -> Result<PortMapping, String> {
    text.parse::<PortMapping>().map_err(|e| e.to_string())
}

/// Prints a sandbox's network, as JSON or as a few lines.
pub fn print_report(report: &NetworkReport, json: bool) -> Result<(), CliError> {
    if json {
        let text = serde_json::to_string_pretty(report).map_err(|e| CliError::failed(chain(&e)))?;
        println!("{text}");
        return Ok(());
    }
    let device = if report.host_ifname.is_empty() {
        "none (hibernated)"
    } else {
        &report.host_ifname
    };
    let list = |l: &[String]| {
        if l.is_empty() {
            "-".to_string()
        } else {
            l.join(", ")
        }
    };
    let c = &report.counters;
    println!(
        "device     {device} (guest {} via {})",
        report.guest_addr, report.gateway
    );
    println!(
        "internet   {}",
        if report.policy.internet { "on" } else { "off" }
    );
    println!("allow-out  {}", list(&report.policy.allow_out));
    println!("deny-out   {}", list(&report.policy.deny_out));
    let ports: Vec<String> = report.exposed.iter().map(PortMapping::to_string).collect();
    println!("exposed    {}", list(&ports));
    println!(
        "sent       {} packets, {} bytes\nreceived   {} packets, {} bytes\ndropped    {} packets",
        c.tx_packets, c.tx_bytes, c.rx_packets, c.rx_bytes, c.dropped
    );
    Ok(())
}
