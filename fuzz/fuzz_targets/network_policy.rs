//! Network policies arrive from users (the CLI's `--allow-out`/`--deny-out`/`--expose`,
//! the service's JSON bodies, the Python binding): parsing must never panic, and what
//! parses must print back to text that parses to the same value.
//!
//! The input is read twice: as a JSON `NetworkOptions` (the service's and the
//! library's form), and line by line as CIDRs and port mappings (the CLI's form).

#![no_main]

use cube_supervisor::network::{Ipv4Cidr, NetworkOptions, PortMapping};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(options) = serde_json::from_slice::<NetworkOptions>(data) {
        // Valid or not, checking it must not panic; a valid one compiles for the
        // datapath and survives a JSON round trip unchanged.
        if options.validate().is_ok() {
            options
                .policy
                .to_egress()
                .expect("a validated policy compiles");
        }
        let text = serde_json::to_vec(&options).expect("options serialize");
        let again: NetworkOptions =
            serde_json::from_slice(&text).expect("written options read back");
        assert_eq!(again, options, "options changed through JSON");
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for line in text.lines() {
        if let Ok(cidr) = line.trim().parse::<Ipv4Cidr>() {
            let printed = cidr.to_string();
            let again: Ipv4Cidr = printed.parse().expect("a printed CIDR parses");
            assert_eq!(again, cidr, "{line:?} printed as {printed:?}");
            assert!(
                cidr.contains(cidr.addr()),
                "{cidr} does not contain its own address"
            );
        }
        if let Ok(port) = line.parse::<PortMapping>() {
            assert!(
                port.host_port != 0 && port.sandbox_port != 0,
                "{line:?}: port 0"
            );
            let again: PortMapping = port.to_string().parse().expect("a printed mapping parses");
            assert_eq!(again, port);
        }
    }
});
