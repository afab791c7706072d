//! servelab-workloads: seeded generators (agent sessions, chat sessions, fresh documents) and
//! importers for real traces (Mooncake JSONL, Azure 2023 CSV, servelab's native JSONL).
//!
//! Everything produces a [`Trace`]: requests sorted by (arrival, id), keyed at one block size.

use servelab_core::Request;
use std::path::PathBuf;
use thiserror::Error;

pub mod azure;
pub mod dist;
pub mod generate;
pub mod mooncake;
pub mod native;

/// Requests in arrival order (ties broken by id), all keyed at `block_tokens`.
#[derive(Clone, Debug)]
pub struct Trace {
    pub block_tokens: u32,
    pub requests: Vec<Request>,
}

impl Trace {
    pub fn new(block_tokens: u32, mut requests: Vec<Request>) -> Self {
        requests.sort_by_key(|r| (r.arrival, r.id));
        Trace {
            block_tokens,
            requests,
        }
    }
    pub fn len(&self) -> usize {
        self.requests.len()
    }
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
    pub fn input_tokens(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| u64::from(r.prompt_tokens))
            .sum()
    }
    pub fn output_tokens(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| u64::from(r.output_tokens))
            .sum()
    }
}

/// Errors reading a trace: always the file, and for bad content the line and the field.
#[derive(Debug, Error)]
pub enum TraceError {
    /// The cause is part of the message (not a `source`), so error chains don't repeat it.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}:{line}: field `{field}`: {reason}")]
    Field {
        path: PathBuf,
        line: usize,
        field: String,
        reason: String,
    },
    #[error("{path}:{line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
}
