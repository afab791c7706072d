//! Economics of SPEC §12 (revenue, pool sizes, storage band). Owned by the economics issue.
