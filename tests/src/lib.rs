//! Helpers of the cross-crate integration tests.

pub mod swarm;
