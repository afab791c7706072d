//! Seeded workload generators (SPEC §13).
