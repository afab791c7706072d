//! Configuration errors that name the field that was wrong.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum ConfigError {
    /// A value is out of range or inconsistent with another.
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

impl ConfigError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
