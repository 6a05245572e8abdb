//! Building templates, all in one place: a jail template's root filesystem tree, from
//! a directory, Debian packages or a container image ([`tree`], [`debian`],
//! [`oci`]), and a VM template, a
//! Linux guest booted from such a tree's disk image and snapshotted once its agent
//! answers ([`vm`]), with a statically linked agent in its image ([`image_agent`]) and
//! the image's User in numbers for that agent ([`image_user`]). A build happens in a store staging directory and appears in place
//! with one rename, or not at all; [`mounts`] makes sure a killed build's mounts never
//! lead a removal onto the host's files.

pub mod debian;
pub mod image_agent;
pub mod image_user;
pub mod mounts;
pub mod oci;
pub mod tree;
pub mod vm;
