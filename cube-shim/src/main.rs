//! The shim binary: containerd starts it as `containerd-shim-cubesandbox-v2`.

fn main() {
    containerd_shim::run::<cube_shim::shim::CubeShim>(cube_shim::RUNTIME_ID, None);
}
