//! Trace-level replay (in progress).
