//! What Cube's fuzz targets share.

pub mod allocation_watch;
