//! Importer: native (in progress).
