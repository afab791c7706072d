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
pub mod stream;
mod visit;

/// The longest trace line read (16 MiB); a longer one is an error, so a file with no line
/// ends (`/dev/zero`) cannot take the machine's memory.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The most block keys one trace (imported or generated) holds: 2^28 keys, 2 GiB. A few bytes
/// of a trace line can claim billions of tokens; this bounds what they cost.
pub const MAX_TRACE_BLOCKS: u64 = 1 << 28;

/// The most requests a generator makes (2^26): a config cannot ask for more work than that.
pub const MAX_GENERATED_REQUESTS: u64 = 1 << 26;

/// Counts the block keys of the chains a trace builds, refusing past [`MAX_TRACE_BLOCKS`].
#[derive(Default)]
pub(crate) struct BlockBudget {
    blocks: u64,
}

impl BlockBudget {
    pub(crate) fn charge(&mut self, chain: &servelab_core::ContentChain) -> Result<(), String> {
        self.blocks += chain.full_blocks(chain.total_tokens()).len() as u64;
        if self.blocks > MAX_TRACE_BLOCKS {
            return Err(format!(
                "the trace holds more than {MAX_TRACE_BLOCKS} blocks of {} tokens (2 GiB of keys): \
                 use a larger block size or a shorter trace",
                chain.block_tokens()
            ));
        }
        Ok(())
    }
}

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
