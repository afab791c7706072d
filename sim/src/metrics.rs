//! Streaming metrics: the serving unit's histograms (log buckets under 1 % wide).

pub use servelab_core::unit::Histogram;
