//! Importer: azure (in progress).
