//! cube-storage
