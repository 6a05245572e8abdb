//! What templates are built from: a jail template's tree (a directory, or Debian
//! packages), a VM template's spec, and the shapes of VMs (see
//! [`crate::Runtime::build_jail_template`], [`crate::Runtime::build_vm_template`],
//! [`crate::Runtime::build_test_template`]).

pub use cube_supervisor::jail_spec::locate_agent;
pub use cube_supervisor::templates::debian::{
    DebianRootfs, RootfsBuildError, BASE_PACKAGES, DEFAULT_MIRROR, DEFAULT_SUITE,
};
pub use cube_supervisor::templates::image_agent;
pub use cube_supervisor::templates::tree::{TemplateBuildError, TreeSource};
pub use cube_supervisor::templates::vm::{
    cube_guest_kernel, default_kernel, DefaultKernel, VmTemplateError, VmTemplateSpec,
    CUBE_GUEST_KERNEL, DEBIAN_CLOUD_KERNEL, PVM_STOCK_KERNEL,
};
pub use cube_vmm::persist::{MachineConfig, WorkingSet};
