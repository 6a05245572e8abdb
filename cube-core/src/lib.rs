//! cube-core
