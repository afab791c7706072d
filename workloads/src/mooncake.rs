//! Importer: mooncake (in progress).
