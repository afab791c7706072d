//! Small typed identifiers, so a request id is never passed where a machine id is expected.

use serde::{Deserialize, Serialize};

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident($inner:ty)) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub struct $name(pub $inner);
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id_type!(
    /// One request (one turn of a session), unique within a trace.
    RequestId(u64)
);
id_type!(
    /// A session: the turns that share a growing context.
    SessionId(u64)
);
id_type!(
    /// A compute machine (8 GPUs); SWA state lives in its host memory.
    MachineId(u32)
);
id_type!(
    /// A storage node of the KV store cluster.
    StorageNodeId(u32)
);
id_type!(
    /// A prefill or decode engine (one DP rank group).
    EngineId(u32)
);
