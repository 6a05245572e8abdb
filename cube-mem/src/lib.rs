//! cube-mem
