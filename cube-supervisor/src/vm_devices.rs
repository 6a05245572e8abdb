//! The virtio devices of a Linux guest, in one place for the VM templates that boot it
//! and the sandboxes restored from them: a root disk, vsock (where its agent listens),
//! entropy, and a NIC (with a TAP behind it for a sandbox with a network).

use std::path::Path;

use cube_devices::records::DeviceKind;
use cube_devices::virtio::block::{Block, BlockOptions};
use cube_devices::virtio::device::VirtioDevice;
use cube_devices::virtio::net::Net;
use cube_devices::virtio::rng::Rng;
use cube_devices::virtio::tap::Tap;
use cube_devices::virtio::vsock::Vsock;

use crate::error_report::chain as error_chain;

/// The guest context id of a template's guest.
pub const TEMPLATE_GUEST_CID: u64 = 3;
/// The MAC address of a template's guest NIC (locally administered). Every sandbox
/// has it: each sits alone behind its own TAP.
pub const TEMPLATE_GUEST_MAC: [u8; 6] = [0x06, 0xcb, 0xa9, 0xfe, 0x00, 0x02];

/// The devices of a VM template's guest, in their order: the root disk `disk`, vsock
/// with its host side listening on `vsock_socket`, entropy, and a NIC with nothing
/// behind it.
pub fn template_devices(
    disk: &Path,
    vsock_socket: &Path,
) -> Result<Vec<Box<dyn VirtioDevice>>, String> {
    let kinds = [
        DeviceKind::Block,
        DeviceKind::Vsock,
        DeviceKind::Rng,
        DeviceKind::Net,
    ];
    devices_of(&kinds, disk, vsock_socket, None)
}

/// Devices for a guest whose snapshot recorded `kinds`, in that order: `disk` as the
/// root disk, the vsock host side on `vsock_socket`, and `tap` behind the NIC (or
/// nothing). A TAP the guest has no NIC for is an error: a guest gets no device after
/// it booted.
pub fn snapshot_devices(
    kinds: &[DeviceKind],
    disk: &Path,
    vsock_socket: &Path,
    tap: Option<Tap>,
) -> Result<Vec<Box<dyn VirtioDevice>>, String> {
    if tap.is_some() && !kinds.contains(&DeviceKind::Net) {
        return Err(
            "the guest of this snapshot has no network device, so the sandbox cannot have a \
             network (build the template again: templates now get a NIC)"
                .into(),
        );
    }
    devices_of(kinds, disk, vsock_socket, tap)
}

fn devices_of(
    kinds: &[DeviceKind],
    disk: &Path,
    vsock_socket: &Path,
    mut tap: Option<Tap>,
) -> Result<Vec<Box<dyn VirtioDevice>>, String> {
    let mut seen = Vec::with_capacity(kinds.len());
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::with_capacity(kinds.len());
    for &kind in kinds {
        // One host side each: a second disk, socket or NIC has nothing to stand for.
        if seen.contains(&kind) {
            return Err(format!("the snapshot has more than one {kind:?} device"));
        }
        seen.push(kind);
        devices.push(match kind {
            DeviceKind::Block => Box::new(
                Block::open(disk, BlockOptions::default())
                    .map_err(|e| format!("opening {}: {}", disk.display(), error_chain(&e)))?,
            ),
            DeviceKind::Vsock => {
                Box::new(Vsock::new(TEMPLATE_GUEST_CID, vsock_socket).map_err(|e| error_chain(&e))?)
            }
            DeviceKind::Rng => Box::new(Rng::new()),
            DeviceKind::Net => Box::new(
                match tap.take() {
                    Some(tap) => Net::new(tap, TEMPLATE_GUEST_MAC),
                    None => Net::disconnected(TEMPLATE_GUEST_MAC),
                }
                .map_err(|e| error_chain(&e))?,
            ),
        });
    }
    Ok(devices)
}
